"""Whole-model semantics: block-causal attention, padding, dispatch and code-path equivalence."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import model
from clover_jax.config import get_config
from clover_jax.model import masks
from clover_jax.model.params import init

CLOVER = get_config("test-clover")  # block-causal, blocks of 8, output gate, partial rotary, shared expert
LLADA2 = get_config("test-llada2")  # block-causal, sigmoid router, first layer dense
LLADA_MOE = get_config("test-llada-moe")  # bidirectional


@functools.cache
def _weights(cfg):
    return init(cfg, jax.random.key(0))


@functools.cache
def _apply(cfg, dispatch: str | None = None):
    return jax.jit(lambda w, t, valid: model.apply(w, cfg, t, valid, dispatch=dispatch))


def _logits(cfg, tokens, valid=None, dispatch: str | None = None) -> np.ndarray:
    tokens = jnp.asarray(tokens)
    valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid)
    return np.asarray(_apply(cfg, dispatch)(_weights(cfg), tokens, valid))


def _tokens(cfg, shape, seed: int = 0) -> np.ndarray:
    return np.array(jax.random.randint(jax.random.key(seed), shape, 2, cfg.vocab_size - 1))


def _changed(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def test_block_causal_semantics() -> None:
    cfg, bs = CLOVER, CLOVER.block_size
    base = _tokens(cfg, (1, 3 * bs))
    ref = _logits(cfg, base, dispatch="dense")

    later = base.copy()
    later[0, 2 * bs:] = _tokens(cfg, (bs,), seed=1)  # rewrite the last block
    out = _logits(cfg, later, dispatch="dense")
    np.testing.assert_allclose(out[0, :2 * bs], ref[0, :2 * bs], atol=1e-6)  # earlier blocks cannot see it
    assert _changed(out[0, 2 * bs:], ref[0, 2 * bs:]) > 1e-3

    earlier = base.copy()
    earlier[0, 0] = (base[0, 0] + 7) % (cfg.vocab_size - 2) + 1  # one token of the first block
    out = _logits(cfg, earlier, dispatch="dense")
    for blk in (1, 2):  # every later block sees it
        assert _changed(out[0, blk * bs:(blk + 1) * bs], ref[0, blk * bs:(blk + 1) * bs]) > 1e-3

    inside = base.copy()
    inside[0, 2 * bs - 1] = (base[0, 2 * bs - 1] + 5) % (cfg.vocab_size - 2) + 1  # last token of block 1
    out = _logits(cfg, inside, dispatch="dense")
    assert _changed(out[0, bs], ref[0, bs]) > 1e-4  # the first token of the same block sees it
    np.testing.assert_allclose(out[0, :bs], ref[0, :bs], atol=1e-6)


def test_block_causal_mask_shape() -> None:
    valid = jnp.array([[True] * 10 + [False] * 6])
    mask = np.asarray(masks.full_mask(CLOVER, valid))[0]
    q, k = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    want = (k // 8 <= q // 8) & (k < 10)
    np.testing.assert_array_equal(mask, want)


def test_bidirectional_sees_the_future() -> None:
    cfg = LLADA_MOE
    base = _tokens(cfg, (1, 12))
    changed = base.copy()
    changed[0, -1] = (base[0, -1] + 3) % (cfg.vocab_size - 2) + 1
    assert _changed(_logits(cfg, changed)[0, 0], _logits(cfg, base)[0, 0]) > 1e-4


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_never_changes_unpadded_rows(side: str) -> None:
    """A batch of rows of different lengths, padded with junk tokens: each row's valid logits equal the
    row run alone (default dispatch), whatever the padding tokens are."""
    cfg = CLOVER
    t, lengths = 21, (21, 13, 5)
    rows = [_tokens(cfg, (n,), seed=10 + n) for n in lengths]
    tokens = _tokens(cfg, (len(lengths), t), seed=3)  # junk where padding
    valid = np.zeros(tokens.shape, bool)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        sl = slice(t - n, t) if side == "left" else slice(0, n)
        tokens[i, sl], valid[i, sl] = row, True
    batch = _logits(cfg, tokens, valid)
    other_junk = np.where(valid, tokens, _tokens(cfg, tokens.shape, seed=4))
    batch2 = _logits(cfg, other_junk, valid)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        sl = slice(t - n, t) if side == "left" else slice(0, n)
        alone = _logits(cfg, row[None])[0]
        np.testing.assert_allclose(batch[i, sl], alone, atol=2e-5, rtol=1e-5, err_msg=f"row {i} ({n} tokens)")
        np.testing.assert_allclose(batch2[i, sl], batch[i, sl], atol=2e-5, rtol=1e-5)
    assert np.isfinite(batch).all()  # padding queries stay finite too


@pytest.mark.parametrize("cfg", [CLOVER, LLADA2], ids=["clover", "llada2"])
def test_whole_model_dispatches_agree(cfg) -> None:
    tokens = _tokens(cfg, (2, 24), seed=5)
    ref = _logits(cfg, tokens, dispatch="dense")
    assert ref.shape == (2, 24, cfg.vocab_size) and ref.dtype == np.float32
    for name in ("ragged", "tiled"):
        np.testing.assert_allclose(_logits(cfg, tokens, dispatch=name), ref, atol=2e-5, rtol=1e-5, err_msg=name)


def test_remat_and_layer_stack_paths_agree() -> None:
    """`tiled` indexes [layer, expert] in the weight stack without remat and scans per-layer slices with it."""
    cfg = CLOVER
    tokens = _tokens(cfg, (2, 16), seed=6)
    valid = jnp.ones(tokens.shape, bool)

    def run(w, remat):
        return model.forward(w, cfg, tokens, masks.positions(valid), masks.full_mask(cfg, valid), dispatch="tiled",
                         remat=remat).logits

    g = jax.jit(jax.value_and_grad(lambda w, remat: jnp.sum(jnp.tanh(run(w, remat)))), static_argnums=1)
    (a, ga), (b, gb) = g(_weights(cfg), False), g(_weights(cfg), True)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5 * (float(jnp.max(jnp.abs(y))) + 1e-12), rtol=1e-4)
    assert float(jnp.max(jnp.abs(ga.moe_layers.mlp.down))) > 0


def test_initial_weights_are_standard_normal_draws() -> None:
    """params.standard_normal (the initialiser's counter-based draw): N(0, 1) moments and tails, no correlation
    between neighbours or between keys, a different stream per shape, and the std / dtype of each ParamSpec."""
    from clover_jax.model.params import standard_normal

    x = np.asarray(jax.jit(lambda k: standard_normal(k, (1000, 1000)))(jax.random.key(0)), np.float64)
    assert abs(x.mean()) < 5e-3 and abs(x.std() - 1) < 5e-3
    assert abs(np.mean(np.abs(x) > 2) - 0.0455) < 2e-3 and abs(np.mean(np.abs(x) > 3) - 0.0027) < 5e-4
    for a, b in ((x[:, :-1], x[:, 1:]), (x[:-1], x[1:])):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 5e-3
    y = np.asarray(standard_normal(jax.random.key(1), (1000, 1000)))
    assert abs(np.corrcoef(x.ravel(), y.ravel())[0, 1]) < 5e-3
    assert not np.array_equal(np.asarray(standard_normal(jax.random.key(0), (1000, 1000, 1)))[..., 0], x)
    w = _weights(CLOVER)
    emb = np.asarray(w.embed)
    assert emb.dtype == np.float32 and abs(emb.std() - CLOVER.init_std) < 0.05 * CLOVER.init_std
