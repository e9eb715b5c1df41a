"""Clover's block-diffusion Gated DeltaNet (this project's reconstruction, `bd_gdn="reconstructed"`):
the mixer against a direct, position-by-position computation written from the definition (values and
gradients), the tiled in-block softmax across many tiles, block causality and in-block bidirectionality
through the whole model, the commit contract of the cache, and block-diffusion training's two streams
against running each block behind its clean prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.errors import ConfigError
from clover_jax.model import gated_deltanet as gdn
from clover_jax.model import layers, params, transformer
from clover_jax.training import losses

CFG = get_config("test-clover-hybrid")  # blocks of 8, 2 key / 4 value heads, right conv of 3 taps
mixer = jax.jit(gdn.mixer, static_argnums=2, static_argnames=("two_stream",))
apply = jax.jit(transformer.apply, static_argnums=1)


def _noisy(tree, key, scale):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([a + scale * jax.random.normal(k, a.shape, a.dtype)
                              for a, k in zip(leaves, keys, strict=True)])


def _mixer_weights(seed: int = 0) -> gdn.GatedDeltaNetWeights:
    """One Gated DeltaNet layer's weights with every block-diffusion tensor far from its initial value."""
    w = jax.tree.map(lambda a: a[0], params.init(CFG, jax.random.key(seed)).linear_layers.attn)
    w = _noisy(w, jax.random.key(seed + 1), 0.3)
    return w.replace(bd_logit_scale=jnp.abs(w.bd_logit_scale) * 4 + 1, a_log=w.a_log - 1.0)


def _direct(x, w, blocks):
    """The definition, one position at a time (B = 1): causal conv + in-block right conv, SiLU, heads; the
    delta rule's state before each position; per position the history read-out of the state at its block's
    start, mixed into a softmax over its block's positions and one history slot."""
    c = CFG
    hk, dk, hv, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim
    t_len = x.shape[1]
    proj = x[0] @ w.qkv  # [T, C]
    blocks = [int(b) for b in blocks]
    rows = []
    for t in range(t_len):
        y = sum(w.conv[j] * proj[t - (w.conv.shape[0] - 1) + j] for j in range(w.conv.shape[0])
                if t - (w.conv.shape[0] - 1) + j >= 0)
        y = y + sum(w.conv_right[j] * proj[t + j] for j in range(w.conv_right.shape[0])
                    if t + j < t_len and blocks[t + j] == blocks[t])
        rows.append(jax.nn.silu(y))
    mixed = jnp.stack(rows)
    rep = hv // hk

    def unit(a):
        return a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6)

    q = jnp.repeat(unit(mixed[:, :hk * dk].reshape(t_len, hk, dk)), rep, axis=1)
    k = jnp.repeat(unit(mixed[:, hk * dk:2 * hk * dk].reshape(t_len, hk, dk)), rep, axis=1)
    v = mixed[:, 2 * hk * dk:].reshape(t_len, hv, dv)
    beta = jax.nn.sigmoid(x[0] @ w.b)
    g = -jnp.exp(w.a_log) * jax.nn.softplus(x[0] @ w.a + w.dt_bias)
    s = jnp.zeros((hv, dk, dv))
    before = []
    for t in range(t_len):
        before.append(s)
        s = jnp.exp(g[t])[:, None, None] * s
        s = s + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - jnp.einsum("hkv,hk->hv", s, k[t]))[:, None, :]
    outs = []
    for t in range(t_len):
        start = blocks.index(blocks[t])
        hist = jnp.einsum("hkv,hk->hv", before[start], q[t] / jnp.sqrt(dk))
        members = jnp.array([j for j in range(t_len) if blocks[j] == blocks[t]])
        logits = w.bd_logit_scale[:, None] * jnp.einsum("hk,nhk->hn", q[t], k[members])  # [H, n]
        p = jax.nn.softmax(jnp.concatenate([w.bd_history_bias[:, None], logits], -1), -1)
        o = p[:, :1] * w.bd_history_c[:, None] * hist + jnp.einsum("hn,nhd->hd", p[:, 1:], v[members])
        outs.append(o)
    o = jnp.stack(outs)[None]
    z = jnp.einsum("btd,dhk->bthk", x, w.z)
    return jnp.einsum("bthk,hkd->btd", layers.rms_norm_gated(o, z, w.norm, c.norm_eps), w.out)


# Blocks of uneven length (a prompt's partial block, then generated blocks), spanning several tiles.
BLOCKS = np.array([0] * 5 + [1] * 8 + [2] * 8 + [9] * 3)


def test_mixer_matches_the_direct_computation_and_its_gradients():
    w = _mixer_weights()
    x = jax.random.normal(jax.random.key(5), (1, len(BLOCKS), CFG.d_model))
    blocks = jnp.asarray(BLOCKS)[None]
    y, _ = mixer(x, w, CFG, blocks=blocks)
    direct = jax.jit(lambda x_, w_: _direct(x_, w_, BLOCKS))
    ref = direct(x, w)
    assert float(jnp.abs(ref).max()) > 0.1
    np.testing.assert_allclose(y, ref, atol=2e-5, rtol=2e-5)

    r = jax.random.normal(jax.random.key(6), y.shape)
    g_ours = jax.jit(jax.grad(lambda w_: jnp.sum(mixer(x, w_, CFG, blocks=blocks)[0] * r)))(w)
    g_ref = jax.jit(jax.grad(lambda w_: jnp.sum(_direct(x, w_, BLOCKS) * r)))(w)
    for name in ("conv_right", "bd_logit_scale", "bd_history_bias", "bd_history_c", "qkv", "conv", "a_log", "b"):
        a, b = getattr(g_ours, name), getattr(g_ref, name)
        assert float(jnp.abs(b).max()) > 1e-4, name  # the tensor really shapes the output
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=name)


def test_inblock_attention_tiles_equal_one_dense_softmax():
    """Many tiles (T = 70 over span 8) against the whole-window softmax with a same-block mask."""
    rng = np.random.default_rng(0)
    t = 70
    blocks = jnp.asarray(np.repeat(np.arange(24), rng.integers(3, 9, 24))[:t])[None]
    valid = jnp.asarray(rng.random((1, t)) > 0.1)
    q = gdn.l2_normalize(jnp.asarray(rng.standard_normal((1, t, 2, 16))))
    k = gdn.l2_normalize(jnp.asarray(rng.standard_normal((1, t, 2, 16))))
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


def _model(bd: str = "reconstructed", seed: int = 0):
    cfg = CFG.replace(bd_gdn=bd)
    w = params.init(cfg, jax.random.key(seed))
    return cfg, _noisy(w, jax.random.key(seed + 1), 0.1)


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
    assert params.abstract(CFG.replace(bd_gdn="none")).linear_layers.attn.conv_right.shape == (3, 3, 2 * 2 * 16 + 4 * 8)
