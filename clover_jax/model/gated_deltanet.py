"""Gated DeltaNet (linear attention), the sequence mixer of the hybrid layers: `mixer`, one layer's mixer from its
weights (`params.GatedDeltaNetWeights`) and the config, and `MixerState`, what it carries from one window to the
next.

As transformers' Qwen3.5 computes it: x @ qkv; the causal depthwise conv (`short_conv.causal_conv`) + SiLU,
split into q, k and v per head; q and k L2-normalised; beta = sigmoid(x @ b), g = -exp(a_log) *
softplus(x @ a + dt_bias); the gated delta rule (`delta_rule`, whose form the window's width selects); then
out(rms_norm_gated(o, x @ z)). Block diffusion (Clover, as this project reconstructs it) adds a right-looking
conv inside each block (`short_conv.right_conv`) and replaces the delta rule's read-out by an in-block softmax
mixed with the read-out of the state the earlier blocks left (`inblock_attention`).

Padding: g = 0 and beta = 0 at padding columns (`delta_rule.mask_padding`) make them no-ops for the state, and
`short_conv.causal_conv` keeps the last valid inputs as its tail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.model import quant
from clover_jax.model.delta_rule import (
    Stream,
    block_starts,
    blocks_rule,
    l2_normalize,
    mask_padding,
    plain_rule,
    read_state,
    zero_state,
)
from clover_jax.model.layers import rms_norm_gated
from clover_jax.model.params import GatedDeltaNetWeights
from clover_jax.model.short_conv import causal_conv, right_conv, two_stream_conv

Array = jax.Array


def refines(commit: Array | int | None) -> bool:
    """Whether a pass with this `commit` is a refinement pass: commit the Python int 0 (known when tracing), so no
    column is final and every Gated DeltaNet state and conv tail stays as the pass found it."""
    return isinstance(commit, int) and commit == 0


class MixerState(NamedTuple):
    """What a Gated DeltaNet layer carries from one window to the next, per row."""

    recurrent: Array  # [B, Hv, dk, dv] float32: the delta-rule state
    conv_tail: Array  # [B, K-1, conv channels]: the last K-1 inputs of the conv (channels grouped by key head,
    # as `params.GatedDeltaNetWeights.qkv`'s)


def inblock_attention(q: Array, k: Array, v: Array, hist: Array, blocks: Array, valid: Array,
                      w: GatedDeltaNetWeights, span: int, inference: bool = False) -> Array:
    """The in-block softmax of the block-diffusion Gated DeltaNet, mixed with the history read-out.

    For position t, over the valid positions j of t's block and one history slot:
        logit_j = bd_logit_scale * <q_t, k_j>          (q, k L2-normalised: a cosine times a learned scale)
        logit_h = bd_history_bias
        o_t = softmax_h * bd_history_c * hist_t + sum_j softmax_j * v_j
    per value head. q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; hist [B, T, Hv, dv] (`delta_rule.delta_rule_blocks`
    with history=True); blocks, valid [B, T]. span: the most columns a block covers (blocks are contiguous).
    Returns [B, T, Hv, dv] float32; at padding columns (valid False) finite, unspecified values.

    The cost is linear in T: queries in tiles of `span` columns, attending to their own tile and the tiles either
    side. inference: a forward pass (prefill, scoring, the sampler's passes), which first tries one tile: when each
    row, moved some columns later (`tile_shift`), has every block inside one tile (a block grid of `span` columns,
    whatever the row's left padding: prefill windows, the reconstructed reading's forward), each tile attends to
    itself, a third of the scores; otherwise (a block of uneven length between others: a prompt's last, partial
    block before the generated ones) the three tiles. The choice is made at run time (`lax.cond`), which under
    gradients would keep both forms' intermediates, so training (inference False) runs the three tiles.
    """
    f32 = jnp.float32
    t = q.shape[1]
    if t <= span:  # one tile (a refinement pass over one block)
        o, weight = _inblock_tiles(q, k, v, blocks, valid, w, span, neighbours=False)
    elif not inference:
        o, weight = _inblock_tiles(q, k, v, blocks, valid, w, span, neighbours=True)
    else:
        shift, fits = tile_shift(blocks, valid, span)

        def aligned() -> tuple[Array, Array]:
            moved = [_move(a, shift, t + span) for a in (q, k, v, blocks, valid)]
            o, weight = _inblock_tiles(*moved, w, span, neighbours=False)
            return _move(o, -shift, t), _move(weight, -shift, t)

        o, weight = jax.lax.cond(fits, aligned,
                                 lambda: _inblock_tiles(q, k, v, blocks, valid, w, span, neighbours=True))
    return o + weight[..., None] * hist.astype(f32)


def tile_shift(blocks: Array, valid: Array, span: int) -> tuple[Array, Array]:
    """(shift [B] int32 in [0, span), fits: bool scalar): moved `shift` columns later, each row has the valid columns
    of each block inside one tile of `span` columns, for every row when `fits`. The shift puts the start of the
    row's last block on a tile's first column; `fits` checks every two consecutive valid columns of one block."""
    b, t = blocks.shape
    col = jnp.broadcast_to(jnp.arange(t), (b, t))
    starts = block_starts(blocks, valid)
    last = jnp.max(jnp.where(valid, col, -1), axis=1)  # the row's last valid column (-1: none)
    first_of_last = jnp.take_along_axis(starts, jnp.maximum(last, 0)[:, None], axis=1)[:, 0]
    shift = (-first_of_last) % span
    prev = jax.lax.cummax(jnp.where(valid, col, -1), axis=1)  # the last valid column <= t ...
    prev = jnp.pad(prev[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # ... and < t
    prev_block = jnp.take_along_axis(blocks, jnp.maximum(prev, 0), axis=1)
    tile = (col + shift[:, None]) // span
    prev_tile = (prev + shift[:, None]) // span
    apart = valid & (prev >= 0) & (prev_block == blocks) & (prev_tile != tile)
    return shift.astype(jnp.int32), ~jnp.any(apart)


def _move(a: Array, shift: Array, width: int) -> Array:
    """a [B, T, ...] with row r moved shift[r] columns later (earlier when negative), into `width` columns; columns
    with no source are zero (False)."""
    src = jnp.arange(width)[None] - shift[:, None]  # [B, width]
    inside = (src >= 0) & (src < a.shape[1])
    idx = jnp.clip(src, 0, a.shape[1] - 1).reshape(*src.shape, *([1] * (a.ndim - 2)))
    got = jnp.take_along_axis(a, idx, axis=1)
    return jnp.where(inside.reshape(*inside.shape, *([1] * (a.ndim - 2))), got, jnp.zeros((), a.dtype))


def _inblock_tiles(q: Array, k: Array, v: Array, blocks: Array, valid: Array, w: GatedDeltaNetWeights, span: int,
                   neighbours: bool) -> tuple[Array, Array]:
    """`inblock_attention`'s softmax in tiles of `span` columns, its keys the tile's own columns, or with
    `neighbours` also the tiles either side (any blocks of at most `span` contiguous columns): (the block part
    [B, T, Hv, dv], the history slot's weight softmax_h * bd_history_c [B, T, Hv]), both float32."""
    b, t, hv, dv = v.shape
    hk = q.shape[2]
    rep = hv // hk
    f32 = jnp.float32
    n = -(-t // span)
    pad = n * span - t
    near = neighbours and n > 1  # one tile has no neighbours

    def tiles(a: Array, fill: Any = 0) -> Array:  # [B, T, ...] -> [B, n, span, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return a.reshape(b, n, span, *a.shape[2:])

    def keys(a: Array, fill: Any = 0) -> Array:  # [B, n, span, ...] -> [B, n, K, ...]: tiles i-1, i, i+1, or i
        if not near:
            return a
        edge = jnp.full_like(a[:, :1], fill)
        prev = jnp.concatenate([edge, a[:, :-1]], axis=1)
        nxt = jnp.concatenate([a[:, 1:], edge], axis=1)
        return jnp.concatenate([prev, a, nxt], axis=2)

    qt, bq = tiles(q.astype(f32)), tiles(blocks, -1)
    kt, vt = keys(tiles(k.astype(f32))), keys(tiles(v.astype(f32)))
    bk, ok = keys(tiles(blocks, -1), -1), keys(tiles(valid, False), False)
    # Scores per key head (value heads j*rep .. j*rep+rep-1 share key head j), scaled per value head.
    cos = jnp.einsum("bnqgd,bnkgd->bngqk", qt, kt)  # [B, n, Hk, span, K]
    scale = w.bd_logit_scale.astype(f32).reshape(hk, rep)
    logits = cos[:, :, :, None] * scale[:, :, None, None]  # [B, n, Hk, rep, span, K]
    see = (bq[:, :, :, None] == bk[:, :, None, :]) & ok[:, :, None, :]  # [B, n, span, K]
    logits = jnp.where(see[:, :, None, None], logits, -jnp.inf)
    # The softmax over [history slot | the block's keys] without concatenating them: the history logit
    # is finite, so every row has a finite maximum (padding queries see only the history slot).
    hist_logit = w.bd_history_bias.astype(f32).reshape(hk, rep)[:, :, None, None]  # [Hk, rep, 1, 1]
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), hist_logit)
    e = jnp.exp(logits - top)
    e_hist = jnp.exp(hist_logit - top)  # [B, n, Hk, rep, span, 1]
    inv = 1.0 / (jnp.sum(e, axis=-1, keepdims=True) + e_hist)
    vt = vt.reshape(b, n, vt.shape[2], hk, rep, dv)
    o = jnp.einsum("bngrqk,bnkgrd->bnqgrd", e * inv, vt)
    p_hist = jnp.moveaxis((e_hist * inv)[..., 0], 4, 2)  # [B, n, span, Hk, rep]
    weight = p_hist * w.bd_history_c.astype(f32).reshape(hk, rep)
    return o.reshape(b, n * span, hv, dv)[:, :t], weight.reshape(b, n * span, hv)[:, :t]


def initial_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """(value heads, dk, dv): the per-row shape of the delta-rule state."""
    return cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim


def _groups(cfg: ModelConfig) -> tuple[slice, slice, slice]:
    """The q, k and v channels inside one key-head group of the conv (`params.GatedDeltaNetWeights`):
    [queries (dk) | keys (dk) | values (r dv)]."""
    dk = cfg.linear_key_head_dim
    return slice(0, dk), slice(dk, 2 * dk), slice(2 * dk, None)


def _part(a: Array, g: slice) -> Array:
    """Channels `g` of every key-head group of a [..., Hk, group] array, heads major: [..., Hk * width]; for q and k
    that is [Hk, dk] flattened, for v [Hv, dv] (value head j in group j // r), the layouts `_heads` reshapes.
    The head axis is the major one, so a split of the key heads stays a contiguous split of these channels."""
    a = a[..., g]
    return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])


def _project(x: Array, w: GatedDeltaNetWeights) -> Array:
    """The conv's input x @ qkv: x [B, T, D] -> [B, T, Hk, group] (qkv's C channels are Hk groups, heads major,
    as the conv's [K, Hk, group] taps)."""
    # The barrier keeps the TPU compiler from laying out the matmul's output for the reshape, which it did by
    # copying the whole stacked qkv weight into a transposed layout ahead of the layer scan (1 GB per chip of
    # temporaries for Clover-35B); behind it the reshape moves only this window's activations.
    proj = jax.lax.optimization_barrier(quant.matmul(x, w.qkv))
    return proj.reshape(*proj.shape[:-1], w.conv.shape[-2], -1)


def _by_group(conv: Callable[..., Array], proj: Array, weight: Array, cfg: ModelConfig, *rest: Any) -> list[Array]:
    """`conv(proj, weight, *rest)` on the q, k and v channels one group at a time (proj [B, T, Hk, group], weight
    [K, Hk, group]; `_part`): XLA recomputes an elementwise producer inside each of its consumers, so a conv over
    all channels was recomputed whole in every consumer of q, k or v (on the CPU the largest cost of a
    block-diffusion refinement pass); per group, each consumer recomputes only its own channels."""
    return [conv(_part(proj, g), _part(weight, g), *rest) for g in _groups(cfg)]


def _causal_by_group(proj: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, tail: Array | None, valid: Array,
                     keep: Array | None = None) -> tuple[list[Array], Array]:
    """`causal_conv` per channel group: ([q, k, v] conv outputs, the conv tail of all channels). proj [B, T, Hk,
    group]; tail (in and out) [B, K-1, C] with C in key-head-group order, as the weights' channels, so that a
    split of the key heads is a contiguous split of C."""
    hk = proj.shape[-2]
    grouped = None if tail is None else tail.reshape(*tail.shape[:2], hk, -1)
    outs, tails = [], []
    for g in _groups(cfg):
        y, tl = causal_conv(_part(proj, g), _part(w.conv, g), None if grouped is None else _part(grouped, g), valid,
                            keep)
        outs.append(y)
        tails.append(tl.reshape(*tl.shape[:2], hk, -1))
    tail = jnp.concatenate(tails, axis=-1)
    return outs, tail.reshape(*tail.shape[:2], -1)


def _heads(mixed: list[Array], x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array | None) -> Stream:
    """q, k (L2-normalised), v, g, beta of the conv outputs [q, k, v channels] (before SiLU) and the layer
    input x."""
    b, t, _ = x.shape
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    q, k, v = (jax.nn.silu(m) for m in mixed)
    q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)
    f32 = jnp.float32
    beta = jax.nn.sigmoid(quant.matmul(x, w.b).astype(f32))
    g = -jnp.exp(w.a_log.astype(f32)) * jax.nn.softplus(quant.matmul(x, w.a).astype(f32) + w.dt_bias.astype(f32))
    g, beta = mask_padding(g, beta, valid)
    return Stream(l2_normalize(q), l2_normalize(k), v, g, beta)


def _output(o: Array, x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig) -> Array:
    """The layer's output out(rms_norm_gated(o, x @ z)) [B, T, D] of the delta rule's o [B, T, Hv, dv] and the
    layer input x."""
    z = quant.einsum("btd,dhk->bthk", x, w.z)
    o = rms_norm_gated(o.astype(x.dtype), z, w.norm, cfg.norm_eps)
    return quant.einsum("bthk,hkd->btd", o, w.out)


def mixer(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array | None = None,
          state: MixerState | None = None, blocks: Array | None = None, commit: Array | int | None = None,
          two_stream: bool = False) -> tuple[Array, MixerState]:
    """One Gated DeltaNet layer's mixer, x [B, T, D] -> (y [B, T, D], state after the window).

    As transformers' Qwen3.5 computes it: padding rows of x are zeroed; conv(x @ qkv) + SiLU splits into
    q, k, v; q and k are L2-normalised; beta = sigmoid(x @ b), g = -exp(a_log) * softplus(x @ a + dt_bias);
    the delta rule (in the form `delta_rule.plain_rule` picks for the window's width); then
    out(rms_norm_gated(o, x @ z)). valid [B, T] marks real columns (None: all);
    padding leaves the state alone. state: what the previous window left (None: the start of the sequence).

    Block diffusion (`cfg.is_bd_gdn`, Clover as this project reconstructs it): the conv adds a right-looking
    conv inside each block (`short_conv.right_conv`), and the delta rule's read-out is replaced by an in-block
    softmax mixed with the read-out of the state the earlier blocks left (`delta_rule.delta_rule_blocks` with
    history=True, `inblock_attention`): a position sees every position of its block and the committed prefix
    only through the recurrent state. The state still advances causally over every position, for the blocks
    after.
    blocks [B, T]: block ids of the window's columns (needed in block-diffusion mode; a window always starts
    at a block boundary). commit: the state (and conv tail) returned is that after the first `commit` columns
    (None: all). In block-diffusion mode commit=0 (a Python int) is a refinement pass: no column of the
    window is final, so every position's history is the given state (the window is one block).
    two_stream: x is [B, 2L, D], the noisy sequence then the clean one (block-diffusion
    training); blocks and valid likewise (their halves are equal); each noisy block reads the clean prefix.
    """
    bd = cfg.is_bd_gdn
    if valid is None:
        valid = jnp.ones(x.shape[:2], bool)
    if blocks is None:
        if bd:
            raise ValueError("block-diffusion Gated DeltaNet needs the window's block ids")
        blocks = jnp.zeros(x.shape[:2], jnp.int32)
    x = jnp.where(valid[:, :, None], x, 0)
    if cfg.causal_prefix:
        if two_stream:
            return _prefix_two_stream(x, w, cfg, valid, blocks)
        return _prefix_mixer(x, w, cfg, valid, state, blocks, commit)
    if two_stream:
        return _two_stream(x, w, cfg, valid, blocks)
    proj = _project(x, w)
    keep = None if commit is None else valid & (jnp.arange(x.shape[1])[None] < commit)
    mixed, tail = _causal_by_group(proj, w, cfg, None if state is None else state.conv_tail, valid, keep)
    if bd:
        right = _by_group(right_conv, proj, w.conv_right, cfg, blocks, valid, 0)
        mixed = [m + r for m, r in zip(mixed, right, strict=True)]
    st = _heads(mixed, x, w, cfg, valid)
    initial = None if state is None else state.recurrent
    if not bd and commit is None:
        o, recurrent = plain_rule(x.shape[1])(st.q, st.k, st.v, st.g, st.beta, initial)
    elif bd and refines(commit):
        # A refinement pass: nothing in the window is final, so every position's history is the state the
        # committed prefix left, and the state stays. No scan.
        recurrent = zero_state(x.shape[0], *initial_shape(cfg)) if initial is None else initial.astype(jnp.float32)
        o = read_state(st.q, recurrent)
    else:
        o, _, recurrent = blocks_rule(x.shape[1], cfg.block_size, inference=True)(st, blocks, valid, initial, commit,
                                                                                history=bd)
    if bd:
        o = inblock_attention(st.q, st.k, st.v, o, blocks, valid, w, cfg.block_size, inference=True)
    return _output(o, x, w, cfg), MixerState(recurrent, tail)


class _Halves(NamedTuple):
    """Block-diffusion training's two streams after the short conv (`_halves`)."""

    xn: Array  # the noisy half's input [B, L, D]
    xc: Array  # the clean half's
    pn: Array  # their projections (`_project`)
    pc: Array
    valid: Array  # [B, L], the clean half's (both halves share it)
    blocks: Array  # [B, L]
    mixed_n: list[Array]  # the noisy half's causal conv per group over [clean ring | block] (`two_stream_conv`)
    mixed_c: list[Array]  # the clean half's causal conv per group
    tail: Array  # the clean half's conv tail


def _halves(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array, blocks: Array) -> _Halves:
    """The two-stream mixers' common start: x [B, 2L, D] split into its (noisy, clean) halves, projected, and each
    put through the causal conv as the inference passes run it (the noisy blocks' taps before a block read the
    clean half)."""
    seq = x.shape[1] // 2
    xn, xc = x[:, :seq], x[:, seq:]
    valid, blocks = valid[:, seq:], blocks[:, seq:]
    pn, pc = _project(xn, w), _project(xc, w)
    mixed_c, tail = _causal_by_group(pc, w, cfg, None, valid)
    mixed_n = [two_stream_conv(_part(pn, g), _part(pc, g), _part(w.conv, g), blocks) for g in _groups(cfg)]
    return _Halves(xn, xc, pn, pc, valid, blocks, mixed_n, mixed_c, tail)


def _two_stream(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array, blocks: Array,
                ) -> tuple[Array, MixerState]:
    """`mixer` over block-diffusion training's (noisy, clean) halves of x [B, 2L, D]."""
    bd = cfg.is_bd_gdn
    seq = x.shape[1] // 2
    xn, xc, pn, pc, valid, blocks, mixed_n, mixed_c, tail = _halves(x, w, cfg, valid, blocks)
    if bd:
        right_c, right_n = (_by_group(right_conv, p, w.conv_right, cfg, blocks, valid, 0) for p in (pc, pn))
        mixed_c = [m + r for m, r in zip(mixed_c, right_c, strict=True)]
        mixed_n = [m + r for m, r in zip(mixed_n, right_n, strict=True)]
    clean, noisy = _heads(mixed_c, xc, w, cfg, valid), _heads(mixed_n, xn, w, cfg, valid)
    oc, on, recurrent = blocks_rule(seq, cfg.block_size)(clean, blocks, valid, history=bd, noisy=noisy)
    if bd:
        oc = inblock_attention(clean.q, clean.k, clean.v, oc, blocks, valid, w, cfg.block_size)
        on = inblock_attention(noisy.q, noisy.k, noisy.v, on, blocks, valid, w, cfg.block_size)
    y = jnp.concatenate([_output(on, xn, w, cfg), _output(oc, xc, w, cfg)], axis=1)
    return y, MixerState(recurrent, tail)


# ---- Clover as its ports run it: a causal clean prefix, the block being denoised previewed over it --------------


def _preview(st: Stream, state: Array, blocks: Array, noisy: Array, w: GatedDeltaNetWeights, cfg: ModelConfig
             ) -> Array:
    """The read-out of noisy columns (`noisy` [B, T]): the block softmax over each column's block (its noisy
    columns only) with the history slot holding the clean state's read-out S^T q (`read_state`, `state` [B, Hv,
    dk, dv]: what the clean prefix left). [B, T, Hv, dv] float32."""
    return inblock_attention(st.q, st.k, st.v, read_state(st.q, state), blocks, noisy, w, cfg.block_size,
                             inference=True)


def _prefix_mixer(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array, state: MixerState | None,
                  blocks: Array, commit: Array | int | None) -> tuple[Array, MixerState]:
    """`mixer` for `cfg.causal_prefix`: the window's first `commit` valid columns (None: all) are clean and run
    Qwen3.5's causal path (the causal conv, the plain delta rule), so the state and conv tail they leave are the
    causal model's; the columns after them are noisy (the block being denoised, and in a whole-canvas pass the
    masked blocks after it, whose outputs nobody reads) and previewed from what the clean columns left: the causal
    conv over [clean ring | block] plus the right conv inside the block, SiLU, then the block softmax with the
    clean state's read-out in its history slot (`_preview`). Noisy columns never write the state or the tail."""
    t = x.shape[1]
    clean = valid if commit is None else valid & (jnp.arange(t)[None] < commit)
    noisy = valid & ~clean
    proj = _project(x, w)
    mixed, tail = _causal_by_group(proj, w, cfg, None if state is None else state.conv_tail, valid, clean)
    if commit is not None:
        right = _by_group(right_conv, proj, w.conv_right, cfg, blocks, noisy, 1)
        mixed = [m + jnp.where(noisy[:, :, None], r, 0) for m, r in zip(mixed, right, strict=True)]
    st = _heads(mixed, x, w, cfg, valid)
    initial = None if state is None else state.recurrent
    if refines(commit):  # a refinement pass: nothing is clean, the state stays
        recurrent = zero_state(x.shape[0], *initial_shape(cfg)) if initial is None else initial.astype(jnp.float32)
        o = _preview(st, recurrent, blocks, noisy, w, cfg)
    else:  # the clean columns through the plain rule (noisy ones as padding: no decay, no write)
        g, beta = mask_padding(st.g, st.beta, clean)
        o, recurrent = plain_rule(t)(st.q, st.k, st.v, g, beta, initial)
        if commit is not None:
            o = jnp.where(noisy[:, :, None, None], _preview(st, recurrent, blocks, noisy, w, cfg), o)
    return _output(o, x, w, cfg), MixerState(recurrent, tail)


def _prefix_two_stream(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array, blocks: Array
                       ) -> tuple[Array, MixerState]:
    """`_two_stream` for `cfg.causal_prefix`: the clean half runs the causal model (causal conv, plain delta
    rule); each noisy block is previewed from the clean prefix before it, as at inference: its causal conv taps
    before the block read clean inputs, the right conv stays inside the block, and its block softmax reads the
    clean state at the block's start."""
    seq = x.shape[1] // 2
    xn, xc, pn, _pc, valid, blocks, mixed_n, mixed_c, tail = _halves(x, w, cfg, valid, blocks)
    right_n = _by_group(right_conv, pn, w.conv_right, cfg, blocks, valid, 1)
    mixed_n = [m + r for m, r in zip(mixed_n, right_n, strict=True)]
    clean, noisy = _heads(mixed_c, xc, w, cfg, valid), _heads(mixed_n, xn, w, cfg, valid)
    oc, hist, recurrent = blocks_rule(seq, cfg.block_size)(clean, blocks, valid, noisy=noisy, noisy_history=True)
    on = inblock_attention(noisy.q, noisy.k, noisy.v, hist, blocks, valid, w, cfg.block_size)
    y = jnp.concatenate([_output(on, xn, w, cfg), _output(oc, xc, w, cfg)], axis=1)
    return y, MixerState(recurrent, tail)
