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

Both take and return the state, so running a prefix and then the rest equals running the whole.
Padding: the caller sets g = 0 and beta = 0 at padding columns (`mask_padding`), which makes them
no-ops for the state (no decay, no write); `causal_conv` keeps the last valid inputs as its tail.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.model.layers import rms_norm_gated
from clover_jax.model.params import GatedDeltaNetWeights

Array = jax.Array
CHUNK = 64  # positions per chunk of the chunked form
# Windows up to this length run the recurrent form: on the 2-core CPU it was faster up to 2048 positions
# (benchmarks/forward.py --gdn); longer ones (prefill) run chunked, whose sequential depth is T / CHUNK.
RECURRENT_MAX = 256


class MixerState(NamedTuple):
    """What a Gated DeltaNet layer carries from one window to the next, per row."""

    recurrent: Array  # [B, Hv, dk, dv] float32: the delta-rule state
    conv_tail: Array  # [B, K-1, conv channels]: the last K-1 inputs of the conv


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


def causal_conv(x: Array, weight: Array, tail: Array | None = None,
                valid: Array | None = None) -> tuple[Array, Array]:
    """Depthwise causal conv: y_t = sum_j weight[j] * x_{t-K+1+j}, and the conv's next tail.

    x [B, T, C]; weight [K, C]; tail [B, K-1, C]: the inputs just before x (None: zeros, the start of a
    sequence). Padding columns (valid [B, T] False) count as zero inputs, and the returned tail holds the
    last K-1 valid inputs of (tail, x), so a window whose end is padding continues exactly. No activation.
    """
    b, t, c = x.shape
    k = weight.shape[0]
    if valid is not None:
        x = jnp.where(valid[:, :, None], x, 0)
    if tail is None:
        tail = jnp.zeros((b, k - 1, c), x.dtype)
    full = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    y = sum(full[:, j:j + t] * weight[j].astype(x.dtype) for j in range(k))
    if valid is None:
        return y, full[:, t:]
    # The last K-1 valid entries of `full` (the old tail counts as valid): entry number n - (K-2-s), 1-based.
    ok = jnp.concatenate([jnp.ones((b, k - 1), bool), valid], axis=1)
    count = jnp.cumsum(ok, axis=1)  # [B, K-1+T]
    want = count[:, -1:] - (k - 2 - jnp.arange(k - 1))[None]  # [B, K-1]
    idx = jnp.argmax(count[:, None, :] >= want[:, :, None], axis=-1)  # first entry reaching each count
    return y, jnp.take_along_axis(full, idx[:, :, None], axis=1)


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
        s = s * jnp.exp(gt)[:, :, None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, kt)
        s = s + jnp.einsum("bhk,bhv->bhkv", kt, (vt - kv) * bt[:, :, None])
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def delta_rule_chunked(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array | None = None,
                       chunk: int = 64) -> tuple[Array, Array]:
    """The gated delta rule in chunks of `chunk` positions; same contract as `delta_rule_recurrent`.

    Inside a chunk, with G the cumulative log decay and D[i, j] = exp(G_i - G_j) for j <= i:
      (I + strict_lower(diag(beta) K K^T * D)) [U | W] = [diag(beta) V | diag(beta) diag(exp(G)) K]
      V' = U - W S,   O = diag(exp(G)) Q S + lower(Q K^T * D) V',
      S <- exp(G_C) S + (diag(exp(G_C - G)) K)^T V'.
    T is padded to a multiple of `chunk` with no-op positions (g = beta = 0).
    """
    b, t, hv, dv = v.shape
    dk = q.shape[-1]
    q, k = _group_keys(q, k, hv)
    f32 = jnp.float32
    q = q.astype(f32) * dk**-0.5
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def chunks(a: Array) -> Array:  # [B, T, H, ...] -> [N, B, H, C, ...]
        a = jnp.pad(a.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n, chunk, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))  # q [N, B, H, C, dk], g [N, B, H, C]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [N, B, H, C, C]
    kb = k * beta[..., None]
    strict = jnp.where(lower & ~jnp.eye(chunk, dtype=bool), jnp.einsum("...id,...jd->...ij", kb, k) * decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(cum)[..., None]], axis=-1)
    # (Block forward substitution rather than lax.linalg.triangular_solve: on XLA:CPU (jax 0.10) the
    # triangular solve inside the layer scan next to the tiled MoE dispatch gave wrong results; see
    # tests/test_hybrid_dispatch.py.)
    solved = _unit_lower_solve(strict, rhs)
    u, w = solved[..., :dv], solved[..., dv:]
    attn = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [N, B, H, 1, 1]
    state = _zero_state(b, hv, dk, dv) if state is None else state.astype(f32)

    def step(s: Array, x: tuple) -> tuple[Array, Array]:
        u_c, w_c, attn_c, q_c, k_c, d_c = x
        v_new = u_c - w_c @ s
        o = q_c @ s + attn_c @ v_new
        return s * d_c + jnp.swapaxes(k_c, -1, -2) @ v_new, o

    state, o = jax.lax.scan(step, state, (u, w, attn, q_decayed, k_decayed, chunk_decay))  # o [N, B, H, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, hv, n * chunk, dv)[:, :, :t]
    return jnp.swapaxes(o, 1, 2), state


def mixer(x: Array, w: GatedDeltaNetWeights, cfg: ModelConfig, valid: Array | None = None,
          state: MixerState | None = None) -> tuple[Array, MixerState]:
    """One Gated DeltaNet layer's mixer, x [B, T, D] -> (y [B, T, D], state after the window).

    As transformers' Qwen3.5 computes it: padding rows of x are zeroed; conv(x @ qkv) + SiLU splits into
    q, k, v; q and k are L2-normalised; beta = sigmoid(x @ b), g = -exp(a_log) * softplus(x @ a + dt_bias);
    the delta rule (chunked for windows longer than RECURRENT_MAX, recurrent otherwise); then
    out(rms_norm_gated(o, x @ z)). valid [B, T] marks real columns (None: all); padding leaves the state
    alone. state: what the previous window left (None: the start of the sequence).
    """
    b, t, _ = x.shape
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    if valid is not None:
        x = jnp.where(valid[:, :, None], x, 0)
    mixed, tail = causal_conv(x @ w.qkv, w.conv, None if state is None else state.conv_tail, valid)
    mixed = jax.nn.silu(mixed)
    q = mixed[..., :hk * dk].reshape(b, t, hk, dk)
    k = mixed[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
    v = mixed[..., 2 * hk * dk:].reshape(b, t, hv, dv)
    f32 = jnp.float32
    beta = jax.nn.sigmoid((x @ w.b).astype(f32))
    g = -jnp.exp(w.a_log.astype(f32)) * jax.nn.softplus((x @ w.a).astype(f32) + w.dt_bias.astype(f32))
    g, beta = mask_padding(g, beta, valid)
    q, k = l2_normalize(q), l2_normalize(k)
    rule = delta_rule_chunked if t > RECURRENT_MAX else delta_rule_recurrent
    o, recurrent = rule(q, k, v, g, beta, None if state is None else state.recurrent)
    z = jnp.einsum("btd,dhk->bthk", x, w.z)
    o = rms_norm_gated(o.astype(x.dtype), z, w.norm, cfg.norm_eps)
    return jnp.einsum("bthk,hkd->btd", o, w.out), MixerState(recurrent, tail)
