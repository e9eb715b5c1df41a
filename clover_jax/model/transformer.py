"""The forward pass: a pure function of (weights, tokens, positions, mask, cache) -> logits.

Shapes: a call processes a window of W query tokens [B, W]. Without a cache the keys are the same
W tokens. With a cache of S columns the window's K/V are first written into the cache at column
`cache_offset`, then the window attends to all S cached columns through `mask` [B, W, S]. This one
mechanism covers full passes, prompt prefill, block-by-block decoding and cache refreshes.

Hybrid configs (Gated DeltaNet + full attention, `cfg.layer_types`) run as one `lax.scan` over the
repeating group of layers (`cfg.layer_group`, e.g. 3 Gated DeltaNet layers then 1 attention layer), the
group's layers unrolled in its body, so compile time does not grow with depth. Their Gated DeltaNet
layers are causal, or, with Clover's block-diffusion reading (`cfg.is_bd_gdn`), bidirectional inside a
block and causal across blocks (`gated_deltanet.mixer`). With a cache, the attention layers write the
window's K/V at `cache_offset` as above, and each Gated DeltaNet layer starts from the state in the cache
(what every column before the window left) and writes back the state after the window's first `commit`
columns (all by default): a window run twice with commit=None advances the state twice.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from clover_jax.mesh.rules import MeshRules, constrain
from clover_jax.model import gated_deltanet, layers, masks, quant, splash
from clover_jax.model.cache import KVCache
from clover_jax.model.moe import MoEStats, moe_block, takes_layer_stack
from clover_jax.model.moe.routing import Coreset
from clover_jax.model.params import LayerWeights, Weights

Array = jax.Array


class ForwardOut(NamedTuple):
    """What `forward` returns."""

    logits: Array  # [B, W_out, V] float32
    cache: KVCache | None
    moe_stats: MoEStats | None  # stacked over MoE layers


def _layer(
    x: Array, w: LayerWeights, positions: Array, mask: Array, kv: tuple[Array, Array, Array] | None,
    cache_offset: Array, cfg: ModelConfig, is_moe: bool, dispatch: str | None, mesh: MeshRules | None,
    layer: Array | None = None, coreset: Coreset | None = None, refining: bool = False,
) -> tuple[Array, tuple[Array, Array] | None, MoEStats | None]:
    """One decoder layer. kv: (the stack's whole K cache, V cache, this layer's index) or None. `refining`: a
    refinement pass (`gated_deltanet.refines`) whose window's K/V nothing reads after it: they are not written into
    the cache; the window attends to the cache without its own columns and to its own K/V, as one softmax
    (`layers.attend_split`; only with a `masks.BlockMask`: an array mask is written and read as before). Where that
    pass is a branch of the sampler's cond, a write would make the compiler copy the whole K/V stack (2 x 1.4 GB a
    chip for 32 rows of Clover-35B at 4K)."""
    h = layers.norm(x, w.attn_norm, cfg)
    q, k, v = layers.project_qkv(h, w.attn, positions, cfg)
    if kv is not None and refining and isinstance(mask, masks.BlockMask):
        k_all, v_all, i = kv
        width = q.shape[1]
        col = jnp.arange(mask.k_valid.shape[1])[None]
        elsewhere = (col < cache_offset) | (col >= cache_offset + width)
        cached = masks.BlockMask(mask.q_valid, mask.q_block, mask.k_valid & elsewhere, mask.k_block, mask.block_causal)
        as_cached = lambda a, c: a.astype(c.dtype).astype(q.dtype)  # the values a write and a read would give
        own = (as_cached(k, k_all), as_cached(v, v_all), mask.cols(cache_offset, width))
        attn = layers.attend_split(q, ((k_all[i].astype(q.dtype), v_all[i].astype(q.dtype), cached), own),
                                   cfg.attention_impl, cfg.attention_chunk)
        x = x + layers.output_projection(h, attn, w.attn, cfg)
        return _mlp(x, w, cfg, is_moe, dispatch, layer, mesh, coreset, (k_all, v_all))
    if kv is not None:
        # Write only this window into the stack-wide cache (in place in the scan carry), then read
        # this layer's columns back for attention.
        k_all, v_all, i = kv
        at = (i, 0, cache_offset, 0, 0)
        k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), at)
        v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), at)
        fresh = (k.astype(k_all.dtype), v.astype(v_all.dtype))  # the window's K/V as the cache holds them
        k, v = k_all[i], v_all[i]
        kv = (k_all, v_all)
    if isinstance(mask, masks.BlockMask) and splash.applies(cfg.attention_impl, mask.causal, q.shape, k.shape[2], mesh):
        own_k, own_v = fresh if kv is not None else (k, v)
        cache = (k.astype(q.dtype), v.astype(q.dtype), mask.k_valid, cache_offset) if kv is not None else None
        attn = splash.causal_attention(q, own_k.astype(q.dtype), own_v.astype(q.dtype), mask.q_valid, cache, mesh)
    else:
        attn = layers.attend(q, k.astype(q.dtype), v.astype(q.dtype), mask, cfg.attention_impl, cfg.attention_chunk)
    x = x + layers.output_projection(h, attn, w.attn, cfg)
    return _mlp(x, w, cfg, is_moe, dispatch, layer, mesh, coreset, kv)


def _mlp(x: Array, w: LayerWeights, cfg: ModelConfig, is_moe: bool, dispatch: str | None, layer: Array | None,
         mesh: MeshRules | None, coreset: Coreset | None, kv: tuple[Array, Array] | None
         ) -> tuple[Array, tuple[Array, Array] | None, MoEStats | None]:
    """The rest of `_layer` after attention's residual: the MLP (MoE or dense) and its residual."""
    x = constrain(x, ("batch", "seq", "embed"), mesh)
    h = layers.norm(x, w.mlp_norm, cfg)
    if is_moe:
        y, st = moe_block(h, w.mlp, cfg, dispatch, layer, mesh, coreset)
    else:
        y, st = layers.swiglu(h, w.mlp), None
    return constrain(x + y, ("batch", "seq", "embed"), mesh), kv, st


def _run_stack(
    x: Array, stack: LayerWeights, k: Array | None, v: Array | None, positions: Array, mask: Array,
    cache_offset: Array, cfg: ModelConfig, is_moe: bool, dispatch: str | None, remat: bool, mesh: MeshRules | None,
) -> tuple[Array, Array | None, Array | None, MoEStats | None]:
    # Scanning over the stacked expert weights copies each layer's experts out of the stack (on CPU
    # that copy costs as much as the expert matmuls), so dispatches that can index [layer, expert]
    # themselves get the stack and a layer index. Not under remat: there the scan's per-layer
    # slices keep weight gradients per layer.
    experts = None
    if is_moe and not remat and takes_layer_stack(dispatch or cfg.moe_dispatch):
        experts = stack.mlp
        stack = stack.replace(mlp=stack.mlp.replace(gate=None, up=None, down=None))
    n_layers = stack.attn_norm.shape[0]

    # The cache rides in the scan carry (not xs -> ys), so a pass writes only its window of it
    # instead of producing a whole new cache.
    def body(carry: tuple, per_layer: tuple) -> tuple[tuple, MoEStats | None]:
        x, ck, cv = carry
        w, i = per_layer
        if experts is not None:
            w = w.replace(mlp=w.mlp.replace(gate=experts.gate, up=experts.up, down=experts.down))
        kv = None if ck is None else (ck, cv, i)
        x, kv, st = _layer(x, w, positions, mask, kv, cache_offset, cfg, is_moe, dispatch, mesh,
                           None if experts is None else i)
        return (x, *(kv if kv is not None else (None, None))), st

    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    (x, k, v), st = jax.lax.scan(body, (x, k, v), (stack, jnp.arange(n_layers, dtype=jnp.int32)))
    return x, k, v, st


class Windows(NamedTuple):
    """What Gated DeltaNet layers need to know about a window besides its tokens (see `forward`)."""

    valid: Array | None
    blocks: Array
    commit: Array | int | None
    two_stream: bool


def block_coreset(win: Windows, shape: tuple[int, int]) -> Coreset | None:
    """The rows of the window [B, T] that are blocks being denoised, for the MoE's block expert coreset: the
    columns after the first `commit` (the noisy stream's, in two-stream training), grouped by block id; None when
    the window has none (a clean pass)."""
    b, t = shape
    col = jnp.arange(t)[None]
    valid = jnp.ones(shape, bool) if win.valid is None else jnp.asarray(win.valid, bool)
    if win.two_stream:
        noisy = valid & (col < t // 2)
    elif win.commit is None:
        return None
    else:
        noisy = valid & (col >= win.commit)
    ids = jnp.broadcast_to(win.blocks, shape)
    new = (col == 0) | (ids != jnp.pad(ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1))
    start = jax.lax.cummax(jnp.where(new, col, 0), axis=1)  # the first column of each column's block
    segment = (jnp.arange(b)[:, None] * t + start).reshape(-1)
    return Coreset(noisy.reshape(-1), segment.astype(jnp.int32))


def _linear_layer(x: Array, w: LayerWeights, win: Windows, state: gated_deltanet.MixerState | None,
                  cfg: ModelConfig, dispatch: str | None, mesh: MeshRules | None, layer: Array | None = None,
                  coreset: Coreset | None = None) -> tuple[Array, gated_deltanet.MixerState, MoEStats]:
    """One Gated DeltaNet layer with its MoE, from `state` (None: the start of the sequence); returns the
    state after the window. layer: as in `_layer` (expert weights still stacked, `layer` picks this one's)."""
    h = layers.norm(x, w.attn_norm, cfg)
    y, state = gated_deltanet.mixer(h, w.attn, cfg, win.valid, state, win.blocks, win.commit, win.two_stream)
    x = constrain(x + y, ("batch", "seq", "embed"), mesh)
    h = layers.norm(x, w.mlp_norm, cfg)
    y, st = moe_block(h, w.mlp, cfg, dispatch, layer, mesh, coreset)
    return constrain(x + y, ("batch", "seq", "embed"), mesh), state, st


def _runs(group: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """The runs of same-kind layers in a layer group: (kind, index of the run's first layer among that
    kind's layers in the group, run length), in layer order."""
    out: list[tuple[str, int, int]] = []
    seen = {LINEAR_ATTENTION: 0, FULL_ATTENTION: 0}
    for kind in group:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1], out[-1][2] + 1)
        else:
            out.append((kind, seen[kind], 1))
        seen[kind] += 1
    return out


def _run_hybrid(x: Array, weights: Weights, positions: Array, mask: Array, win: Windows,
                cache: KVCache | None, cache_offset: Array, cfg: ModelConfig, dispatch: str | None, remat: bool,
                mesh: MeshRules | None) -> tuple[Array, KVCache | None, MoEStats]:
    """Every layer of a hybrid config: a scan over the groups of `cfg.layer_group`; the cache (K/V and the
    Gated DeltaNet states) rides in the carry; MoE statistics stacked over all layers in layer order."""
    group = cfg.layer_group
    n_groups = cfg.n_layers // len(group)
    n_lin = group.count(LINEAR_ATTENTION)
    n_full = len(group) - n_lin
    # As in `_run_stack`: dispatches that index [layer, expert] themselves get the expert weights still
    # stacked (not sliced per layer by the scan, a copy on CPU) and a layer index.
    stacked = not remat and takes_layer_stack(dispatch or cfg.moe_dispatch)
    experts = {LINEAR_ATTENTION: weights.linear_layers.mlp, FULL_ATTENTION: weights.moe_layers.mlp}
    coreset = block_coreset(win, x.shape[:2]) if cfg.moe_block_coreset else None
    # A refinement pass leaves every Gated DeltaNet state and conv tail as it found them, so it does not write them
    # back: a write of the same values would still make the compiler copy the whole stack of states (2 GB per chip
    # for 32 rows of Clover-35B) where the pass's cache is a branch of a cond.
    refining = gated_deltanet.refines(win.commit)

    def per_group(stack: LayerWeights, n: int) -> LayerWeights:
        if stacked:
            stack = stack.replace(mlp=stack.mlp.replace(gate=None, up=None, down=None))
        return jax.tree.map(lambda a: a.reshape(n_groups, n, *a.shape[1:]), stack)

    def one_layer(kind: str, x: Array, c: KVCache | None, w: LayerWeights, index: Array
                  ) -> tuple[Array, KVCache | None, MoEStats]:
        layer = None
        if stacked:
            e = experts[kind]
            w = w.replace(mlp=w.mlp.replace(gate=e.gate, up=e.up, down=e.down))
            layer = index
        if kind == LINEAR_ATTENTION:
            state = None if c is None else jax.tree.map(lambda a: a[index], c.linear)
            x, state, st = _linear_layer(x, w, win, state, cfg, dispatch, mesh, layer, coreset)
            if c is not None and not refining:
                c = c.replace(linear=jax.tree.map(lambda a, s: a.at[index].set(s.astype(a.dtype)), c.linear, state))
            return x, c, st
        kv = None if c is None else (c.moe_k, c.moe_v, index)
        x, kv, st = _layer(x, w, positions, mask, kv, cache_offset, cfg, True, dispatch, mesh, layer, coreset,
                           refining)
        if c is not None:
            c = c.replace(moe_k=kv[0], moe_v=kv[1])
        return x, c, st

    def body(carry: tuple, ws: tuple) -> tuple[tuple, MoEStats]:
        # A run of same-kind layers in the group (Qwen3.5's three Gated DeltaNet layers) is an inner
        # scan: one copy of the layer in the program, not one per layer (a smaller program compiles
        # and loads from the compile cache faster; the arithmetic is the same).
        x, c = carry
        wl, wf, g = ws
        stats = []
        for kind, first, n in _runs(group):
            stack = wl if kind == LINEAR_ATTENTION else wf
            base = g * (n_lin if kind == LINEAR_ATTENTION else n_full) + first  # in its own stack
            run = jax.tree.map(lambda a, f=first, n=n: a[f:f + n], stack)
            if n == 1:
                x, c, st = one_layer(kind, x, c, jax.tree.map(lambda a: a[0], run), base)
                stats.append(jax.tree.map(lambda a: a[None], st))
                continue

            def inner(carry: tuple, xs: tuple, kind: str = kind) -> tuple[tuple, MoEStats]:
                x, c, st = one_layer(kind, *carry, *xs)
                return (x, c), st

            (x, c), st = jax.lax.scan(inner, (x, c), (run, base + jnp.arange(n, dtype=jnp.int32)))
            stats.append(st)
        return (x, c), jax.tree.map(lambda *a: jnp.concatenate(a), *stats)

    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    xs = (per_group(weights.linear_layers, n_lin), per_group(weights.moe_layers, n_full),
          jnp.arange(n_groups, dtype=jnp.int32))
    (x, cache), st = jax.lax.scan(body, (x, cache), xs)
    return x, cache, jax.tree.map(lambda a: a.reshape(cfg.n_layers, *a.shape[2:]), st)


def forward(
    weights: Weights,
    cfg: ModelConfig,
    tokens: Array,
    positions: Array | None = None,
    mask: Array | None = None,
    cache: KVCache | None = None,
    cache_offset: Array | int = 0,
    *,
    logits_start: Array | int = 0,
    logits_len: int | None = None,
    dispatch: str | None = None,
    remat: bool = False,
    mesh: MeshRules | None = None,
    valid: Array | None = None,
    blocks: Array | None = None,
    commit: Array | int | None = None,
    two_stream: bool = False,
) -> ForwardOut:
    """Logits for `tokens` [B, W]; `forward(weights, cfg, tokens).logits` for an unpadded batch.

    positions: [B, W] rotary positions (default: counted over the real columns of `valid`, 0..W-1 when
    `valid` is None). mask: [B, W, S] bool or a `masks.BlockMask` (S = W without a cache, else the cache length;
    default `masks.clean_mask` of `valid`, or of an unpadded batch; a default needs no cache). So
    `forward(weights, cfg, tokens, valid=valid)` is the padded batch's answer, left padding included.
    logits_start / logits_len: compute the LM head only for that window of the W positions.
    dispatch: the MoE dispatch strategy (default the config's). mesh: shard activations and the
    expert-parallel dispatch on this mesh (None: one device, no constraints).
    valid: [B, W] the window's real (non-padding) columns, which Gated DeltaNet layers need (None: all
    real); attention layers read padding from `mask`.
    Gated DeltaNet layers (attention layers read all of this from `mask`): blocks [B, W] the window's
    block ids (default positions // block_size); commit: with a cache, the Gated DeltaNet state written
    back is the one after the first `commit` columns of the window (None: all; the Python int 0 for a refinement
    pass over a block that is not final yet, which in a hybrid also leaves the attention K/V unwritten when `mask`
    is a `masks.BlockMask`: the window's columns of the returned cache then hold what they held, see `_layer`);
    two_stream: tokens are block-diffusion training's (noisy, clean) halves, whose noisy blocks read the clean
    prefix (`gated_deltanet.mixer`).
    """
    if mask is None or positions is None:
        if cache is not None:
            raise ValueError("forward with a cache needs explicit positions and mask")
        real = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
        positions = masks.positions(real) if positions is None else positions
        mask = masks.clean_mask(cfg, real) if mask is None else mask
    x = weights.embed[tokens].astype(jnp.dtype(cfg.dtype))
    x = constrain(x, ("batch", "seq", "embed"), mesh)
    offset = jnp.asarray(cache_offset, jnp.int32)
    new_cache = None
    dense_k = dense_v = moe_k = moe_v = None
    st = None
    if cfg.is_hybrid:
        win = Windows(valid, positions // cfg.block_size if blocks is None else blocks, commit, two_stream)
        x, new_cache, st = _run_hybrid(x, weights, positions, mask, win, cache, offset, cfg, dispatch, remat, mesh)
    if weights.dense_layers is not None:  # (never in a hybrid config)
        x, dense_k, dense_v, _ = _run_stack(
            x, weights.dense_layers, None if cache is None else cache.dense_k,
            None if cache is None else cache.dense_v, positions, mask, offset, cfg, False, dispatch, remat, mesh)
    if weights.moe_layers is not None and not cfg.is_hybrid:
        x, moe_k, moe_v, st = _run_stack(
            x, weights.moe_layers, None if cache is None else cache.moe_k,
            None if cache is None else cache.moe_v, positions, mask, offset, cfg, True, dispatch, remat, mesh)
    if cache is not None and not cfg.is_hybrid:
        new_cache = KVCache(dense_k, dense_v, moe_k, moe_v)
    if logits_len is not None:
        x = jax.lax.dynamic_slice_in_dim(x, jnp.asarray(logits_start, jnp.int32), logits_len, axis=1)
    x = layers.norm(x, weights.final_norm, cfg)
    head = weights.embed.T if weights.lm_head is None else weights.lm_head
    logits = quant.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    return ForwardOut(logits, new_cache, st)


def apply(weights: Weights, cfg: ModelConfig, tokens: Array, valid: Array | None = None,
          dispatch: str | None = None, mesh: MeshRules | None = None) -> Array:
    """Logits [B, T, V] for whole sequences [B, T] (left or right padding marked by `valid`)."""
    if valid is None:
        valid = jnp.ones(tokens.shape, bool)
    return forward(weights, cfg, tokens, masks.positions(valid), masks.clean_mask(cfg, valid), dispatch=dispatch,
                   mesh=mesh, valid=valid).logits
