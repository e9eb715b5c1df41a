"""The sampler on real tiny models: exact KV caching for block-causal configs (hybrid ones included: the
Gated DeltaNet state and conv tail), padding invariance,
the bidirectional cache refresh, and reuse of one compiled program across sampling settings."""

import jax
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.model import params
from clover_jax.sampler import SamplerConfig, SamplerError, compile_count, generate

# Peaked logits (larger init) so that greedy choices are not decided by float rounding.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
SC = SamplerConfig(gen_length=24, block_length=8, steps=24, eos_stop=False, cache="none")


def numpy_init(cfg, seed):
    """Random weights drawn on the host (params.init would compile a program per config)."""
    rng = np.random.default_rng(seed)

    def leaf(s):
        if s.init in ("ones", "zeros", "constant"):
            return np.full(s.shape, {"ones": 1.0, "zeros": 0.0}.get(s.init, s.value), s.dtype)
        return (s.std * rng.standard_normal(s.shape, np.float32)).astype(s.dtype)

    return jax.device_put(jax.tree.map(leaf, params.abstract(cfg), is_leaf=params.is_spec))


def _block_causal(name):
    cfg = get_config(name, init_std=0.1)
    w = numpy_init(cfg, 0)
    if cfg.has_bd_weights:  # a right conv that really looks right
        w = w.replace(linear_layers=w.linear_layers.replace(attn=w.linear_layers.attn.replace(
            conv_right=0.5 * jax.random.normal(jax.random.key(0), w.linear_layers.attn.conv_right.shape))))
    return cfg, w


# test-clover-hybrid: Gated DeltaNet layers in block-diffusion mode (their state and conv tail cached)
@pytest.fixture(scope="module", params=["test-clover", "test-llada2", "test-clover-hybrid"])
def block_causal(request):
    return _block_causal(request.param)


@pytest.fixture(scope="module")
def clover():
    """One block-causal config, for checks that do not depend on the family."""
    return _block_causal("test-clover")


@pytest.fixture(scope="module", params=["test-clover", "test-clover-hybrid"])
def attention_and_hybrid(request):
    return _block_causal(request.param)


@pytest.fixture(scope="module")
def bidirectional():
    cfg = get_config("test-llada-moe", init_std=0.1)
    return cfg, numpy_init(cfg, 1)


# Passes without a cache: 3 blocks x 8 steps; on the absolute grid the prompts' 5-token tails open block 0
# (3 masks: 3 passes), then 3 whole blocks (24).
NFE = {"prompt": 24, "absolute": 27}


def test_kv_cache_is_exact_for_block_causal_models(block_causal):
    cfg, w = block_causal
    # Hybrid: the Gated DeltaNet's float32 recurrence and in-block tiles sum in a different order over a
    # window than over the whole canvas; the logits (about 1 in size) agree to ~2e-5 (machine-dependent).
    tol = {"atol": 5e-5, "rtol": 0} if cfg.is_hybrid else {"atol": 1e-5, "rtol": 0}
    for grid in ("prompt", "absolute") if cfg.family == "llada2_moe" else ("prompt",):
        sc = SC.replace(block_grid=grid)
        ref = generate(w, cfg, PROMPTS, sc, record_logits=True)
        assert not (ref.raw == cfg.mask_token_id).any() and ref.stats.nfe == NFE[grid]
        for cache in ("prefix", "dual"):
            got = generate(w, cfg, PROMPTS, sc.replace(cache=cache), record_logits=True)
            np.testing.assert_array_equal(got.raw, ref.raw, err_msg=cache)
            np.testing.assert_allclose(got.logits, ref.logits, err_msg=cache, **tol)
            assert got.stats.nfe == ref.stats.nfe + 1  # + the prompt prefill; block re-encoding rides on step 1
    # parallel decoding through the same two programs (threshold and steps are dynamic)
    fast = SC.replace(steps=6, threshold=0.3, block_grid="prompt")
    a = generate(w, cfg, PROMPTS, fast, record_logits=True)
    b = generate(w, cfg, PROMPTS, fast.replace(cache="prefix"), record_logits=True)
    np.testing.assert_array_equal(a.raw, b.raw)
    np.testing.assert_allclose(a.logits, b.logits, **tol)
    assert a.stats.nfe <= 6


def test_padding_invariance(attention_and_hybrid):
    """A prompt alone (no padding, batch of one) and inside a padded batch give the same greedy tokens."""
    cfg, w = attention_and_hybrid
    alone = generate(w, cfg, [[*PROMPTS[0][:3], 30, 31, 32, 33, 34]], SC)  # 8 tokens: P = 8, B = 1
    batch = generate(w, cfg, [PROMPTS[1], [*PROMPTS[0][:3], 30, 31, 32, 33, 34]], SC, record_logits=True)  # P=16 B=2
    assert alone.raw.shape == (1, 24)
    np.testing.assert_array_equal(alone.raw[0], batch.raw[1])


def test_changing_settings_reuses_the_compiled_program(block_causal):
    cfg, w = block_causal
    run = lambda sc: generate(w, cfg, PROMPTS, sc, record_logits=True).raw  # the exactness test's program
    run(SC)
    before = compile_count()
    outs = [run(SC.replace(**ch)) for ch in (
        dict(steps=12), dict(temperature=0.8, seed=1), dict(temperature=0.8, seed=2), dict(top_k=3, top_p=0.5),
        dict(remasking="entropy", threshold=0.9), dict(entropy_bound=0.5))]
    assert compile_count() == before
    assert not np.array_equal(outs[1], outs[2])  # seeds matter
    again = run(SC.replace(temperature=0.8, seed=1))
    np.testing.assert_array_equal(again, outs[1])  # and reproduce bit for bit


def test_bidirectional_caches_refresh_at_block_start(bidirectional):
    """Approximate caches: when each block is decided in its first step (a full refresh pass) they must
    agree with the uncached run exactly; with more steps they run to completion."""
    cfg, w = bidirectional
    one_step = SC.replace(steps=SC.n_blocks)
    ref = generate(w, cfg, PROMPTS, one_step, record_logits=True)
    for cache in ("prefix", "dual"):
        got = generate(w, cfg, PROMPTS, one_step.replace(cache=cache), record_logits=True)
        np.testing.assert_array_equal(got.raw, ref.raw, err_msg=cache)
        np.testing.assert_allclose(got.logits, ref.logits, atol=1e-5, rtol=0, err_msg=cache)
        assert got.stats.nfe == ref.stats.nfe == SC.n_blocks
        full = generate(w, cfg, PROMPTS, SC.replace(cache=cache), record_logits=True)
        assert not (full.raw == cfg.mask_token_id).any() and full.stats.nfe == 24


def test_guided_decoding_is_exact_with_a_cache(clover):
    """Guidance runs 2B rows (the unconditional ones with the prompt masked) through the same cache."""
    cfg, w = clover
    guided = SC.replace(cfg_scale=1.5, steps=12)
    ref = generate(w, cfg, PROMPTS, guided, record_logits=True)
    got = generate(w, cfg, PROMPTS, guided.replace(cache="prefix"), record_logits=True)
    np.testing.assert_array_equal(got.raw, ref.raw)
    np.testing.assert_allclose(got.logits, ref.logits, atol=1e-5, rtol=0)
    plain = generate(w, cfg, PROMPTS, guided.replace(cfg_scale=0.0), record_logits=True)
    assert not np.allclose(plain.logits, ref.logits, atol=1e-3)  # guidance really changed the logits


def test_sharded_run_matches_one_device(clover, devices):
    """Under a 2 (data) x 4 (expert) mesh the sampler gives the single-device tokens."""
    cfg, w = clover
    from clover_jax.mesh import layouts

    mesh = layouts.mesh_from_arg("cpu-8")
    sharded = jax.device_put(w, params.weight_shardings(cfg, mesh.mesh, mesh.rules))
    ref = generate(w, cfg, PROMPTS[:1], SC.replace(cache="prefix"), batch=2)
    got = generate(sharded, cfg, PROMPTS[:1], SC.replace(cache="prefix"), mesh=mesh)
    np.testing.assert_array_equal(got.raw, ref.raw)


def test_bidirectional_caches_are_exact_with_one_layer():
    """With one layer K/V depend only on token and position, so the stale parts of the approximate caches
    (prefix / finished blocks for `prefix`, the all-mask suffix for `dual`) are exact: every later step of
    a block, not just the refresh pass, must then match the uncached run."""
    cfg = get_config("test-llada-moe", init_std=0.1, n_layers=1)
    w = numpy_init(cfg, 2)
    ref = generate(w, cfg, PROMPTS, SC, record_logits=True)
    # Hybrid: the Gated DeltaNet's float32 recurrence and in-block tiles sum in a different order over a
    # window than over the whole canvas; the logits (about 1 in size) agree to ~2e-5 (machine-dependent).
    tol = {"atol": 5e-5, "rtol": 0} if cfg.is_hybrid else {"atol": 1e-5, "rtol": 0}
    for cache in ("prefix", "dual"):
        got = generate(w, cfg, PROMPTS, SC.replace(cache=cache), record_logits=True)
        np.testing.assert_array_equal(got.raw, ref.raw, err_msg=cache)
        np.testing.assert_allclose(got.logits, ref.logits, err_msg=cache, **tol)


def test_forced_prompt_bucket_shorter_than_a_block_is_refused(clover):
    cfg, w = clover
    with pytest.raises(SamplerError, match="block_length"):
        generate(w, cfg, [[5, 6]], SC.replace(cache="prefix"), prompt_len=4)
