"""Clover's block-diffusion Gated DeltaNet (this project's reconstruction, `bd_gdn="reconstructed"`):
the mixer against a direct, position-by-position computation written from the definition (values and
gradients), the tiled in-block softmax across many tiles, block causality and in-block bidirectionality
through the whole model, the commit contract of the cache, and block-diffusion training's two streams
against running each block behind its clean prefix."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.errors import ConfigError
from clover_jax.model import delta_rule as dr
from clover_jax.model import gated_deltanet as gdn
from clover_jax.model import masks, params, transformer
from clover_jax.training import losses

CFG = get_config("test-clover-hybrid")  # blocks of 8, 2 key / 4 value heads, right conv of 3 taps
mixer = jax.jit(gdn.mixer, static_argnums=2, static_argnames=("two_stream",))
apply = jax.jit(transformer.apply, static_argnums=1)


def _noisy(tree, seed, scale):
    """tree + scale * N(0, 1) noise, drawn with numpy (no XLA compile per leaf shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: a + jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype), tree)


def _mixer_weights(seed: int = 0) -> gdn.GatedDeltaNetWeights:
    """One Gated DeltaNet layer's weights with every block-diffusion tensor far from its initial value."""
    w = jax.tree.map(lambda a: a[0], params.init(CFG, jax.random.key(seed)).linear_layers.attn)
    w = _noisy(w, seed + 1, 0.3)
    return w.replace(bd_logit_scale=jnp.abs(w.bd_logit_scale) * 4 + 1, a_log=w.a_log - 1.0)


def _silu(a):
    return a / (1 + np.exp(-a))


def _direct(x, w, blocks):
    """The definition, one position at a time, in float64 numpy (x [T, D]; w a dict of numpy arrays): causal
    conv + in-block right conv, SiLU, heads; the delta rule's state before each position; per position the
    history read-out of the state at its block's start, mixed into a softmax over its block's positions and
    one history slot; then the gated RMSNorm and the output projection."""
    c = CFG
    hk, dk, hv, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim
    t_len = x.shape[0]
    # The conv channels in the fused [q | k | v] order (natively they are grouped by key head).
    w = {**w, **{n: params.ungroup_channels(w[n].reshape(w[n].shape[0], hk, -1), c)
                 for n in ("qkv", "conv", "conv_right")}}
    proj = x @ w["qkv"]  # [T, C]
    blocks = [int(b) for b in blocks]
    k_left, k_right = w["conv"].shape[0], w["conv_right"].shape[0]
    rows = []
    for t in range(t_len):
        y = sum(w["conv"][j] * proj[t - (k_left - 1) + j] for j in range(k_left) if t - (k_left - 1) + j >= 0)
        y = y + sum(w["conv_right"][j] * proj[t + j] for j in range(k_right)
                    if t + j < t_len and blocks[t + j] == blocks[t])
        rows.append(_silu(y))
    mixed = np.stack(rows)
    rep = hv // hk

    def unit(a):
        return a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)

    q = np.repeat(unit(mixed[:, :hk * dk].reshape(t_len, hk, dk)), rep, axis=1)
    k = np.repeat(unit(mixed[:, hk * dk:2 * hk * dk].reshape(t_len, hk, dk)), rep, axis=1)
    v = mixed[:, 2 * hk * dk:].reshape(t_len, hv, dv)
    beta = 1 / (1 + np.exp(-(x @ w["b"])))
    g = -np.exp(w["a_log"]) * np.log1p(np.exp(x @ w["a"] + w["dt_bias"]))
    s = np.zeros((hv, dk, dv))
    before = []
    for t in range(t_len):
        before.append(s)
        s = np.exp(g[t])[:, None, None] * s
        s = s + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t]))[:, None, :]
    outs = []
    for t in range(t_len):
        start = blocks.index(blocks[t])
        hist = np.einsum("hkv,hk->hv", before[start], q[t] / np.sqrt(dk))
        members = [j for j in range(t_len) if blocks[j] == blocks[t]]
        logits = np.concatenate([w["bd_history_bias"][:, None],
                                 w["bd_logit_scale"][:, None] * np.einsum("hk,nhk->hn", q[t], k[members])], -1)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        outs.append(p[:, :1] * w["bd_history_c"][:, None] * hist + np.einsum("hn,nhd->hd", p[:, 1:], v[members]))
    o = np.stack(outs)  # [T, Hv, dv]
    z = np.einsum("td,dhk->thk", x, w["z"])
    normed = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + c.norm_eps) * w["norm"] * _silu(z)
    return np.einsum("thk,hkd->td", normed, w["out"])


# Blocks of uneven length (a prompt's partial block, then generated blocks), spanning several tiles.
BLOCKS = np.array([0] * 5 + [1] * 8 + [2] * 8 + [9] * 3)


@pytest.mark.parametrize("rule", ["scan", "chunked"])
def test_mixer_matches_the_direct_computation_and_its_gradients(rule, monkeypatch):
    """Values against the float64 definition; gradients against its central differences along random
    directions (two per tensor), for every tensor the block-diffusion reading adds and the ones it reads. Both
    delta rules: the position scan, and the chunked form in chunks of 8 (blocks of 5, 8, 8, 3 straddle them)."""
    traced = []
    if rule == "chunked":  # read while tracing
        chunked = dr.delta_rule_blocks_chunked
        monkeypatch.setattr(dr, "delta_rule_blocks_chunked", lambda *a, **k: traced.append(1) or chunked(*a, **k))
        monkeypatch.setattr(dr, "BLOCKS_SCAN_MAX", 0)
        monkeypatch.setattr(dr, "CHUNK", 8)
        monkeypatch.setattr(dr, "CPU_SCAN", False)
    # a new function (jit reuses a trace of the same function): the constants are read while it is traced
    mixer = jax.jit(lambda *a, **k: gdn.mixer(*a, **k), static_argnums=2)
    w = _mixer_weights()
    x = jax.random.normal(jax.random.key(5), (1, len(BLOCKS), CFG.d_model))
    blocks = jnp.asarray(BLOCKS)[None]
    y, _ = mixer(x, w, CFG, blocks=blocks)
    assert bool(traced) == (rule == "chunked")
    x64 = np.asarray(x[0], np.float64)
    w64 = {f.name: np.asarray(getattr(w, f.name), np.float64) for f in dataclasses.fields(w)}
    ref = _direct(x64, w64, BLOCKS)
    assert float(np.abs(ref).max()) > 0.1
    np.testing.assert_allclose(np.asarray(y[0]), ref, atol=2e-5, rtol=2e-5)

    rng = np.random.default_rng(6)
    r = rng.standard_normal(ref.shape)
    grads = jax.jit(jax.grad(lambda w_: jnp.sum(mixer(x, w_, CFG, blocks=blocks)[0][0] * r)))(w)
    eps = 1e-5
    for name in ("conv_right", "bd_logit_scale", "bd_history_bias", "bd_history_c", "qkv", "conv", "a_log", "b"):
        for _ in range(2):
            d = rng.standard_normal(w64[name].shape)
            plus, minus = dict(w64), dict(w64)
            plus[name], minus[name] = w64[name] + eps * d, w64[name] - eps * d
            numeric = float(np.sum((_direct(x64, plus, BLOCKS) - _direct(x64, minus, BLOCKS)) * r)) / (2 * eps)
            ours = float(np.sum(np.asarray(getattr(grads, name), np.float64) * d))
            assert abs(numeric) > 1e-4, name  # the tensor really shapes the output
            assert ours == pytest.approx(numeric, rel=2e-3, abs=1e-6), name


def test_inblock_attention_tiles_equal_one_dense_softmax():
    """Many tiles (T = 70 over span 8) against the whole-window softmax with a same-block mask."""
    rng = np.random.default_rng(0)
    t = 70
    blocks = jnp.asarray(np.repeat(np.arange(24), rng.integers(3, 9, 24))[:t])[None]
    valid = jnp.asarray(rng.random((1, t)) > 0.1)
    q = dr.l2_normalize(jnp.asarray(rng.standard_normal((1, t, 2, 16))))
    k = dr.l2_normalize(jnp.asarray(rng.standard_normal((1, t, 2, 16))))
    v = jnp.asarray(rng.standard_normal((1, t, 4, 8)), jnp.float32)
    hist = jnp.asarray(rng.standard_normal((1, t, 4, 8)), jnp.float32)
    w = _mixer_weights()
    got = gdn.inblock_attention(q, k, v, hist, blocks, valid, w, span=8)
    qr, kr = jnp.repeat(q, 2, axis=2), jnp.repeat(k, 2, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", qr, kr) * w.bd_logit_scale[:, None, None]
    see = (blocks[:, :, None] == blocks[:, None, :]) & valid[:, None, :]
    logits = jnp.where(see[:, None], logits, -jnp.inf)
    hl = jnp.broadcast_to(w.bd_history_bias[None, :, None, None], (1, 4, t, 1))
    p = jax.nn.softmax(jnp.concatenate([hl, logits], -1), -1)
    want = jnp.einsum("bhqk,bkhd->bqhd", p[..., 1:], v) + jnp.moveaxis(p[..., 0], 1, 2)[..., None] * (
        w.bd_history_c[:, None] * hist)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("offset", [0, 13])
def test_inblock_attention_on_aligned_tiles_equals_the_three_tile_form(offset):
    """Rows on a block grid, each with its own left padding, in a window that starts `offset` positions into a
    block (a prefill window after a cache): `tile_shift` finds shifts that put every block in one tile, and the
    softmax over each tile alone equals the three-tile form at every valid column. A block of uneven length
    between others does not fit (the three-tile form runs)."""
    rng = np.random.default_rng(1)
    t, span = 70, 8
    pads = (0, 3, 8, 29)
    valid = jnp.arange(t)[None] >= jnp.asarray(pads)[:, None]
    blocks = (masks.positions(valid) + offset) // span  # blocks start at columns pad - offset (mod span)
    shift, fits = gdn.tile_shift(blocks, valid, span)
    assert bool(fits) and [int(s) for s in shift] == [(offset - p) % span for p in pads]
    q = dr.l2_normalize(jnp.asarray(rng.standard_normal((4, t, 2, 16))))
    k = dr.l2_normalize(jnp.asarray(rng.standard_normal((4, t, 2, 16))))
    v = jnp.asarray(rng.standard_normal((4, t, 4, 8)), jnp.float32)
    hist = jnp.asarray(rng.standard_normal((4, t, 4, 8)), jnp.float32)
    w = _mixer_weights()
    got = gdn.inblock_attention(q, k, v, hist, blocks, valid, w, span=span, inference=True)
    o, weight = gdn._inblock_tiles(q, k, v, blocks, valid, w, span, neighbours=True)
    want = o + weight[..., None] * hist
    keep = valid[:, :, None, None]
    assert float(jnp.abs(jnp.where(keep, want, 0)).max()) > 0.1
    np.testing.assert_allclose(jnp.where(keep, got, 0), jnp.where(keep, want, 0), atol=1e-5, rtol=1e-5)
    r = jnp.where(keep, jnp.asarray(rng.standard_normal(want.shape), jnp.float32), 0)  # gradients too

    def loss(form, *qkvh):
        return jnp.sum(form(*qkvh) * r)

    def three_tiles(q, k, v, hist):
        o, weight = gdn._inblock_tiles(q, k, v, blocks, valid, w, span, neighbours=True)
        return o + weight[..., None] * hist

    grads = [jax.grad(lambda *a, f=f: loss(f, *a), argnums=(0, 1, 2, 3))(q, k, v, hist) for f in (
        lambda *a: gdn.inblock_attention(*a, blocks, valid, w, span=span, inference=True), three_tiles)]
    for a, b in zip(*grads, strict=True):
        assert float(jnp.abs(b).max()) > 1e-3
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    # the one-tile form is tried in forward passes only (a cond, which under gradients keeps both forms' values)
    conds = [str(jax.make_jaxpr(lambda *a, i=i: gdn.inblock_attention(*a, blocks, valid, w, span, inference=i))(
        q, k, v, hist)).count("cond[") for i in (True, False)]
    assert conds == [1, 0]
    x = jnp.zeros((4, t, CFG.d_model))  # the mixer's forward tries it, block-diffusion training's two streams do not
    assert "cond[" in str(jax.make_jaxpr(lambda x: gdn.mixer(x, w, CFG, valid, None, blocks))(x))
    two = jax.make_jaxpr(lambda x: gdn.mixer(x, w, CFG, jnp.tile(valid, 2), blocks=jnp.tile(blocks, 2),
                                             two_stream=True))(jnp.tile(x, (1, 2, 1)))
    assert "cond[" not in str(two)
    # a prompt of 13 columns in blocks of 8 and 5, then generated blocks of 8: no shift fits every block of the row
    uneven = jnp.asarray(np.concatenate([[0] * 8, [1] * 5, 2 + np.arange(t - 13) // span]))[None]
    assert not bool(gdn.tile_shift(uneven, jnp.ones((1, t), bool), span)[1])


def _model(bd: str = "reconstructed", seed: int = 0):
    cfg = CFG.replace(bd_gdn=bd)
    w = params.init(cfg, jax.random.key(seed))
    return cfg, _noisy(w, seed + 1, 0.1)


def test_block_causal_across_blocks_bidirectional_inside():
    cfg, w = _model()
    toks = jax.random.randint(jax.random.key(2), (2, 40), 4, 250)
    base = apply(w, cfg, toks)
    changed = apply(w, cfg, toks.at[:, 20].set(7))  # position 20 is in block 2 (16..23)
    assert float(jnp.abs(changed[:, :16] - base[:, :16]).max()) == 0.0  # earlier blocks never see it
    assert float(jnp.abs(changed[:, 17] - base[:, 17]).max()) > 1e-3
    assert float(jnp.abs(changed[:, 24:] - base[:, 24:]).max()) > 1e-3  # later blocks see it (the state)
    # bd_gdn="none" is the plain causal Gated DeltaNet: position 17 no longer sees 20 through those layers,
    # but the attention layer is still bidirectional inside the block, so only a plain run proves it.
    cfg0 = cfg.replace(bd_gdn="none")
    x = jax.random.normal(jax.random.key(3), (1, 24, cfg.d_model))
    wl = jax.tree.map(lambda a: a[0], w.linear_layers.attn)
    y, _ = mixer(x, wl, cfg0, blocks=jnp.zeros((1, 24), jnp.int32))
    y2, _ = mixer(x.at[:, 20].set(0.0), wl, cfg0, blocks=jnp.zeros((1, 24), jnp.int32))
    assert float(jnp.abs(y2[:, :20] - y[:, :20]).max()) == 0.0


def test_commit_keeps_the_state_after_the_committed_columns():
    w = _mixer_weights()
    x = jax.random.normal(jax.random.key(7), (1, 16, CFG.d_model))
    blocks = jnp.asarray([[0] * 8 + [1] * 8])
    _, after_first = mixer(x[:, :8], w, CFG, blocks=blocks[:, :8])
    y_all, kept = mixer(x, w, CFG, blocks=blocks, commit=8)
    np.testing.assert_allclose(kept.recurrent, after_first.recurrent, atol=1e-6)
    np.testing.assert_allclose(kept.conv_tail, after_first.conv_tail, atol=1e-6)
    # refining block 1 from the committed state: same outputs as the whole window, state left alone
    y1, untouched = mixer(x[:, 8:], w, CFG, state=after_first, blocks=blocks[:, 8:], commit=0)
    np.testing.assert_allclose(y1, y_all[:, 8:], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(untouched.recurrent, after_first.recurrent)
    np.testing.assert_array_equal(untouched.conv_tail, after_first.conv_tail)
    # commit=0 as a Python int (the sampler's refinement passes) reads the state without a scan: same result
    y1_fast, kept_fast = gdn.mixer(x[:, 8:], w, CFG, state=after_first, blocks=blocks[:, 8:], commit=0)
    np.testing.assert_allclose(y1_fast, y1, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(kept_fast.recurrent, after_first.recurrent)


@pytest.mark.parametrize("bd", ["reconstructed", "none"])
def test_two_stream_training_equals_each_block_behind_its_clean_prefix(bd):
    cfg, w = _model(bd)
    n = 24
    clean = jax.random.randint(jax.random.key(2), (2, n), 4, 250)
    noisy = jnp.where(jax.random.uniform(jax.random.key(3), (2, n)) < 0.5, cfg.mask_token_id, clean)
    out = jax.jit(losses.denoising_forward, static_argnums=1)(w, cfg, noisy, clean, jnp.ones((2, n), bool))
    for b in range(n // 8):
        # block b behind its clean prefix, right-padded to one shape (one compile): padding is invisible
        seq = jnp.concatenate([clean[:, :b * 8], noisy[:, b * 8:(b + 1) * 8], clean[:, (b + 1) * 8:]], axis=1)
        valid = jnp.broadcast_to(jnp.arange(n) < (b + 1) * 8, (2, n))
        want = apply(w, cfg, seq, valid)[:, b * 8:(b + 1) * 8]
        np.testing.assert_allclose(out.logits[:, b * 8:(b + 1) * 8], want, atol=1e-4, rtol=1e-5)


def test_reconstruction_needs_its_tensors_and_blocks():
    with pytest.raises(ConfigError, match="bd_conv_right_kernel"):
        CFG.replace(bd_conv_right_kernel=0)
    with pytest.raises(ConfigError, match="block_causal"):
        CFG.replace(attention="bidirectional")
    with pytest.raises(ConfigError, match="bd_gdn must be one of"):
        CFG.replace(bd_gdn="softmax")
    assert params.abstract(CFG.replace(bd_gdn="none")).linear_layers.attn.conv_right.shape == (3, 3, 2, 2 * 16 + 2 * 8)


def _updates_of(jaxpr, shapes: set) -> int:
    """Scatters and dynamic-update-slices in `jaxpr` (its sub-jaxprs included) whose operand has one of `shapes`."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scatter", "dynamic_update_slice") and tuple(eqn.invars[0].aval.shape) in shapes:
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _updates_of(sub, shapes)
    return n


@pytest.mark.parametrize("reading", ["causal_prefix", "reconstructed", "none"])
def test_a_refinement_pass_leaves_the_state_and_does_not_write_it_back(reading):
    """A refinement pass (commit=0, the sampler's passes after a block's first) returns every Gated DeltaNet state
    and conv tail exactly as it found them, and its program does not write them into the cache: a write of the same
    values would still make the TPU compiler copy the whole stack of states where the pass is a branch of the
    sampler's cond (2 GB a chip for 32 rows of Clover-35B: `clover plan` of 4K x 32 rows on a v5p-8 placed 35.1 GB
    with the write, 31.2 GB without). The commit pass writes each state leaf (in the layers' scan)."""
    from clover_jax.model import ModelForward
    from clover_jax.sampler import step as denoise

    cfg = get_config("test-clover-prefix").replace(bd_gdn=reading)
    w = params.init(cfg, jax.random.key(0))
    fwd = ModelForward(cfg, "dense")
    b, s, bl = 2, 32, 8
    tokens = jax.random.randint(jax.random.key(1), (b, s), 5, 200)
    valid = jnp.ones((b, s), bool)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    blocks = pos if cfg.causal_prefix else pos // bl

    def run(c, lo, width, commit):
        return denoise.window_pass(fwd, w, cfg, tokens, valid, blocks, pos, c, lo, width, 0, bl, commit)[1]

    cache = run(fwd.init_cache(b, s), 0, 2 * bl, 2 * bl)  # two blocks committed
    after = run(cache, 2 * bl, bl, 0)
    for was, now in zip(jax.tree.leaves(cache.linear), jax.tree.leaves(after.linear), strict=True):
        np.testing.assert_array_equal(now, was)
    shapes = {tuple(x.shape) for x in jax.tree.leaves(cache.linear)}
    count = lambda commit: _updates_of(jax.make_jaxpr(lambda c: run(c, 2 * bl, bl, commit))(cache).jaxpr, shapes)
    assert count(0) == 0
    assert count(bl) == len(shapes)  # each leaf once, in the scan over the group's Gated DeltaNet layers


@pytest.mark.parametrize("attention", ["dense", "chunked"])
def test_a_refinement_pass_attends_to_its_block_without_writing_its_kv(attention):
    """A refinement pass does not write its block's K/V into the cache (the same TPU copy as above, of the K/V stack:
    2 x 1.4 GB a chip for 32 rows of Clover-35B at 4K): it attends to the cache without the block's columns and to
    the block's own K/V as one softmax, which gives the logits of writing them and attending to the cache (a
    traced commit of 0: the same pass, through the write)."""
    from clover_jax.model import ModelForward
    from clover_jax.sampler import step as denoise

    cfg = get_config("test-clover-prefix").replace(attention_impl=attention, attention_chunk=8)
    w = params.init(cfg, jax.random.key(0))
    fwd = ModelForward(cfg, "dense")
    b, s, bl = 2, 40, 8
    tokens = jax.random.randint(jax.random.key(1), (b, s), 5, 200)
    valid = jnp.asarray(np.arange(s)[None] >= np.array([[0], [5]]))  # the second row left-padded
    pos = masks.positions(valid)
    blocks = masks.prefix_canvas_ids(pos, 3 * bl, 0, bl)  # columns before 24 clean, then blocks of 8

    def run(c, lo, width, commit):
        return denoise.window_pass(fwd, w, cfg, tokens, valid, blocks, pos, c, lo, width, 0, bl, commit)

    _, cache = run(fwd.init_cache(b, s), 0, 3 * bl, 3 * bl)  # three blocks committed
    _, cache = run(cache, 3 * bl, bl, jnp.int32(0))  # the block's first pass wrote its K/V (stale now)
    tokens = tokens.at[:, 3 * bl:4 * bl].set(jax.random.randint(jax.random.key(2), (b, bl), 5, 200))
    logits, after = run(cache, 3 * bl, bl, 0)
    written, _ = run(cache, 3 * bl, bl, jnp.int32(0))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(written), atol=2e-5, rtol=1e-5)
    for was, now in zip((cache.moe_k, cache.moe_v), (after.moe_k, after.moe_v), strict=True):
        np.testing.assert_array_equal(now, was)
    shapes = {tuple(cache.moe_k.shape)}
    count = lambda commit: _updates_of(jax.make_jaxpr(lambda c: run(c, 3 * bl, bl, commit)[1])(cache).jaxpr, shapes)
    assert count(0) == 0 and count(bl) == 2  # the commit pass writes K and V
