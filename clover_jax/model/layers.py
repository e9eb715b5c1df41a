"""Layer building blocks: RMSNorm, rotary embeddings, SwiGLU and grouped-query attention (masks: `masks`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.model import masks, quant
from clover_jax.model.params import AttentionWeights, MLPWeights

Array = jax.Array

NEG_INF = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN
AUTO_SCORES = 8  # `auto` chunks a narrow window whose dense scores would be over this many chunk x chunk squares a row


def chunks_attention(impl: str, rows: int, tq: int, tk: int, chunk: int) -> bool:
    """Whether `attend` takes the chunked form for `rows` x `tq` queries against `tk` keys: "chunked" always,
    "dense" never, "auto" when the keys are longer than one chunk and either the queries are too (a long prompt's
    prefill) or the dense scores of all rows would cover more than AUTO_SCORES chunk x chunk squares (a prefill
    window narrowed by a batch's rows against a long cache: 8 rows x 512 columns x 32K keys). A block pass (32-64
    queries) stays dense up to 128K keys at one row."""
    if impl not in ("auto", "splash"):  # "splash": as "auto" for the windows splash attention does not take
        return impl == "chunked"
    return tk > chunk and (tq > chunk or rows * tq * tk > AUTO_SCORES * chunk * chunk)


def _normalized(x: Array, eps: float) -> Array:
    """x / rms(x) over the last axis, in float32."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: Array, weight: Array, eps: float, unit_offset: bool = False) -> Array:
    """RMSNorm over the last axis, in float32.

    Plain: normalised, cast back to x's dtype, then scaled by `weight` (transformers' Llama/Qwen3 order).
    unit_offset: scaled by (1 + weight) in float32, then cast (Qwen3.5's zero-initialised norm).
    """
    xf = _normalized(x, eps)
    if unit_offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return (weight * xf.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def norm(x: Array, weight: Array, cfg: ModelConfig) -> Array:
    """The config's RMSNorm (eps, plain or unit-offset) of x with `weight`."""
    return rms_norm(x, weight, cfg.norm_eps, cfg.norm_unit_offset)


def rms_norm_gated(x: Array, gate: Array, weight: Array, eps: float) -> Array:
    """Gated RMSNorm of the Gated DeltaNet output: weight * norm(x) * silu(gate), norm before gate."""
    y = weight * _normalized(x, eps).astype(x.dtype).astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def rope(x: Array, positions: Array, theta: float, rotary_dim: int) -> Array:
    """Rotate-half RoPE on the first `rotary_dim` dims of each head; the rest pass through.

    x: [B, T, heads, head_dim]; positions: [B, T] integer.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rot/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xr, xp = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = (xr * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1) if xp.shape[-1] else out


def swiglu(x: Array, w: MLPWeights) -> Array:
    """SwiGLU MLP: x [..., D] -> [..., D], `down(silu(x @ gate) * (x @ up))`."""
    return quant.matmul(jax.nn.silu(quant.matmul(x, w.gate)) * quant.matmul(x, w.up), w.down)


def project_qkv(x: Array, w: AttentionWeights, positions: Array, cfg: ModelConfig) -> tuple[Array, Array, Array]:
    """q [B,T,H,hd], k/v [B,T,K,hd]: QK-norm over head_dim after the projection, then RoPE."""
    q = quant.einsum("btd,dhk->bthk", x, w.q)
    k = quant.einsum("btd,dhk->bthk", x, w.k)
    v = quant.einsum("btd,dhk->bthk", x, w.v)
    if cfg.qk_norm:
        q = norm(q, w.q_norm, cfg)
        k = norm(k, w.k_norm, cfg)
    q = rope(q, positions, cfg.rope_theta, cfg.rotary_dim)
    k = rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    return q, k, v


def attend(q: Array, k: Array, v: Array, mask: Array | masks.BlockMask, impl: str = "dense", chunk: int = 1024
           ) -> Array:
    """Grouped-query attention. q [B,Tq,H,hd], k/v [B,Tk,K,hd], mask [B,Tq,Tk] (an array, or a `masks.BlockMask`
    built where it is read) -> [B,Tq,H,hd].

    Scores and softmax in float32. KV heads are never repeated: the H/K query heads that share a KV
    head are stacked along the query axis, so each (row, KV head) is one [H/K*Tq, hd] x [hd, Tk]
    matmul (about 1.5x faster on CPU than a [H/K, Tq] pair of free dims). `impl` (ModelConfig.attention_impl):
    "dense" holds the [B, H, Tq, Tk] scores at once; "chunked" (`attend_chunked`) never more than
    [B, H, chunk, chunk]; "auto" as `chunks_attention` decides. A query that may see no key averages every
    value, in both forms.
    """
    if chunks_attention(impl, q.shape[0], q.shape[1], k.shape[1], chunk):
        return attend_chunked(q, k, v, mask, chunk)
    probs = jax.nn.softmax(_dense_scores(q, k, mask), axis=-1).astype(v.dtype)
    return _ungrouped(jnp.einsum("bkqs,bskd->bkqd", probs, v), q.shape[1])


def _dense_scores(q: Array, k: Array, mask: Array | masks.BlockMask) -> Array:
    """The dense form's masked float32 scores [B, K, H/K * Tq, Tk] (queries grouped by KV head, `_grouped`)."""
    if isinstance(mask, masks.BlockMask):
        mask = mask.full()
    b, tq, h, hd = q.shape
    kv = k.shape[2]
    scores = jnp.einsum("bkqd,bskd->bkqs", _grouped(q, kv), k, preferred_element_type=jnp.float32) * (hd**-0.5)
    scores = jnp.where(mask[:, None, None], scores.reshape(b, kv, h // kv, tq, -1), NEG_INF)
    return scores.reshape(b, kv, h // kv * tq, -1)


def _grouped(q: Array, kv: int) -> Array:
    """q [B, Tq, H, hd] -> [B, K, H/K * Tq, hd]: the query heads that share a KV head stacked along the queries."""
    b, tq, h, hd = q.shape
    return q.reshape(b, tq, kv, h // kv, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, h // kv * tq, hd)


def _ungrouped(x: Array, tq: int) -> Array:
    """[B, K, H/K * Tq, ...] -> [B, Tq, H, ...] (`_grouped`'s inverse; a trailing axis or none)."""
    b, kv, gq = x.shape[:3]
    g = gq // tq
    x = x.reshape(b, kv, g, tq, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1).reshape(b, tq, kv * g, *x.shape[4:])


def attend_with_lse(q: Array, k: Array, v: Array, mask: Array | masks.BlockMask, impl: str = "dense",
                    chunk: int = 1024) -> tuple[Array, Array]:
    """`attend`, and the log-sum-exp of each query's scores [B, Tq, H] float32 (a query that sees no key: about
    NEG_INF, so a merge gives it no weight): what `attend_split` merges. Dense or chunked as `attend` chooses;
    the output is float32."""
    if chunks_attention(impl, q.shape[0], q.shape[1], k.shape[1], chunk):
        return attend_chunked(q, k, v, mask, chunk, with_lse=True)
    scores = _dense_scores(q, k, mask)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # as `attend` does
    out = jnp.einsum("bkqs,bskd->bkqd", probs, v, preferred_element_type=jnp.float32)
    tq = q.shape[1]
    return _ungrouped(out, tq), _ungrouped(jax.nn.logsumexp(scores, axis=-1), tq)


def merge_lse(parts: list[tuple[Array, Array]]) -> tuple[Array, Array]:
    """One softmax from its parts over disjoint key sets: each (output [..., hd] float32, log-sum-exp [...]) ->
    (the output over all their keys, its log-sum-exp). A part whose queries saw no key (log-sum-exp about NEG_INF
    or below) weighs nothing beside one that saw some."""
    top = jnp.max(jnp.stack([lse for _, lse in parts]), axis=0)
    weights = [jnp.exp(lse - top) for _, lse in parts]
    total = sum(weights)
    out = sum(o * w[..., None] for (o, _), w in zip(parts, weights, strict=True)) / total[..., None]
    return out, top + jnp.log(total)


def attend_split(q: Array, parts: tuple[tuple[Array, Array, Array | masks.BlockMask], ...], impl: str = "dense",
                 chunk: int = 1024) -> Array:
    """`attend` over the union of several key sets, each (k, v, mask), as one softmax: each part's output and
    log-sum-exp (`attend_with_lse`), merged (`merge_lse`). Equal to `attend` over the keys side by side up to
    rounding,
    without putting them side by side: a refinement pass attends to the cache and to its block's own K/V without
    writing them into the cache (`transformer._layer`). -> [B, Tq, H, hd] in q's dtype."""
    out, _ = merge_lse([attend_with_lse(q, k, v, m, impl, chunk) for k, v, m in parts])
    return out.astype(q.dtype)


def attend_chunked(q: Array, k: Array, v: Array, mask: Array | masks.BlockMask, chunk: int, with_lse: bool = False
                   ) -> Array | tuple[Array, Array]:
    """`attend` by query chunks (one after another) and, within each, key chunks with an online softmax (a
    running max, denominator and weighted sum per query, rescaled as each key chunk arrives): the scores held at
    once are [B, H, chunk, chunk], whatever Tq and Tk, and the chunks are read in place (q, k, v and the mask are
    never copied whole; a `masks.BlockMask` is built one chunk at a time). Equal to the dense form up to float32
    rounding. A length that is not a whole number of chunks ends with a chunk shifted back to fit: its keys
    already counted weigh exactly nothing (scored below any masked key), its queries already computed are
    written again with the same values. `with_lse`: (the output in float32, each query's log-sum-exp [B, Tq, H]), as
    `attend_with_lse`."""
    b, tq, h, hd = q.shape
    tk, kv = k.shape[1], k.shape[2]
    g = h // kv
    cq, ck = min(chunk, tq), min(chunk, tk)
    nq, nk = -(-tq // cq), -(-tk // ck)
    scale = hd**-0.5
    lazy = isinstance(mask, masks.BlockMask)

    def one_query_chunk(i: Array, out: Array) -> Array:
        q0 = jnp.minimum(i * cq, tq - cq)
        qc = jax.lax.dynamic_slice_in_dim(q, q0, cq, axis=1)
        qc = _grouped(qc, kv)
        mq = mask.rows(q0, cq) if lazy else jax.lax.dynamic_slice_in_dim(mask, q0, cq, axis=1)

        def one_key_chunk(carry: tuple[Array, Array, Array], j: Array) -> tuple:
            m, denom, acc = carry
            k0 = jnp.minimum(j * ck, tk - ck)
            kc = jax.lax.dynamic_slice_in_dim(k, k0, ck, axis=1)
            vc = jax.lax.dynamic_slice_in_dim(v, k0, ck, axis=1)
            mk = mq.cols(k0, ck).full() if lazy else jax.lax.dynamic_slice_in_dim(mq, k0, ck, axis=2)
            new = k0 + jnp.arange(ck) >= j * ck  # not counted by an earlier chunk
            s = jnp.einsum("bkqd,bskd->bkqs", qc, kc, preferred_element_type=jnp.float32) * scale
            s = jnp.where(mk[:, None, None], s.reshape(b, kv, g, cq, ck), NEG_INF)
            s = jnp.where(new, s, 2 * NEG_INF).reshape(b, kv, g * cq, ck)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            fix = jnp.exp(m - m_new)
            pv = jnp.einsum("bkqs,bskd->bkqd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
            return (m_new, denom * fix + p.sum(-1), acc * fix[..., None] + pv), None

        init = (jnp.full((b, kv, g * cq), -jnp.inf, jnp.float32), jnp.zeros((b, kv, g * cq), jnp.float32),
                jnp.zeros((b, kv, g * cq, hd), jnp.float32))
        (m, denom, acc), _ = jax.lax.scan(one_key_chunk, init, jnp.arange(nk))
        oc = _ungrouped((acc / denom[..., None]).astype(out[0].dtype if with_lse else out.dtype), cq)
        if not with_lse:
            return jax.lax.dynamic_update_slice_in_dim(out, oc, q0, axis=1)
        lse = _ungrouped(m + jnp.log(denom), cq)
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, x, q0, axis=1) for a, x in zip(out, (oc, lse), strict=True))

    if with_lse:
        init = (jnp.zeros((b, tq, h, hd), jnp.float32), jnp.zeros((b, tq, h), jnp.float32))
        return jax.lax.fori_loop(0, nq, one_query_chunk, init)
    return jax.lax.fori_loop(0, nq, one_query_chunk, jnp.zeros((b, tq, h, hd), v.dtype))


def output_projection(x: Array, attn: Array, w: AttentionWeights, cfg: ModelConfig) -> Array:
    """Attention output attn [B,T,H,hd] -> [B,T,D] through `w.o`, first gated per head by
    sigmoid(x @ w.gate) when `cfg.attn_output_gate` (x [B,T,D]: the normed layer input)."""
    if cfg.attn_output_gate:
        attn = attn * jax.nn.sigmoid(quant.einsum("btd,dhk->bthk", x, w.gate))
    return quant.einsum("bthk,hkd->btd", attn, w.o)
