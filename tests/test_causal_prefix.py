"""Clover as its published ports run it (`bd_gdn="causal_prefix"`): clean text is the causal Qwen3.5 model, the
block being denoised is previewed over it.

- Clean text: logits equal transformers' own `Qwen3_5MoeForCausalLM` on the same weights (Clover's four
  block-diffusion tensors dropped, as llama.cpp and cortiq's commit path run it) within 1e-4, padded batch and
  the chunked delta rule included.
- The preview conv: equal to a float64 numpy transcription of cortiq-engine 0.8.45's `bdp_conv` kernel
  (`src/gpu_metal/clover_msl.metal`): out[t] = sum_j in[t+j] * taps[j] over in = [ring (kk-1 clean rows) | block]
  plus sum_{d=1..kk-1} block[t+d] * right[d-1], then SiLU.
- Generation: the prefix cache gives the cache-free pass's tokens and logits; a committed block leaves the cache
  the causal model leaves; the serving engine gives `generate`'s tokens.
- Training: a noisy block's two-stream logits equal the sampler's preview of it over the causal prefix; the
  clean half's next-token loss (`causal_coef`) is the causal model's and trains that path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.errors import ConfigError
from clover_jax.model import cache as kv_cache
from clover_jax.model import masks, params, transformer
from clover_jax.model.short_conv import causal_conv, right_conv
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.training import TokenStream, TrainConfig, losses, train
from tests.engine_requests import serve, tokens

CFG = get_config("test-clover-prefix", init_std=0.1)  # blocks of 8, 3 Gated DeltaNet + 1 attention layer


@pytest.fixture(scope="module")
def weights():
    return params.init(CFG, jax.random.key(0))


def test_right_conv_is_the_ports_bdp_conv():
    """The preview's conv (the causal conv over [ring | block] plus the right conv inside the block, SiLU) against
    a float64 numpy transcription of the port's kernel, for kk = 4 (3 right taps) and a block of 6."""
    rng = np.random.default_rng(0)
    kk, kb, c = 4, 6, 5
    taps, right = rng.standard_normal((c, kk)), rng.standard_normal((c, kk - 1))  # the kernel's [cdim][kk], [kk-1]
    ring, block = rng.standard_normal((kk - 1, c)), rng.standard_normal((kb, c))

    inp = np.concatenate([ring, block])  # in = [ring | block]
    want = np.zeros((kb, c))
    for t in range(kb):
        for ch in range(c):
            acc = sum(inp[t + j, ch] * taps[ch, j] for j in range(kk))
            acc += sum(block[t + d, ch] * right[ch, d - 1] for d in range(1, kk) if t + d < kb)
            want[t, ch] = acc / (1 + np.exp(-acc))  # SiLU

    x = jnp.asarray(block[None], jnp.float32)
    tail = jnp.asarray(ring[None], jnp.float32)
    ours, _ = causal_conv(x, jnp.asarray(taps.T, jnp.float32), tail)
    ids, ok = jnp.zeros((1, kb), jnp.int32), jnp.ones((1, kb), bool)
    ours = ours + right_conv(x, jnp.asarray(right.T, jnp.float32), ids, ok)  # first=1: x_t itself not a tap
    np.testing.assert_allclose(np.asarray(jax.nn.silu(ours))[0], want, atol=1e-5, rtol=1e-5)
    earlier = causal_conv(x, jnp.asarray(taps.T, jnp.float32), tail)[0] + right_conv(
        x, jnp.asarray(np.concatenate([np.zeros((1, c)), right.T]), jnp.float32), ids, ok, first=0)
    np.testing.assert_allclose(np.asarray(earlier), np.asarray(ours), atol=1e-6)  # same taps, one offset further


def test_clean_text_is_causal_and_ignores_the_block_diffusion_tensors(weights):
    """A clean sequence runs the causal model: a token's logits never depend on a later token, and Clover's four
    tensors change nothing (the comparison with transformers is in test_parity_qwen3_5.py)."""
    toks = jax.random.randint(jax.random.key(1), (2, 20), 5, 250)
    out = transformer.forward(weights, CFG, toks).logits
    later = transformer.forward(weights, CFG, toks.at[:, 12:].set(7)).logits
    np.testing.assert_array_equal(np.asarray(out[:, :12]), np.asarray(later[:, :12]))
    attn = weights.linear_layers.attn
    other = weights.replace(linear_layers=weights.linear_layers.replace(attn=attn.replace(
        conv_right=attn.conv_right + 1.0, bd_logit_scale=attn.bd_logit_scale * 3, bd_history_c=attn.bd_history_c + 1)))
    np.testing.assert_allclose(np.asarray(transformer.forward(other, CFG, toks).logits), np.asarray(out), atol=1e-6)


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_generation_is_exact_with_the_cache(weights, cache):
    prompts = [[5, 9, 17, 33, 40], [7, 8, 9]]
    sc = SamplerConfig(gen_length=24, block_length=8, cache=cache, eos_stop=False, threshold=0.3)
    got = generate(weights, CFG, prompts, sc, record_logits=True, dispatch="dense")
    ref = generate(weights, CFG, prompts, sc.replace(cache="none"), record_logits=True, dispatch="dense")
    np.testing.assert_array_equal(got.raw, ref.raw)
    np.testing.assert_allclose(got.logits, ref.logits, atol=2e-5)


def test_a_committed_block_leaves_the_causal_models_cache(weights):
    """After the prompt and one committed block, the cache (attention K/V and Gated DeltaNet states) is what the
    causal model leaves over the same tokens in one clean pass: the commit is Qwen3.5's causal path."""
    toks = jax.random.randint(jax.random.key(2), (1, 16), 5, 250)
    valid = jnp.ones(toks.shape, bool)
    pos = masks.positions(valid)
    full = transformer.forward(weights, CFG, toks, pos, masks.full_mask(CFG, valid), kv_cache.init_cache(CFG, 1, 16),
                               0, valid=valid).cache
    # the sampler's way: the prompt (8) prefilled, then a pass over [block 1 | masked block 2] committing block 1
    v24 = jnp.ones((1, 24), bool)
    written = jnp.arange(24)[None] < 8
    ids = masks.prefix_canvas_ids(masks.positions(v24), 8, 8, 8)
    c = transformer.forward(weights, CFG, toks[:, :8], pos[:, :8], masks.attention_mask(
        v24[:, :8], ids[:, :8], written, ids, True), kv_cache.init_cache(CFG, 1, 24), 0, valid=valid[:, :8]).cache
    window = jnp.concatenate([toks[:, 8:], jnp.full((1, 8), CFG.mask_token_id)], axis=1)
    ids = masks.prefix_canvas_ids(masks.positions(v24), 16, 8, 8)
    mask = masks.attention_mask(v24[:, 8:], ids[:, 8:], v24, ids, True)
    c = transformer.forward(weights, CFG, window, masks.positions(v24)[:, 8:], mask, c, 8, valid=v24[:, 8:],
                            blocks=ids[:, 8:], commit=8).cache
    for a, b in zip(jax.tree.leaves(full.linear), jax.tree.leaves(c.linear), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    np.testing.assert_allclose(np.asarray(c.moe_k[:, :, :16]), np.asarray(full.moe_k), atol=1e-5)


def test_two_stream_training_sees_what_the_sampler_sees(weights):
    """Noisy block i's logits in block-diffusion training ([noisy | clean], the clean half causal) equal the
    sampler's whole-canvas pass over [clean prefix | noisy block i] on the same tokens."""
    bs, p, nb = CFG.block_size, 5, 2
    clean = jax.random.randint(jax.random.key(3), (2, p + nb * bs), 5, 250)
    scored = jnp.broadcast_to(jnp.arange(p + nb * bs) >= p, clean.shape)
    noisy = jnp.where(scored & (jax.random.uniform(jax.random.key(4), clean.shape) < 0.6), CFG.mask_token_id, clean)
    valid = jnp.ones(clean.shape, bool)
    blk = masks.training_block_ids(CFG, valid, scored, "prompt")
    got = losses.denoising_forward(weights, CFG, noisy, clean, valid, dispatch="dense", blocks=blk).logits
    for i in range(nb):
        lo, hi = p + i * bs, p + (i + 1) * bs
        ctx = jnp.concatenate([clean[:, :lo], noisy[:, lo:hi]], axis=1)
        v = jnp.ones(ctx.shape, bool)
        ids = masks.prefix_canvas_ids(masks.positions(v), lo, p, bs)
        ref = transformer.forward(weights, CFG, ctx, masks.positions(v), masks.attention_mask(v, ids, v, ids, True),
                                  dispatch="dense", valid=v, blocks=ids, commit=lo).logits[:, lo:]
        np.testing.assert_allclose(np.asarray(got[:, lo:hi]), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_the_server_gives_generates_tokens(weights, cache):
    """Serving rows (prompt ids causal at admission, a block's ids causal once committed) give `generate`'s
    tokens, a request that joins while another runs included."""
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request

    eng = Engine(weights, CFG, block_length=8, max_prompt=8, max_tokens=24, batch_sizes=(2,), cache=cache,
                 dispatch="dense")
    reqs = [Request((5, 9, 17, 33, 40), 24, SamplerConfig(eos_stop=False)),
            Request((7, 8, 9), 16, SamplerConfig(eos_stop=False, threshold=0.3)),
            Request((11, 12), 8, SamplerConfig(eos_stop=False, remasking="margin"))]
    events = serve(eng, reqs, drain=True)
    for i, r in enumerate(reqs):
        got = tokens(events[i])
        ref = generate(weights, CFG, [list(r.prompt)], r.row_settings(8).replace(cache="prefix"), dispatch="dense")
        assert got == ref.raw[0].tolist()[:r.max_tokens], i


def test_self_speculative_refuses_what_it_cannot_do(weights):
    from clover_jax.errors import SamplerError

    sc = SamplerConfig(gen_length=16, block_length=8, self_speculative=True)
    with pytest.raises(SamplerError, match="self_speculative decodes greedily"):
        generate(weights, CFG, [[5, 6]], sc.replace(temperature=0.5))
    with pytest.raises(SamplerError, match="no causal model to check the drafts"):
        generate(None, get_config("test-clover-hybrid"), [[5, 6]], sc)
    with pytest.raises(SamplerError, match="needs the prefix cache"):
        generate(weights, CFG, [[5, 6]], sc.replace(cache="none"))
    two = generate(weights, CFG, [[5, 9, 17], [7, 8]], sc.replace(eos_stop=False), dispatch="dense")
    one = generate(weights, CFG, [[7, 8]], sc.replace(eos_stop=False), dispatch="dense")
    assert two.raw[1].tolist() == one.raw[0].tolist() and two.stats.rows == 2  # prompts one after another
    causal = sc.replace(self_speculative=False, causal=True, eos_stop=False)
    with pytest.raises(SamplerError, match=r"causal: the model is not run with a causal prefix.*no causal model to "
                                           r"decode with"):
        generate(None, get_config("test-clover-hybrid"), [[5, 6]], causal)
    with pytest.raises(SamplerError, match="causal: it needs the prefix cache"):
        generate(weights, CFG, [[5, 6]], causal.replace(cache="none"))
    with pytest.raises(SamplerError, match="give self_speculative or causal, not both"):
        generate(weights, CFG, [[5, 6]], causal.replace(self_speculative=True))
    assert generate(weights, CFG, [[7, 8]], causal, dispatch="dense").raw[0].tolist() == one.raw[0].tolist()


def test_the_server_serves_self_speculative_requests_beside_the_rows(weights):
    """A request with `self_speculative` (on an engine started with it) gets exactly `generate`'s self-speculative
    tokens, cut at its max_tokens, while ordinary rows run beside it; a `causal` request the same text one pass a
    token; a server without the lane, or a model without a causal prefix, refuses by name. The lane's programs
    compile on their first request, once each."""
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import BadRequest, Request, ServingError

    eng = Engine(weights, CFG, block_length=8, max_prompt=8, max_tokens=24, batch_sizes=(2,), dispatch="dense",
                 self_speculative=True)
    spec = SamplerConfig(self_speculative=True, threshold=0.5)
    reqs = [Request((5, 9, 17, 33, 40), 24, spec), Request((7, 8, 9), 13, spec),
            Request((11, 12), 16, SamplerConfig(eos_stop=False)), Request((5, 9, 17, 33, 40), 24,
                                                                          SamplerConfig(causal=True))]
    lines: list[str] = []
    eng.warm_up(lines.append)
    assert lines and not [x for x in lines if "first use" in x or "causal" in x]  # the lane's: on first use
    events = serve(eng, reqs, drain=True)
    lane = [x for x in lines if x.endswith("(first use)")]  # one a kind: the second self-speculative one reuses it
    assert len(lane) == 2 and lane[0].startswith("self-speculative program for prompts up to 8 tokens: "), lane
    assert lane[1].startswith("causal (one token a pass) program for prompts up to 8 tokens: "), lane
    for i, r in enumerate(reqs[:2]):
        (ev,) = events[i]  # one piece
        ref = generate(weights, CFG, [list(r.prompt)], SamplerConfig(gen_length=24, block_length=8,
                                                                     self_speculative=True, threshold=0.5),
                       dispatch="dense")
        want = ref.tokens[0][:r.max_tokens]
        assert list(ev.tokens) == want, i
        assert ev.finish_reason == ("stop" if len(ref.tokens[0]) < r.max_tokens else "length")
        assert ev.passes > 0
    (ev,) = events[3]  # causal: the self-speculative text, one pass a token after one over the prompt
    assert list(ev.tokens) == list(events[0][0].tokens)
    assert ev.passes == len(ev.tokens) + 1 + (ev.finish_reason == "stop")  # a pass for the prompt and the end token
    plain = tokens(events[2])
    assert plain == generate(weights, CFG, [[11, 12]], reqs[2].row_settings(8).replace(cache="prefix"),
                             dispatch="dense").raw[0].tolist()[:16]
    stats = eng.stats()
    assert stats.requests_finished == 4 and stats.active_rows == 0
    plain_engine = Engine(weights, CFG, block_length=8, max_prompt=8, max_tokens=24, batch_sizes=(1,),
                          dispatch="dense")
    for r in (reqs[0], reqs[3]):
        with pytest.raises(BadRequest, match="needs a server started with --self-speculative"):
            plain_engine.submit(r, lambda ev: None)
    with pytest.raises(ServingError, match="not run with a causal prefix"):
        Engine(None, get_config("test-clover-hybrid"), block_length=8, self_speculative=True)


def test_the_lane_shares_the_prefix_cache_with_the_rows(weights):
    """With the prefix cache on, a causal or self-speculative request takes the longest saved prompt its prompt
    begins with (saved by the lane or by a row) and saves its own stem (its `keep`, else its prompt but the last
    token); a row takes what the lane saved. Every response is the one a full prefill gives (`generate`)."""
    import dataclasses

    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request

    # prompts prefilled 8 tokens a window (several windows a prompt), the lane's programs narrower than a row
    eng = Engine(weights, CFG.replace(prefill_chunk=8), block_length=8, max_prompt=100, max_tokens=16,
                 batch_sizes=(1,), dispatch="dense", self_speculative=True, prefix_cache_gb=1.0, prefill_rows=1)
    eng.start()

    def ask(prompt, sc, keep=0):
        req = dataclasses.replace(Request(tuple(prompt), 16, sc), keep=keep)
        (events,) = serve(eng, [req])
        return req, tokens(events), events[-1].cached_tokens

    base = [int(x) for x in np.random.default_rng(0).integers(5, 200, 21)]
    causal, spec = SamplerConfig(causal=True), SamplerConfig(self_speculative=True, threshold=0.5)
    greedy = generate(weights, CFG, [base], SamplerConfig(gen_length=16, block_length=8, causal=True),
                      dispatch="dense").tokens[0]
    longer = [*base[:17], 9, 8, 7, 6, 5, 4, 33]
    steps = [(base, causal, 17, 0), (longer, causal, 0, 17), ([*longer, 12, 13], spec, 0, 23),
             ([*longer[:-1], 40, 41, 42], SamplerConfig(eos_stop=False), 0, 23),  # a row, from the lane's save
             ([*longer[:-1], 40, 41, 42], causal, 0, 23),  # saved whole by the row: not taken whole (its last token)
             ([*longer[:-1], 40, 41, 42, 43, 44], causal, 0, 26),  # the lane, from the row's save
             (base, spec, 0, 17)]
    for prompt, sc, keep, cached in steps:
        req, got, hit = ask(prompt, sc, keep)
        assert hit == cached, (prompt, hit)
        if sc.causal or sc.self_speculative:
            want = generate(weights, CFG, [prompt], SamplerConfig(gen_length=16, block_length=8, causal=True),
                            dispatch="dense").tokens[0][:16]
        else:
            want = generate(weights, CFG, [prompt], req.row_settings(8).replace(cache="prefix"),
                            dispatch="dense").raw[0].tolist()[:16]
        assert got == want, prompt
    assert ask(base, causal)[1] == greedy[:16]
    stats = eng.stats()
    eng.drain()
    assert (stats.prefix_lookups, stats.prefix_hits) == (len(steps) + 1, len(steps))
    assert stats.prefix_tokens_reused == sum(c for *_, c in steps) + 20  # the last: base but its last token


def test_the_causal_loss_is_the_causal_models_next_token_ce(weights):
    """`diffusion_terms(causal=True)`: the clean half's next-token CE is the causal model's (whose logits equal
    transformers' Qwen3.5), over the scored tokens after the first; the diffusion terms are the same either way."""
    p, n = 5, 2 * CFG.block_size
    toks = jax.random.randint(jax.random.key(5), (2, p + n), 5, 250)
    valid = jnp.ones(toks.shape, bool)
    scored = jnp.broadcast_to(jnp.arange(p + n) >= p, toks.shape)
    t = jnp.full((2, losses.n_blocks(CFG, p + n, "prompt")), 0.5)
    args = (weights, CFG, toks, valid, scored, t, jax.random.key(6), "dense")
    on = losses.diffusion_terms(*args, grid="prompt", causal=True)
    off = losses.diffusion_terms(*args, grid="prompt")
    logp = jax.nn.log_softmax(transformer.forward(weights, CFG, toks).logits[:, :-1], axis=-1)
    # every scored token after the first column is predicted, the first response token from the prompt's last
    want = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)[..., 0][:, p - 1:]
    assert int(on.n_causal) == want.size == 2 * n
    np.testing.assert_allclose(float(on.causal_ce), float(jnp.sum(want)), rtol=1e-5)
    assert float(off.causal_ce) == 0.0 and float(off.n_causal) == 0.0
    np.testing.assert_allclose(float(on.weighted_ce), float(off.weighted_ce), rtol=1e-6)
    with pytest.raises(ValueError, match="causal-prefix"):
        losses.diffusion_terms(weights, CFG.replace(bd_gdn="reconstructed"), toks, valid, scored, t,
                               jax.random.key(6), "dense", grid="prompt", causal=True)


def test_the_causal_coef_trains_the_causal_path():
    """Training with causal_coef > 0 teaches the causal path (eval_causal_ce, the held-out next-token CE, falls far
    below a run without it, which leaves that path untrained); a model with no causal path refuses the setting."""
    ids = (5 + np.arange(6000) % 12).astype(np.int32)
    data, held = TokenStream(ids[:5000], 16, 0), TokenStream(ids[5000:], 16, 0)
    figures = {}
    for coef in (0.0, 1.0):
        tc = TrainConfig(steps=24, batch_size=8, seq_len=16, lr=1e-2, warmup_steps=3, eval_every=24, eval_seqs=8,
                         causal_coef=coef)
        res = train(CFG, tc, data, held, progress=False)
        figures[coef] = res.evals[-1]["eval_causal_ce"]
    assert figures[1.0] < 0.25 * np.log(CFG.vocab_size) and figures[1.0] < 0.5 * figures[0.0], figures
    with pytest.raises(ConfigError, match="causal-prefix"):
        train(CFG.replace(bd_gdn="reconstructed"), TrainConfig(steps=2, batch_size=2, seq_len=16, causal_coef=1.0),
              data, progress=False)
