"""The gated delta rule over arrays: the recurrence under the Gated DeltaNet mixer (`gated_deltanet.mixer`), in
its causal and block-diffusion forms, with no weights and no config.

The gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024), per value head with a
state S of [dk, dv], for each position t:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        o_t = S_t^T q_t / sqrt(dk)

q and k arrive L2-normalised (`l2_normalize`); the `Hv` value heads share the `Hk` key heads in consecutive
groups (value head j reads key head j // (Hv / Hk)). Two forms compute the same function, both in float32:

- `delta_rule_recurrent`: one step per position under `lax.scan` (short windows: a block of 32);
- `delta_rule_chunked`: chunks of C positions (default 64); inside a chunk the updates are folded
  into a unit lower-triangular solve (the WY / UT form of DeltaNet), and a `lax.scan` carries the
  state from chunk to chunk (long inputs, prefill, training).

Block diffusion reads the state at the start of each position's block instead (`delta_rule_blocks`, one
step per position; `delta_rule_blocks_chunked`, the chunked form of it), or, in a refinement pass where no
column is final, one fixed state (`read_state`).

Which form a window runs is chosen by its width: `plain_rule` (RECURRENT_MAX) and `blocks_rule`
(BLOCKS_SCAN_MAX, CHUNK; for a forward pass also by the platform, CPU_SCAN). They read these module constants
when called, that is while their caller is traced, so setting `delta_rule.RECURRENT_MAX` (or the others) before
tracing a new function switches its form; the tests and benchmarks do.

All take and return the state, so running a prefix and then the rest equals running the whole.
Padding: the caller sets g = 0 and beta = 0 at padding columns (`mask_padding`), which makes them
no-ops for the state (no decay, no write).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

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
# On a CPU the position scan is the faster forward at every width (the rule alone over 16K columns, 2026-12-07:
# 0.10 s against 0.17 s) and sequential depth costs a CPU nothing, so `blocks_rule(..., inference=True)` runs it
# there whatever the window's width (`jax.lax.platform_dependent`: the platform the program is lowered for, so a
# TPU program compiled on a CPU host keeps the chunked form). Training keeps the chunked form everywhere (its
# backward).
CPU_SCAN = True


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
    """q and k [B, T, Hk, dk] repeated to the n_v_heads value heads (value head j reads key head j // (Hv / Hk))."""
    rep = n_v_heads // k.shape[2]
    return jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)


def zero_state(b: int, h: int, dk: int, dv: int) -> Array:
    """The state of a sequence's start: zeros [b, h, dk, dv] float32."""
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
    state = zero_state(b, hv, dk, dv) if state is None else state.astype(f32)

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
    state = zero_state(b, hv, dk, dv) if state is None else state.astype(jnp.float32)

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
                      noisy: Stream | None = None, noisy_history: bool | None = None
                      ) -> tuple[Array, Array | None, Array]:
    """The gated delta rule one position at a time, aware of diffusion blocks.

    The state advances over every valid position of `x` as in `delta_rule_recurrent`. What each position
    reads out:
      history=False: the causal read-out o_t = S_t^T q_t (S_t includes t itself);
      history=True:  the history read-out h_t = S_b^T q_t, S_b the state at the start of t's block (what the
                     blocks before it left): the committed prefix, never the block itself.
    noisy: a second stream aligned with `x` by column (block-diffusion training: x is the clean sequence,
    noisy the same sequence with masked tokens). Its read-outs use the clean state of the blocks before its
    own block: noisy_history (default `history`) True reads S_b with the noisy queries; False runs the noisy
    tokens of the block causally from S_b (a noisy block never writes the clean state). Clover as its ports run
    it takes history=False (the clean stream is the causal model) with noisy_history=True.

    blocks [B, T] block ids (a new block starts where a valid column's id differs from the previous valid
    column's); valid [B, T]. state [B, Hv, dk, dv] float32 (None: zeros). commit: the returned state is the
    state after the first `commit` columns (None: after all), so a refinement pass over an uncommitted
    block (commit=0) leaves the state alone. Returns (o [B, T, Hv, dv] float32, noisy o or None, state).
    """
    b, _, hv, dv = x.v.shape
    dk = x.q.shape[-1]
    f32 = jnp.float32
    noisy_history = history if noisy_history is None else noisy_history

    def time_major(st: Stream) -> tuple[Array, ...]:
        q, k = _group_keys(st.q, st.k, hv)
        q = q.astype(f32) * dk**-0.5
        return tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (q, k, st.v, st.g, st.beta))

    keep = None if commit is None else jnp.arange(blocks.shape[1]) < commit
    xs = (time_major(x), None if noisy is None else time_major(noisy), jnp.moveaxis(blocks.astype(jnp.int32), 1, 0),
          jnp.moveaxis(valid, 1, 0), keep)
    state = zero_state(b, hv, dk, dv) if state is None else state.astype(f32)

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
            if noisy_history:
                on = _read(snap, qn)
            else:
                n = _update(jnp.where(start, snap, n), kn, vn, gn, bn)
                on = _read(n, qn)
        return (s_new, snap, n, cur, kept), (o, on)

    init = (state, state, state if (noisy is not None and not noisy_history) else None,
            jnp.full((b,), -1, jnp.int32), None if commit is None else state)
    (final, _, _, _, kept), (o, on) = jax.lax.scan(step, init, xs)
    return jnp.moveaxis(o, 0, 1), None if on is None else jnp.moveaxis(on, 0, 1), final if kept is None else kept


def block_starts(blocks: Array, valid: Array) -> Array:
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
                              noisy: Stream | None = None, noisy_history: bool | None = None,
                              chunk: int = CHUNK) -> tuple[Array, Array | None, Array]:
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
    noisy_history = history if noisy_history is None else noisy_history

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
    starts = _to_chunks(block_starts(blocks.astype(jnp.int32), valid), chunk)  # [N, B, 1, C]
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
        if noisy_history:
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
    state = zero_state(b, hv, dk, dv) if state is None else state.astype(f32)
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


def read_state(q: Array, state: Array) -> Array:
    """The read-out S^T q / sqrt(dk) of one fixed state at every position, with no update: what
    `delta_rule_blocks` with history=True gives a window none of whose columns is final (a block-diffusion
    refinement pass). q [B, T, Hk, dk] (L2-normalised); state [B, Hv, dk, dv] float32. Returns [B, T, Hv, dv]
    float32."""
    q = jnp.repeat(q, state.shape[1] // q.shape[2], axis=2)  # as `_group_keys`
    return jnp.einsum("bthk,bhkv->bthv", q.astype(jnp.float32) * q.shape[-1]**-0.5, state)


def plain_rule(width: int) -> Callable[..., tuple[Array, Array]]:
    """The causal delta rule for a window of `width` columns: `delta_rule_recurrent` up to RECURRENT_MAX columns,
    else `delta_rule_chunked` (its default chunks of 64). Reads RECURRENT_MAX when called (at trace time)."""
    return delta_rule_chunked if width > RECURRENT_MAX else delta_rule_recurrent


def blocks_rule(width: int, block_size: int, inference: bool = False
                ) -> Callable[..., tuple[Array, Array | None, Array]]:
    """The block-aware delta rule for a window of `width` columns: the position scan (`delta_rule_blocks`) up to
    BLOCKS_SCAN_MAX columns, else the chunked form in chunks of CHUNK columns, or of the next power of two that
    holds a block of `block_size` columns (`delta_rule_blocks_chunked` needs a chunk to hold a whole block).
    inference: a forward pass (prefill, scoring), which on a CPU runs the scan at every width when CPU_SCAN is set
    (the choice is made per platform when the program is lowered). Reads BLOCKS_SCAN_MAX, CHUNK and CPU_SCAN when
    called (at trace time)."""
    if width <= BLOCKS_SCAN_MAX:
        return delta_rule_blocks
    chunked = functools.partial(delta_rule_blocks_chunked, chunk=max(CHUNK, 1 << (block_size - 1).bit_length()))
    if not (inference and CPU_SCAN):
        return chunked

    def by_platform(*args: Any, **kwargs: Any) -> tuple[Array, Array | None, Array]:
        return jax.lax.platform_dependent(cpu=lambda: delta_rule_blocks(*args, **kwargs),
                                          default=lambda: chunked(*args, **kwargs))

    return by_platform
