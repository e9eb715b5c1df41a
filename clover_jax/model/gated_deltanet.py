"""Gated DeltaNet (linear attention), the sequence mixer of the hybrid layers: `mixer`, and under it the
causal depthwise conv and the gated delta rule.

The gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024), per value head with a
state S of [dk, dv], for each position t:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        o_t = S_t^T q_t / sqrt(dk)

q and k arrive L2-normalised; the `Hv` value heads share the `Hk` key heads in consecutive groups
(value head j reads key head j // (Hv / Hk)). Two forms compute the same function, both in float32:

- `delta_rule_recurrent`: one step per position under `lax.scan` (short windows: a block of 32);
- `delta_rule_chunked`: chunks of C positions (default 64); inside a chunk the updates are folded
  into a unit lower-triangular solve (the WY / UT form of DeltaNet), and a `lax.scan` carries the
  state from chunk to chunk (long inputs, prefill, training).

Block diffusion reads the state at the start of each position's block instead (`delta_rule_blocks`, one
step per position; `delta_rule_blocks_chunked`, the chunked form of it for windows over BLOCKS_SCAN_MAX).

All take and return the state, so running a prefix and then the rest equals running the whole.
Padding: the caller sets g = 0 and beta = 0 at padding columns (`mask_padding`), which makes them
no-ops for the state (no decay, no write); `causal_conv` keeps the last valid inputs as its tail.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.model import quant
from clover_jax.model.layers import rms_norm_gated
from clover_jax.model.params import GatedDeltaNetWeights

Array = jax.Array
CHUNK = 64  # positions per chunk of the chunked form
# Windows up to this length run the recurrent form: on the 2-core CPU it was faster up to 2048 positions
# (benchmarks/forward.py --gdn); longer ones (prefill) run chunked, whose sequential depth is T / CHUNK.
RECURRENT_MAX = 256
# Block-diffusion windows (prefill, training) longer than this run `delta_rule_blocks_chunked` (chunks of CHUNK
# columns or more: a chunk holds a whole block), shorter ones the position scan `delta_rule_blocks`. As for the
# plain rule, the scan is faster forward on the 2-core CPU (16K positions, clover-tiny's heads: 0.14 s, chunked
# 0.23 s; benchmarks/long_context.py), the chunked form's backward about 2x faster (training), and its
# sequential depth T / CHUNK is what accelerators need.
BLOCKS_SCAN_MAX = 256


class MixerState(NamedTuple):
    """What a Gated DeltaNet layer carries from one window to the next, per row."""

    recurrent: Array  # [B, Hv, dk, dv] float32: the delta-rule state
    conv_tail: Array  # [B, K-1, conv channels]: the last K-1 inputs of the conv (channels grouped by key head,
    # as `params.GatedDeltaNetWeights.qkv`'s)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (the FLA / transformers convention)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def mask_padding(g: Array, beta: Array, valid: Array | None) -> tuple[Array, Array]:
    """g and beta [B, T, H] with padding columns (valid [B, T] False) set to 0: no decay, no update."""
    if valid is None:
        return g, beta
    keep = valid[:, :, None]
    return jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)


def _shift(x: Array, d: int) -> Array:
    """x [B, T, ...] moved d columns later along T: out[:, t] = x[:, t - d], zero where t - d is outside
    (d < 0 looks ahead: out[:, t] = x[:, t + |d|])."""
    if d == 0:
        return x
    t = x.shape[1]
    pad = [(0, 0)] * x.ndim
    if d > 0:
        pad[1] = (d, 0)
        return jnp.pad(x[:, :t - d], pad)
    pad[1] = (0, -d)
    return jnp.pad(x[:, -d:], pad)


def causal_conv(x: Array, weight: Array, tail: Array | None = None, valid: Array | None = None,
                keep: Array | None = None) -> tuple[Array, Array]:
    """Depthwise causal conv: y_t = sum_j weight[j] * x_{t-K+1+j}, and the conv's next tail.

    x [B, T, C]; weight [K, C]; tail [B, K-1, C]: the inputs just before x (None: zeros, the start of a
    sequence). Padding columns (valid [B, T] False) count as zero inputs, and the returned tail holds the
    last K-1 valid inputs of (tail, x), so a window whose end is padding continues exactly. keep [B, T]
    (default `valid`): the columns that may enter the returned tail (the sampler's refinement passes keep
    none, so the tail stays that of the committed prefix). No activation.
    """
    b, t, c = x.shape
    k = weight.shape[0]
    if valid is not None:
        x = jnp.where(valid[:, :, None], x, 0)
    if tail is None:
        tail = jnp.zeros((b, k - 1, c), x.dtype)
    full = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    y = sum(full[:, j:j + t] * weight[j].astype(x.dtype) for j in range(k))
    keep = valid if keep is None else keep
    if keep is None:
        return y, full[:, t:]
    # The last K-1 kept entries of `full` (the old tail counts as kept): entry number n - (K-2-s), 1-based.
    ok = jnp.concatenate([jnp.ones((b, k - 1), bool), keep], axis=1)
    count = jnp.cumsum(ok, axis=1)  # [B, K-1+T]
    want = count[:, -1:] - (k - 2 - jnp.arange(k - 1))[None]  # [B, K-1]
    idx = jnp.argmax(count[:, None, :] >= want[:, :, None], axis=-1)  # first entry reaching each count
    return y, jnp.take_along_axis(full, idx[:, :, None], axis=1)


def right_conv(x: Array, weight: Array, blocks: Array, valid: Array) -> Array:
    """The right-looking depthwise conv inside a block: y_t = sum_j weight[j] * x_{t+j}, j = 0 .. Kr-1, over
    the columns t + j that are valid and in t's block (a block never looks into the next one).
    x [B, T, C]; weight [Kr, C]; blocks [B, T] block ids; valid [B, T]."""
    y = jnp.zeros_like(x)
    for j in range(weight.shape[0]):
        same = (_shift(blocks, -j) == blocks) & _shift(valid, -j)
        y = y + jnp.where(same[:, :, None], _shift(x, -j), 0) * weight[j].astype(x.dtype)
    return y


def two_stream_conv(noisy: Array, clean: Array, weight: Array, blocks: Array) -> Array:
    """The causal conv of the noisy stream of block-diffusion training: a tap inside the column's block reads
    the noisy input, a tap in an earlier block reads the clean one (the committed prefix it will have at
    inference). noisy, clean [B, L, C] aligned by column; weight [K, C]; blocks [B, L]."""
    k = weight.shape[0]
    y = noisy * weight[k - 1].astype(noisy.dtype)
    for d in range(1, k):
        same = (_shift(blocks, d) == blocks)[:, :, None]
        y = y + jnp.where(same, _shift(noisy, d), _shift(clean, d)) * weight[k - 1 - d].astype(noisy.dtype)
    return y


def _unit_lower_inverse(strict: Array) -> Array:
    """(I + strict)^-1 for strictly lower-triangular `strict` [..., C, C], C a power of two: block forward
    substitution, [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]], the two halves inverted together."""
    c = strict.shape[-1]
    if c == 1:
        return jnp.ones_like(strict)
    h = c // 2
    halves = _unit_lower_inverse(jnp.stack([strict[..., :h, :h], strict[..., h:, h:]]))
    a_inv, d_inv = halves[0], halves[1]
    low = -(d_inv @ (strict[..., h:, :h] @ a_inv))
    top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([low, d_inv], axis=-1)], axis=-2)


def _unit_lower_solve(strict: Array, rhs: Array) -> Array:
    """X with (I + strict) X = rhs, for strictly lower-triangular `strict` [..., C, C] and rhs [..., C, d]."""
    c = strict.shape[-1]
    if c & (c - 1) == 0:
        return _unit_lower_inverse(strict) @ rhs

    def row(i: Array, x: Array) -> Array:  # forward substitution, one row per step
        xi = jax.lax.dynamic_index_in_dim(rhs, i, -2, keepdims=False) - jnp.einsum(
            "...j,...jd->...d", jax.lax.dynamic_index_in_dim(strict, i, -2, keepdims=False), x)
        return jax.lax.dynamic_update_index_in_dim(x, xi, i, -2)

    return jax.lax.fori_loop(0, c, row, jnp.zeros_like(rhs))


def _group_keys(q: Array, k: Array, n_v_heads: int) -> tuple[Array, Array]:
    rep = n_v_heads // k.shape[2]
    return jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)


def _zero_state(b: int, h: int, dk: int, dv: int) -> Array:
    return jnp.zeros((b, h, dk, dv), jnp.float32)


def _update(s: Array, k: Array, v: Array, g: Array, beta: Array) -> Array:
    """One gated delta-rule step on states s [B, H, dk, dv] for one position (k [B, H, dk], v [B, H, dv],
    g and beta [B, H])."""
    s = s * jnp.exp(g)[:, :, None, None]
    kv = jnp.einsum("bhkv,bhk->bhv", s, k)
    return s + jnp.einsum("bhk,bhv->bhkv", k, (v - kv) * beta[:, :, None])


def _read(s: Array, q: Array) -> Array:
    """The read-out S^T q of states s [B, H, dk, dv] for queries q [B, H, dk]."""
    return jnp.einsum("bhkv,bhk->bhv", s, q)


def delta_rule_recurrent(q: Array, k: Array, v: Array, g: Array, beta: Array,
                         state: Array | None = None) -> tuple[Array, Array]:
    """The gated delta rule one position at a time.

    q, k [B, T, Hk, dk] (L2-normalised); v [B, T, Hv, dv]; g (log decay, <= 0) and beta [B, T, Hv];
    state [B, Hv, dk, dv] float32 (None: zeros). Returns (o [B, T, Hv, dv] float32, final state).
    """
    b, _, hv, dv = v.shape
    dk = q.shape[-1]
    q, k = _group_keys(q, k, hv)
    f32 = jnp.float32
    q = q.astype(f32) * dk**-0.5
    xs = tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (q, k, v, g, beta))
    state = _zero_state(b, hv, dk, dv) if state is None else state.astype(f32)

    def step(s: Array, x: tuple) -> tuple[Array, Array]:
        qt, kt, vt, gt, bt = x  # [B, Hv, d] / [B, Hv]
        s = _update(s, kt, vt, gt, bt)
        return s, _read(s, qt)

    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def _to_chunks(a: Array, chunk: int) -> Array:
    """[B, T, H, ...] -> [N, B, H, C, ...] in float32 (a [B, T] array -> [N, B, 1, C]), T padded with zeros to N
    chunks of C = `chunk` columns."""
    if a.ndim == 2:
        a = a[:, :, None]
    b, t = a.shape[:2]
    n = -(-t // chunk)
    a = jnp.pad(a, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (a.ndim - 2))
    a = a.reshape(b, n, chunk, *a.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)


def _from_chunks(a: Array, t: int) -> Array:
    """[N, B, H, C, d] -> [B, T, H, d], the first t columns."""
    n, b, h, c, d = a.shape
    return jnp.swapaxes(jnp.moveaxis(a, 0, 2).reshape(b, h, n * c, d)[:, :, :t], 1, 2)


def _wy(k: Array, v: Array, beta: Array, cum: Array, runs: Array | None = None, start: Array | None = None,
        ) -> tuple[Array, Array, Array]:
    """A chunk of delta-rule updates in the WY / UT form: (U, W, D) with D[i, j] = exp(cum_i - cum_j) for j <= i
    in one run (else 0) and
      (I + strict_lower(diag(beta) K K^T * D)) [U | W] = [diag(beta) V | diag(beta) diag(exp(cum - start)) K],
    so that a run starting from state S writes the corrected values V' = U - W S. k [..., C, dk], v [..., C, dv],
    beta and cum (cumulative log decay) [..., C]; runs [..., C, C] (None: one run): whether positions i and j
    belong to one run; start [..., C] (None: 0): the cumulative decay before each position's run."""
    c = k.shape[-2]
    lower = jnp.tril(jnp.ones((c, c), bool))
    see = lower if runs is None else lower & runs
    decay = jnp.exp(jnp.where(see, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    kb = k * beta[..., None]
    strict = jnp.where(~jnp.eye(c, dtype=bool), jnp.einsum("...id,...jd->...ij", kb, k) * decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(cum if start is None else cum - start)[..., None]], -1)
    # (Block forward substitution rather than lax.linalg.triangular_solve: on XLA:CPU (jax 0.10) the
    # triangular solve inside the layer scan next to the tiled MoE dispatch gave wrong results; see
    # tests/test_hybrid_dispatch.py.)
    solved = _unit_lower_solve(strict, rhs)
    return solved[..., :v.shape[-1]], solved[..., v.shape[-1]:], decay


def delta_rule_chunked(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array | None = None,
                       chunk: int = 64) -> tuple[Array, Array]:
    """The gated delta rule in chunks of `chunk` positions; same contract as `delta_rule_recurrent`.

    Inside a chunk, with G the cumulative log decay and D[i, j] = exp(G_i - G_j) for j <= i:
      (I + strict_lower(diag(beta) K K^T * D)) [U | W] = [diag(beta) V | diag(beta) diag(exp(G)) K],
      V' = U - W S,   O = diag(exp(G)) Q S + lower(Q K^T * D) V',
      S <- exp(G_C) S + (diag(exp(G_C - G)) K)^T V'.
    T is padded to a multiple of `chunk` with no-op positions (g = beta = 0).
    """
    b, t, hv, dv = v.shape
    dk = q.shape[-1]
    q, k = _group_keys(q, k, hv)
    q = q.astype(jnp.float32) * dk**-0.5
    q, k, v, g, beta = (_to_chunks(a.astype(jnp.float32), chunk) for a in (q, k, v, g, beta))  # q [N, B, H, C, dk]
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    u, w, decay = _wy(k, v, beta, cum)
    attn = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [N, B, H, 1, 1]
    state = _zero_state(b, hv, dk, dv) if state is None else state.astype(jnp.float32)

    def step(s: Array, x: tuple) -> tuple[Array, Array]:
        u_c, w_c, attn_c, q_c, k_c, d_c = x
        v_new = u_c - w_c @ s
        o = q_c @ s + attn_c @ v_new
        return s * d_c + jnp.swapaxes(k_c, -1, -2) @ v_new, o

    state, o = jax.lax.scan(step, state, (u, w, attn, q_decayed, k_decayed, chunk_decay))  # o [N, B, H, C, dv]
    return _from_chunks(o, t), state


class Stream(NamedTuple):
    """One stream's per-position inputs of the delta rule (q, k L2-normalised)."""

    q: Array  # [B, T, Hk, dk]
    k: Array  # [B, T, Hk, dk]
    v: Array  # [B, T, Hv, dv]
    g: Array  # [B, T, Hv] log decay
    beta: Array  # [B, T, Hv]


def delta_rule_blocks(x: Stream, blocks: Array, valid: Array, state: Array | None = None,
                      commit: Array | int | None = None, history: bool = False,
                      noisy: Stream | None = None) -> tuple[Array, Array | None, Array]:
    """The gated delta rule one position at a time, aware of diffusion blocks.

    The state advances over every valid position of `x` as in `delta_rule_recurrent`. What each position
    reads out:
      history=False: the causal read-out o_t = S_t^T q_t (S_t includes t itself);
      history=True:  the history read-out h_t = S_b^T q_t, S_b the state at the start of t's block (what the
                     blocks before it left): the committed prefix, never the block itself.
    noisy: a second stream aligned with `x` by column (block-diffusion training: x is the clean sequence,
    noisy the same sequence with masked tokens). Its read-outs use the clean state of the blocks before its
    own block: history=True reads S_b with the noisy queries; history=False runs the noisy tokens of the
    block causally from S_b (a noisy block never writes the clean state).

    blocks [B, T] block ids (a new block starts where a valid column's id differs from the previous valid
    column's); valid [B, T]. state [B, Hv, dk, dv] float32 (None: zeros). commit: the returned state is the
    state after the first `commit` columns (None: after all), so a refinement pass over an uncommitted
    block (commit=0) leaves the state alone. Returns (o [B, T, Hv, dv] float32, noisy o or None, state).
    """
    b, _, hv, dv = x.v.shape
    dk = x.q.shape[-1]
    f32 = jnp.float32

    def time_major(st: Stream) -> tuple[Array, ...]:
        q, k = _group_keys(st.q, st.k, hv)
        q = q.astype(f32) * dk**-0.5
        return tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (q, k, st.v, st.g, st.beta))

    keep = None if commit is None else jnp.arange(blocks.shape[1]) < commit
    xs = (time_major(x), None if noisy is None else time_major(noisy), jnp.moveaxis(blocks.astype(jnp.int32), 1, 0),
          jnp.moveaxis(valid, 1, 0), keep)
    state = _zero_state(b, hv, dk, dv) if state is None else state.astype(f32)

    def step(carry: tuple, xt: tuple) -> tuple[tuple, tuple]:
        s, snap, n, cur, kept = carry
        (qt, kt, vt, gt, bt), nt, blk, ok, kp = xt
        start = (ok & (blk != cur))[:, None, None, None]
        snap = jnp.where(start, s, snap)
        cur = jnp.where(ok, blk, cur)
        s_new = _update(s, kt, vt, gt, bt)
        o = _read(snap if history else s_new, qt)
        if kept is not None:  # the state after the committed columns
            kept = jnp.where(kp, s_new, kept)
        on = None
        if nt is not None:
            qn, kn, vn, gn, bn = nt
            if history:
                on = _read(snap, qn)
            else:
                n = _update(jnp.where(start, snap, n), kn, vn, gn, bn)
                on = _read(n, qn)
        return (s_new, snap, n, cur, kept), (o, on)

    init = (state, state, state if (noisy is not None and not history) else None,
            jnp.full((b,), -1, jnp.int32), None if commit is None else state)
    (final, _, _, _, kept), (o, on) = jax.lax.scan(step, init, xs)
    return jnp.moveaxis(o, 0, 1), None if on is None else jnp.moveaxis(on, 0, 1), final if kept is None else kept


def _block_starts(blocks: Array, valid: Array) -> Array:
    """[B, T] the column where each column's block starts, as `delta_rule_blocks` reads it: the last valid
    column <= t whose block id differs from the previous valid column's (block ids >= 0); a column with none
    before it (leading padding) is its own start."""
    col = jnp.broadcast_to(jnp.arange(blocks.shape[1]), blocks.shape)
    last = jax.lax.cummax(jnp.where(valid, col, -1), axis=1)  # the last valid column <= t
    cur = jnp.where(last >= 0, jnp.take_along_axis(blocks, jnp.maximum(last, 0), axis=1), -1)
    prev = jnp.pad(cur[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    start = jax.lax.cummax(jnp.where(valid & (blocks != prev), col, -1), axis=1)
    return jnp.where(start >= 0, start, col)


def delta_rule_blocks_chunked(x: Stream, blocks: Array, valid: Array, state: Array | None = None,
                              commit: Array | int | None = None, history: bool = False,
                              noisy: Stream | None = None, chunk: int = CHUNK) -> tuple[Array, Array | None, Array]:
    """`delta_rule_blocks` in chunks of `chunk` positions (the chunked algorithm of `delta_rule_chunked`): same
    contract, every combination of history / noisy / commit, and the same results (float32 rounding), for block
    ids >= 0 and blocks that never cover more than `chunk` columns from their first valid column to the next
    block's (longer ones give wrong read-outs; padding columns past that reach read finite, unspecified values).
    commit: a scalar, as in `delta_rule_blocks`. chunk: a power of two keeps the triangular solves fast.

    The state before column s of a chunk window (chunk c-1 then chunk c, start state P, cumulative log decay G
    over the window, G before its first column = 0, V' the corrected values) is
        S_s- = exp(G_{s-1}) P + sum_{j<s} exp(G_{s-1} - G_j) k_j v'_j^T,
    so a read-out x_t . S_r- of the state before column r (r = t's block start, or t + 1 for the causal
    read-out) is the chunked output formula with the decay taken at r - 1 and masked to j < r: a block starting
    in chunk c-1 or c, the window holds it. The scan carries the state at the start of chunk c and of chunk c-1
    and chunk c-1's V'. A noisy block running causally from its block-start state S_b (history=False) is the
    WY form of that run, solved over the window (its blocks are runs): V'_n = U_n - W_n S_b,
    O_n = diag(exp(G^n)) Q_n S_b + L_n V'_n = R(diag(exp(G^n)) Q_n - L_n W_n) + L_n U_n, R the per-row read of
    S_b (L_n mixes rows of one block only, which read the same S_b). commit: the state before column `commit`
    of its chunk, from that chunk's start state and V'.
    """
    b, t, hv, dv = x.v.shape
    dk = x.q.shape[-1]
    f32 = jnp.float32
    n = -(-t // chunk)

    def chunked(st: Stream) -> tuple[Array, ...]:  # q, k, v, g, beta as [N, B, H, C, ...]
        q, k = _group_keys(st.q, st.k, hv)
        q = q.astype(f32) * dk**-0.5
        return tuple(_to_chunks(a.astype(f32), chunk) for a in (q, k, st.v, st.g, st.beta))

    def window(a: Array, fill: Any = 0) -> Array:  # chunk arrays [N, B, H, C, ...] -> chunk c-1, then c: 2C
        return jnp.concatenate([jnp.concatenate([jnp.full_like(a[:1], fill), a[:-1]]), a], axis=3)

    def before(cum: Array, at: Array) -> tuple[Array, Array]:
        """(r, G_{r-1}): the window index of columns `at` [N, B, 1, R] and the window's cumulative log decay
        cum [N, B, H, 2C] before it (0 at the window's start)."""
        r = jnp.clip(at - first, 0, 2 * chunk)
        return r, jnp.take_along_axis(jnp.pad(cum, [(0, 0)] * 3 + [(1, 0)]),
                                      jnp.broadcast_to(r, (*cum.shape[:3], r.shape[-1])), axis=-1)

    q, k, v, g, beta = chunked(x)
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    u, w, _ = _wy(k, v, beta, cum)
    k_end = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # decayed to the chunk's end
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]
    k2, cum2 = window(k), jnp.cumsum(window(g), axis=-1)  # the window's keys and decay
    starts = _to_chunks(_block_starts(blocks.astype(jnp.int32), valid), chunk)  # [N, B, 1, C]
    first = ((jnp.arange(n) - 1) * chunk)[:, None, None, None]  # the window's first column
    col = first + chunk + jnp.arange(chunk)

    def reads(rows: Array, at: Array) -> tuple[Array, Array]:
        """rows [N, B, H, C, dk] . S_{at}- as (rows * exp(G_{r-1}): read P, A [N, B, H, C, 2C]: read the V')."""
        r, g_r = before(cum2, at)
        see = jnp.arange(2 * chunk) < r[..., None]
        a = jnp.einsum("...id,...jd->...ij", rows, k2) * jnp.exp(
            jnp.where(see, g_r[..., None] - cum2[..., None, :], -jnp.inf))
        return rows * jnp.exp(g_r)[..., None], a

    streams = [reads(q, starts if history else col + 1)]
    extra = None
    if noisy is not None:
        qn, kn, vn, gn, bn = chunked(noisy)
        if history:
            streams.append(reads(qn, starts))
        else:  # the noisy blocks as runs over the window, from their block-start states
            qn, kn, vn, bn, sn = window(qn), window(kn), window(vn), window(bn), window(starts, -1)
            cumn = jnp.cumsum(window(gn), axis=-1)
            g_run = before(cumn, sn)[1]  # G^n before each column's run
            un, wn, dn = _wy(kn, vn, bn, cumn, sn[..., :, None] == sn[..., None, :], g_run)
            ln = (jnp.einsum("...id,...jd->...ij", qn, kn) * dn)[..., chunk:, :]  # chunk c's rows
            xn = (qn * jnp.exp(cumn - g_run)[..., None])[..., chunk:, :] - ln @ wn
            streams.append(reads(xn, starts))
            extra = _from_chunks(ln @ un, t)
    q_read = jnp.concatenate([s[0] for s in streams], axis=3)  # [N, B, H, R C, dk]
    a_read = jnp.concatenate([s[1] for s in streams], axis=3)  # [N, B, H, R C, 2C]
    state = _zero_state(b, hv, dk, dv) if state is None else state.astype(f32)
    idx = jnp.arange(n)
    if commit is not None:  # the state before column m: chunk cm's start state, then its first mu columns
        m = jnp.clip(jnp.asarray(commit, jnp.int32), 0, t)
        cm = jnp.minimum(m // chunk, n - 1)
        mu = m - cm * chunk
        cum_m = jnp.pad(jnp.take(cum, cm, axis=0), [(0, 0), (0, 0), (1, 0)])  # [B, H, C+1]: G before each column
        g_m = jax.lax.dynamic_index_in_dim(cum_m, mu, -1)  # G_{mu-1} [B, H, 1]
        k_m = jnp.take(k, cm, axis=0) * jnp.exp(jnp.where(jnp.arange(chunk) < mu, g_m - cum_m[..., 1:], -jnp.inf)
                                                )[..., None]

    def step(carry: tuple, xs: tuple) -> tuple[tuple, Array]:
        s, p, v_prev, *snap = carry
        u_c, w_c, k_c, d_c, q_c, a_c, i = xs
        v_new = u_c - w_c @ s
        o = q_c @ p + a_c @ jnp.concatenate([v_prev, v_new], axis=-2)
        if snap:  # chunk cm's start state and V'
            snap = [jnp.where(i == cm, s, snap[0]), jnp.where(i == cm, v_new, snap[1])]
        return (s * d_c + jnp.swapaxes(k_c, -1, -2) @ v_new, s, v_new, *snap), o

    init = (state, state, jnp.zeros((b, hv, chunk, dv), f32))
    if commit is not None:
        init += (state, init[2])
    (final, _, _, *snap), o = jax.lax.scan(step, init, (u, w, k_end, chunk_decay, q_read, a_read, idx))
    if commit is not None:
        final = snap[0] * jnp.exp(g_m)[..., None] + jnp.swapaxes(k_m, -1, -2) @ snap[1]
    o = o.reshape(*o.shape[:3], len(streams), chunk, dv)
    outs = [_from_chunks(o[:, :, :, i], t) for i in range(len(streams))]
    on = None if noisy is None else outs[1] if extra is None else outs[1] + extra
    return outs[0], on, final


def inblock_attention(q: Array, k: Array, v: Array, hist: Array, blocks: Array, valid: Array,
                      w: GatedDeltaNetWeights, span: int) -> Array:
    """The in-block softmax of the block-diffusion Gated DeltaNet, mixed with the history read-out.

    For position t, over the valid positions j of t's block and one history slot:
        logit_j = bd_logit_scale * <q_t, k_j>          (q, k L2-normalised: a cosine times a learned scale)
        logit_h = bd_history_bias
        o_t = softmax_h * bd_history_c * hist_t + sum_j softmax_j * v_j
    per value head. q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; hist [B, T, Hv, dv] (`delta_rule_blocks` with
    history=True); blocks, valid [B, T]. span: the most columns a block covers (blocks are contiguous), so
    the keys of a query in tile i of `span` columns lie in tiles i-1 .. i+1: the cost is linear in T.
    Returns [B, T, Hv, dv] float32.
    """
    b, t, hv, dv = v.shape
    hk = q.shape[2]
    rep = hv // hk
    f32 = jnp.float32
    n = -(-t // span)
    pad = n * span - t

    def tiles(a: Array, fill: Any = 0) -> Array:  # [B, T, ...] -> [B, n, span, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return a.reshape(b, n, span, *a.shape[2:])

    def neighbours(a: Array, fill: Any = 0) -> Array:  # [B, n, span, ...] -> [B, n, 3 span, ...]: tiles i-1, i, i+1
        if n == 1:  # one tile (a refinement pass over one block): its neighbours would be all padding
            return a
        edge = jnp.full_like(a[:, :1], fill)
        prev = jnp.concatenate([edge, a[:, :-1]], axis=1)
        nxt = jnp.concatenate([a[:, 1:], edge], axis=1)
        return jnp.concatenate([prev, a, nxt], axis=2)

    qt, bq = tiles(q.astype(f32)), tiles(blocks, -1)
    kt, vt = neighbours(tiles(k.astype(f32))), neighbours(tiles(v.astype(f32)))
    bk, ok = neighbours(tiles(blocks, -1), -1), neighbours(tiles(valid, False), False)
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
    c = w.bd_history_c.astype(f32).reshape(hk, rep)
    o = o + (p_hist * c)[..., None] * tiles(hist.astype(f32)).reshape(b, n, span, hk, rep, dv)
    return o.reshape(b, n * span, hv, dv)[:, :t]


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
    z = quant.einsum("btd,dhk->bthk", x, w.z)
    o = rms_norm_gated(o.astype(x.dtype), z, w.norm, cfg.norm_eps)
    return quant.einsum("bthk,hkd->btd", o, w.out)


def _blocks_rule(width: int, cfg: ModelConfig) -> Callable[..., tuple[Array, Array | None, Array]]:
    """The block-aware delta rule for a window of `width` columns: the position scan (`delta_rule_blocks`) up to
    BLOCKS_SCAN_MAX columns, else the chunked form in chunks of CHUNK columns, or of the next power of two that
    holds a block (`cfg.block_size` columns, as `inblock_attention` assumes)."""
    if width <= BLOCKS_SCAN_MAX:
        return delta_rule_blocks
    return functools.partial(delta_rule_blocks_chunked, chunk=max(CHUNK, 1 << (cfg.block_size - 1).bit_length()))


def mixer(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array | None = None,
          state: MixerState | None = None, blocks: Array | None = None, commit: Array | int | None = None,
          two_stream: bool = False) -> tuple[Array, MixerState]:
    """One Gated DeltaNet layer's mixer, x [B, T, D] -> (y [B, T, D], state after the window).

    As transformers' Qwen3.5 computes it: padding rows of x are zeroed; conv(x @ qkv) + SiLU splits into
    q, k, v; q and k are L2-normalised; beta = sigmoid(x @ b), g = -exp(a_log) * softplus(x @ a + dt_bias);
    the delta rule; then out(rms_norm_gated(o, x @ z)). valid [B, T] marks real columns (None: all);
    padding leaves the state alone. state: what the previous window left (None: the start of the sequence).

    Block diffusion (`cfg.is_bd_gdn`, Clover as this project reconstructs it): the conv adds a right-looking
    conv inside each block (`right_conv`), and the delta rule's read-out is replaced by an in-block softmax
    mixed with the read-out of the state the earlier blocks left (`delta_rule_blocks` with history=True,
    `inblock_attention`): a position sees every position of its block and the committed prefix only through
    the recurrent state. The state still advances causally over every position, for the blocks after.
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
    if two_stream:
        return _two_stream(x, w, cfg, valid, blocks)
    proj = _project(x, w)
    keep = None if commit is None else valid & (jnp.arange(x.shape[1])[None] < commit)
    mixed, tail = _causal_by_group(proj, w, cfg, None if state is None else state.conv_tail, valid, keep)
    if bd:
        right = _by_group(right_conv, proj, w.conv_right, cfg, blocks, valid)
        mixed = [m + r for m, r in zip(mixed, right, strict=True)]
    st = _heads(mixed, x, w, cfg, valid)
    initial = None if state is None else state.recurrent
    if not bd and commit is None:
        rule = delta_rule_chunked if x.shape[1] > RECURRENT_MAX else delta_rule_recurrent
        o, recurrent = rule(st.q, st.k, st.v, st.g, st.beta, initial)
    elif bd and isinstance(commit, int) and commit == 0:
        # A refinement pass: nothing in the window is final, so every position's history is the state the
        # committed prefix left, and the state stays. No scan.
        recurrent = _zero_state(x.shape[0], *initial_shape(cfg)) if initial is None else initial.astype(jnp.float32)
        q, _ = _group_keys(st.q, st.k, cfg.linear_num_value_heads)
        o = jnp.einsum("bthk,bhkv->bthv", q.astype(jnp.float32) * cfg.linear_key_head_dim**-0.5, recurrent)
    else:
        o, _, recurrent = _blocks_rule(x.shape[1], cfg)(st, blocks, valid, initial, commit, history=bd)
    if bd:
        o = inblock_attention(st.q, st.k, st.v, o, blocks, valid, w, cfg.block_size)
    return _output(o, x, w, cfg), MixerState(recurrent, tail)


def _two_stream(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array, blocks: Array,
                ) -> tuple[Array, MixerState]:
    """`mixer` over block-diffusion training's (noisy, clean) halves of x [B, 2L, D]."""
    bd = cfg.is_bd_gdn
    seq = x.shape[1] // 2
    xn, xc = x[:, :seq], x[:, seq:]
    valid, blocks = valid[:, seq:], blocks[:, seq:]
    pn, pc = _project(xn, w), _project(xc, w)
    mixed_c, tail = _causal_by_group(pc, w, cfg, None, valid)
    mixed_n = [two_stream_conv(_part(pn, g), _part(pc, g), _part(w.conv, g), blocks) for g in _groups(cfg)]
    if bd:
        right_c, right_n = (_by_group(right_conv, p, w.conv_right, cfg, blocks, valid) for p in (pc, pn))
        mixed_c = [m + r for m, r in zip(mixed_c, right_c, strict=True)]
        mixed_n = [m + r for m, r in zip(mixed_n, right_n, strict=True)]
    clean, noisy = _heads(mixed_c, xc, w, cfg, valid), _heads(mixed_n, xn, w, cfg, valid)
    oc, on, recurrent = _blocks_rule(seq, cfg)(clean, blocks, valid, history=bd, noisy=noisy)
    if bd:
        oc = inblock_attention(clean.q, clean.k, clean.v, oc, blocks, valid, w, cfg.block_size)
        on = inblock_attention(noisy.q, noisy.k, noisy.v, on, blocks, valid, w, cfg.block_size)
    y = jnp.concatenate([_output(on, xn, w, cfg), _output(oc, xc, w, cfg)], axis=1)
    return y, MixerState(recurrent, tail)
