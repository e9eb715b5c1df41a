"""Gated DeltaNet's conv and delta rule: both forms against transformers' own torch implementations
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn` of qwen3_5_moe),
against each other, carried state (prefix then rest = whole), padding and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.model import delta_rule as dr
from clover_jax.model import gated_deltanet as gdn
from clover_jax.model import short_conv

B, HK, HV, DK, DV = 2, 2, 4, 16, 8  # each key head shared by two value heads, as in Qwen3.5 (16 k / 32 v)


def _inputs(t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = dr.l2_normalize(jnp.asarray(rng.standard_normal((B, t, HK, DK)), jnp.float32))
    k = dr.l2_normalize(jnp.asarray(rng.standard_normal((B, t, HK, DK)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((B, t, HV, DV)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 0.5, (B, t, HV)), jnp.float32)  # log decay <= 0
    beta = jnp.asarray(rng.uniform(0.05, 0.95, (B, t, HV)), jnp.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize(("t", "chunk"), [(70, 64), (70, 16), (5, 64), (32, 32), (40, 24)])  # 24: not a power of 2
def test_chunked_equals_recurrent(t, chunk):
    q, k, v, g, beta = _inputs(t)
    s0 = jnp.asarray(np.random.default_rng(1).standard_normal((B, HV, DK, DV)), jnp.float32) * 0.1
    o_r, s_r = dr.delta_rule_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = dr.delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert o_c.shape == (B, t, HV, DV) and s_c.shape == (B, HV, DK, DV)
    assert float(jnp.abs(o_r).max()) > 0.1  # the state really carries something
    np.testing.assert_allclose(o_c, o_r, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s_c, s_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_prefix_then_rest_equals_whole(form):
    run = {"recurrent": dr.delta_rule_recurrent,
           "chunked": lambda *a: dr.delta_rule_chunked(*a, chunk=16)}[form]
    q, k, v, g, beta = _inputs(50)
    whole, s_whole = run(q, k, v, g, beta, None)
    cut = 23
    first, s = run(*(a[:, :cut] for a in (q, k, v, g, beta)), None)
    rest, s_end = run(*(a[:, cut:] for a in (q, k, v, g, beta)), s)
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), whole, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s_end, s_whole, atol=1e-5, rtol=1e-5)


def test_conv_tail_carries_and_skips_padding():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((B, 20, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    whole, tail_whole = short_conv.causal_conv(x, w)
    y1, tail = short_conv.causal_conv(x[:, :9], w)
    y2, tail_end = short_conv.causal_conv(x[:, 9:], w, tail)
    np.testing.assert_allclose(jnp.concatenate([y1, y2], axis=1), whole, atol=1e-6)
    np.testing.assert_allclose(tail_end, tail_whole)
    np.testing.assert_allclose(tail_whole, x[:, -3:])
    # A window that ends in padding hands on the last valid inputs: continuing equals the unpadded run.
    valid = jnp.arange(12)[None].repeat(B, 0) < 9
    padded = jnp.concatenate([x[:, :9], jnp.full((B, 3, 6), 7.0)], axis=1)
    y_pad, tail_pad = short_conv.causal_conv(padded, w, valid=valid)
    np.testing.assert_allclose(y_pad[:, :9], y1, atol=1e-6)
    np.testing.assert_allclose(tail_pad, tail)


def test_padding_columns_leave_the_state_alone():
    q, k, v, g, beta = _inputs(24)
    valid = jnp.ones((B, 24), bool).at[1, 16:].set(False)  # row 1: the last 8 columns are padding
    gm, bm = dr.mask_padding(g, beta, valid)
    _, s = dr.delta_rule_chunked(q, k, v, gm, bm, chunk=8)
    _, s_short = dr.delta_rule_recurrent(*(a[1:, :16] for a in (q, k, v, g, beta)))
    np.testing.assert_allclose(s[1:], s_short, atol=1e-5, rtol=1e-5)
    _, s_full = dr.delta_rule_recurrent(q, k, v, g, beta)
    np.testing.assert_allclose(s[:1], s_full[:1], atol=1e-5, rtol=1e-5)  # row 0 untouched by row 1's mask


def test_gradients_of_both_forms_agree():
    q, k, v, g, beta = _inputs(40, seed=3)

    def loss(fn, q, k, v, g, beta):
        o, s = fn(q, k, v, g, beta)
        return jnp.sum(jnp.sin(o)) + jnp.sum(s * s)

    chunked = lambda *a: dr.delta_rule_chunked(*a, chunk=16)
    args = (q, k, v, g, beta)
    want = jax.grad(lambda *a: loss(dr.delta_rule_recurrent, *a), argnums=(0, 1, 2, 3, 4))(*args)
    got = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], got, want, strict=True):
        assert float(jnp.abs(b).max()) > 0, name
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)


# ---- against transformers' own implementation ------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch", reason="parity with transformers needs torch (pip install '.[torch]')")
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                                   reason="transformers with qwen3_5_moe (5.x) is needed for parity")
    return torch, modeling


@pytest.mark.parametrize("t", [70, 9])
def test_delta_rule_matches_transformers(reference, t):
    torch, modeling = reference
    rng = np.random.default_rng(4)
    q, k = (rng.standard_normal((B, t, HK, DK)).astype(np.float32) for _ in range(2))  # un-normalised
    v = rng.standard_normal((B, t, HV, DV)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (B, t, HV)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (B, t, HV)).astype(np.float32)
    s0 = (rng.standard_normal((B, HV, DK, DV)) * 0.1).astype(np.float32)
    tq, tk, tv, tg, tb, ts = (torch.from_numpy(a) for a in (q, k, v, g, beta, s0))
    with torch.no_grad():
        want_c, want_sc = modeling.torch_chunk_gated_delta_rule(
            tq, tk, tv, g=tg, beta=tb, initial_state=ts, output_final_state=True, use_qk_l2norm_in_kernel=True)
        want_r, want_sr = modeling.torch_recurrent_gated_delta_rule(
            tq, tk, tv, g=tg, beta=tb, initial_state=ts, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = dr.l2_normalize(jnp.asarray(q)), dr.l2_normalize(jnp.asarray(k))
    got_c, got_sc = dr.delta_rule_chunked(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0))
    got_r, got_sr = dr.delta_rule_recurrent(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta),
                                             jnp.asarray(s0))
    for got, want in ((got_c, want_c), (got_r, want_r), (got_sc, want_sc), (got_sr, want_sr)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=1e-4)


def test_conv_matches_transformers(reference):
    torch, modeling = reference
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B, 13, 6)).astype(np.float32)
    w = rng.standard_normal((6, 1, 4)).astype(np.float32)  # HF conv1d.weight [C, 1, K]
    with torch.no_grad():
        want = modeling.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w).squeeze(1),
                                         None, activation="silu").transpose(1, 2).numpy()
    y, _ = short_conv.causal_conv(jnp.asarray(x), jnp.asarray(w[:, 0, :].T))
    np.testing.assert_allclose(np.asarray(jax.nn.silu(y)), want, atol=1e-5)


def test_mixer_carries_its_state_across_windows_and_skips_padding(monkeypatch):
    """A whole layer (projections, conv, delta rule, gated norm): prefix then rest equals the whole, the long
    window running the chunked form and the short ones the recurrent form; padding leaves the state alone."""
    from clover_jax.config import get_config
    from clover_jax.model import params

    cfg = get_config("test-qwen3-5-moe")
    layer = jax.tree.map(lambda a: a[0], params.init(cfg, jax.random.key(0)).linear_layers)
    monkeypatch.setattr(dr, "RECURRENT_MAX", 64)  # (read while tracing)
    x = jax.random.normal(jax.random.key(1), (B, 90, cfg.d_model), jnp.float32)
    whole, s_whole = gdn.mixer(x, layer.attn, cfg)  # 90 > RECURRENT_MAX: chunked
    first, s = gdn.mixer(x[:, :50], layer.attn, cfg)
    rest, s_end = gdn.mixer(x[:, 50:], layer.attn, cfg, state=s)  # 40 <= RECURRENT_MAX: recurrent
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), whole, atol=1e-5, rtol=1e-5)
    for a, b in zip(s_end, s_whole, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    padded = jnp.concatenate([x[:, :50], jnp.ones((B, 6, cfg.d_model))], axis=1)
    valid = jnp.arange(56)[None].repeat(B, 0) < 50
    y_pad, s_pad = gdn.mixer(padded, layer.attn, cfg, valid=valid)
    np.testing.assert_allclose(y_pad[:, :50], first, atol=1e-5, rtol=1e-5)
    for a, b in zip(s_pad, s, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_hybrid_forward_with_a_cache_runs_prefix_then_rest_as_the_whole():
    """Through the whole hybrid model: a prefix pass that fills the cache (K/V for the attention layer,
    recurrent state + conv tail for the Gated DeltaNet layers), then the rest against it, gives the logits
    of one pass over everything; the state in the cache is what a pass over the whole leaves."""
    from clover_jax.config import get_config
    from clover_jax.model import init_cache, masks, params, transformer

    cfg = get_config("test-qwen3-5-moe")
    weights = params.init(cfg, jax.random.key(0))
    t, cut = 40, 17
    tokens = jax.random.randint(jax.random.key(2), (B, t), 2, cfg.vocab_size)
    valid = jnp.ones((B, t), bool)
    pos = masks.positions(valid)
    whole = transformer.forward(weights, cfg, tokens, dispatch="dense")
    cache = init_cache(cfg, B, t)
    assert cache.linear.recurrent.shape == (3, B, 4, 16, 8) and cache.moe_k.shape == (1, B, t, 2, 16)
    full = masks.full_mask(cfg, valid)  # causal (blocks of one token)
    first = transformer.forward(weights, cfg, tokens[:, :cut], pos[:, :cut], full[:, :cut], cache, 0,
                                dispatch="dense")
    rest = transformer.forward(weights, cfg, tokens[:, cut:], pos[:, cut:], full[:, cut:], first.cache, cut,
                               dispatch="dense")
    got = jnp.concatenate([first.logits, rest.logits], axis=1)
    np.testing.assert_allclose(got, whole.logits, atol=1e-4, rtol=1e-4)
    again = transformer.forward(weights, cfg, tokens, pos, full, init_cache(cfg, B, t), 0,
                                dispatch="dense").cache
    for a, b in zip(rest.cache.linear, again.linear, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
