"""Mixture-of-experts layer: routing and interchangeable dispatch strategies.

Routing is always float32. A dispatch strategy takes the routed token copies and returns the
weighted sum of expert outputs per token; every strategy computes the same function (the `dense`
one is the test oracle), they differ only in how the work is laid out:

- `dense`:  every expert on every token, weighted by the (mostly zero) routing weights.
- `ragged`: sort token copies by expert, `jax.lax.ragged_dot` grouped matmuls, unsort.
- `tiled`:  sort token copies by expert; walk each expert's contiguous group in tiles (heights
            128, 64, ..., 8: dynamic trip count, then the remainder's binary expansion), multiplying
            each tile by that expert's weights. Dropless, slices each active expert's matrices once
            per pass (never per tile, never a whole layer; experts with no rows are skipped), pads
            at most 7 rows per expert, and takes the expert weights still stacked over layers, so
            it is the fast path where `ragged_dot` has no real kernel (the CPU). In float32 on CPU
            the forward walk is the native kernel of `clover_jax.native` instead (same function:
            each group through a register-blocked GEMM on XLA's threads, weights read in place),
            where it builds. Differentiable: a custom VJP runs the tiled walk backwards.
Expert-parallel strategies (`ep_*`, under `shard_map`) register themselves from `expert_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax import native
from clover_jax.config import ModelConfig
from clover_jax.layers import swiglu
from clover_jax.params import MoEWeights

Array = jax.Array


class Routing(NamedTuple):
    experts: Array  # [N, k] int32 chosen experts
    weights: Array  # [N, k] float32 combine weights
    logits: Array  # [N, E] float32 router logits (z-loss)
    probs: Array  # [N, E] float32 router scores (load-balancing loss)


class MoEStats(NamedTuple):
    """Per-layer statistics for load balancing and monitoring."""

    load: Array  # [E] fraction of routed token copies each expert received
    importance: Array  # [E] mean router probability per expert
    z_loss: Array  # [] mean squared logsumexp of router logits
    dropped: Array  # [] token copies dropped by capacity-limited strategies (0 when dropless)


def route(x: Array, w: MoEWeights, cfg: ModelConfig) -> Routing:
    """Top-k routing for tokens x [N, D]."""
    logits = x.astype(jnp.float32) @ w.router.astype(jnp.float32)
    k = cfg.n_experts_per_tok
    if cfg.router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        # LLaDA-MoE adds its optional bias to the probabilities and keeps it in the weights.
        top_w, top_e = jax.lax.top_k(probs + w.expert_bias if w.expert_bias is not None else probs, k)
    else:
        # LLaDA2 / DeepSeek-V3: select on sigmoid + bias inside the best groups, weight by unbiased sigmoid.
        probs = jax.nn.sigmoid(logits)
        choice = probs + w.expert_bias if w.expert_bias is not None else probs
        if cfg.n_expert_groups > 1:
            n, g = choice.shape[0], cfg.n_expert_groups
            grouped = choice.reshape(n, g, -1)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
            _, top_groups = jax.lax.top_k(group_score, cfg.topk_groups)
            keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, -1)
        _, top_e = jax.lax.top_k(choice, k)
        top_w = jnp.take_along_axis(probs, top_e, axis=-1)
    if cfg.norm_topk_prob:
        top_w = top_w / (top_w.sum(-1, keepdims=True) + (1e-20 if cfg.router == "sigmoid" else 0.0))
    top_w = top_w * cfg.routed_scaling_factor
    return Routing(top_e.astype(jnp.int32), top_w, logits, probs)


def stats(r: Routing, n_experts: int, dropped: Array | None = None) -> MoEStats:
    counts = jnp.zeros((n_experts,), jnp.float32).at[r.experts.reshape(-1)].add(1.0)
    return MoEStats(
        load=counts / r.experts.size,
        importance=r.probs.mean(0),
        z_loss=jnp.mean(jax.nn.logsumexp(r.logits, axis=-1) ** 2),
        dropped=jnp.zeros((), jnp.float32) if dropped is None else dropped.astype(jnp.float32),
    )


# ---- dispatch strategies ----------------------------------------------------------------------
# Signature: (x [N, D], routing, weights, cfg) -> (y [N, D], dropped token copies [])

Dispatch = Callable[[Array, Routing, MoEWeights, ModelConfig], tuple[Array, Array]]
DISPATCH: dict[str, Dispatch] = {}


def register(name: str) -> Callable[[Dispatch], Dispatch]:
    def deco(fn: Dispatch) -> Dispatch:
        DISPATCH[name] = fn
        return fn

    return deco


def _no_drops() -> Array:
    return jnp.zeros((), jnp.int32)


@register("dense")
def dispatch_dense(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig) -> tuple[Array, Array]:
    combine = jnp.zeros((x.shape[0], cfg.n_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], r.experts].add(r.weights)
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, w.gate)) * jnp.einsum("nd,edf->enf", x, w.up)
    y = jnp.einsum("enf,efd->end", h, w.down)
    out = jnp.einsum("end,ne->nd", y.astype(jnp.float32), combine)
    return out.astype(x.dtype), _no_drops()


class SortedCopies(NamedTuple):
    rows: Array  # [N*k, D] token copies ordered by expert
    position: Array  # [N*k] row of each flattened (token, slot) copy in `rows`
    group_sizes: Array  # [E] int32 copies per expert
    group_starts: Array  # [E] int32 first row of each expert's group


COUNTING_SORT_MAX = 1 << 22  # one-hot entries (16 MB of int32) up to which the sort is a running count


def expert_positions(flat_e: Array, n_experts: int) -> tuple[Array, Array]:
    """Row of each copy once copies are grouped by expert (copy order kept inside a group), and the
    copies per expert.

    A row is its expert's start plus the copy's rank among that expert's copies. For small inputs
    the rank is a running count over a one-hot [N*k, E] (on CPU ~1.5x faster than an argsort at
    6144 copies x 32 experts); past COUNTING_SORT_MAX entries that one-hot would cost real memory
    (256 experts, top-8: 8 KB per token), so the rows come from a stable argsort instead.
    """
    m = flat_e.shape[0]
    if m * n_experts <= COUNTING_SORT_MAX:
        counts = jnp.cumsum(flat_e[:, None] == jnp.arange(n_experts, dtype=flat_e.dtype), axis=0, dtype=jnp.int32)
        sizes = counts[-1]
        rank = jnp.take_along_axis(counts, flat_e[:, None], axis=1)[:, 0] - 1
        return (jnp.cumsum(sizes) - sizes)[flat_e] + rank, sizes
    order = jnp.argsort(flat_e, stable=True)
    sizes = jnp.zeros((n_experts,), jnp.int32).at[flat_e].add(1)
    return jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32)), sizes


def sort_by_expert(x: Array, r: Routing, n_experts: int) -> SortedCopies:
    """Token copies grouped by expert, in copy order inside a group; undoing it is a gather at `position`."""
    n, k = r.experts.shape
    position, sizes = expert_positions(r.experts.reshape(-1), n_experts)
    token_of_row = jnp.zeros((n * k,), jnp.int32).at[position].set(jnp.arange(n * k, dtype=jnp.int32) // k)
    return SortedCopies(x[token_of_row], position, sizes, jnp.cumsum(sizes) - sizes)


def combine_sorted(y_sorted: Array, s: SortedCopies, r: Routing, dtype: jnp.dtype) -> Array:
    """Undo the sort (a gather of each copy's row) and sum each token's k outputs with its routing weights."""
    n, k = r.experts.shape
    y = y_sorted[s.position].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), r.weights).astype(dtype)


@register("ragged")
def dispatch_ragged(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig) -> tuple[Array, Array]:
    s = sort_by_expert(x, r, cfg.n_experts)
    g = jax.lax.ragged_dot(s.rows, w.gate, s.group_sizes)
    u = jax.lax.ragged_dot(s.rows, w.up, s.group_sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, w.down, s.group_sizes)
    return combine_sorted(y, s, r, x.dtype), _no_drops()


MIN_TILE = 8  # smallest tile height: a group's last < 8 rows are padded to 8
MAX_TILE = 128  # largest: big enough for an efficient matmul (256 measured slower on CPU)


def tile_heights(n_rows: int) -> tuple[int, ...]:
    """Tile heights for `tiled`, largest first: (m, m/2, ..., 8), m = MAX_TILE or less for few rows.

    A group of s rows takes s // m tiles of m rows, then one tile of each smaller height in the
    binary expansion of the remainder, so only its last < 8 rows are padded whatever its size. The
    top height does not follow the mean group size: routing is rarely even (on random weights a
    few experts take most tokens), and a large group in small tiles runs at half the matmul speed.
    """
    m = MIN_TILE
    while m < min(n_rows, MAX_TILE):
        m *= 2
    heights = [m]
    while heights[-1] > MIN_TILE:
        heights.append(heights[-1] // 2)
    return tuple(heights)


def _walk_group(start: Array, size: Array, heights: tuple[int, ...], tile_fn: Callable, carry: object) -> object:
    """Call tile_fn(row, height, carry) over tiles covering rows [start, start + size) in order.

    The last tile may run past the group into the next group's rows (which are written after this
    one) or into the padding rows that follow the last group.
    """
    big = heights[0]
    carry = jax.lax.fori_loop(0, size // big, lambda t, c: tile_fn(start + t * big, big, c), carry)
    row, rest = start + (size // big) * big, size % big
    for h in heights[1:]:
        take = rest >= h
        carry = jax.lax.cond(take, lambda c, row=row, h=h: tile_fn(row, h, c), lambda c: c, carry)
        row, rest = row + jnp.where(take, h, 0), rest - jnp.where(take, h, 0)
    last = heights[-1]
    return jax.lax.cond(rest > 0, lambda c: tile_fn(row, last, c), lambda c: c, carry)


def _expert_weights(w: Array, layer: Array, e: Array) -> Array:
    """w[layer, e] straight from the layer-stacked tensor: one expert's matrix, nothing else copied."""
    return jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False), e, 0,
                                        keepdims=False)


def _grouped_swiglu_fwd_loop(rows: Array, gate: Array, up: Array, down: Array, layer: Array, sizes: Array,
                             starts: Array, heights: tuple[int, ...]) -> Array:
    def expert_body(e: Array, out: Array) -> Array:
        wg, wu, wd = (_expert_weights(a, layer, e) for a in (gate, up, down))

        def tile_fn(row: Array, h: int, out: Array) -> Array:
            tile = jax.lax.dynamic_slice_in_dim(rows, row, h)
            y = (jax.nn.silu(tile @ wg) * (tile @ wu)) @ wd
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), row, 0)

        return _walk_group(starts[e], sizes[e], heights, tile_fn, out)

    # An expert with no rows is skipped before its weights are sliced (that slice is a copy on CPU).
    body = lambda e, out: jax.lax.cond(sizes[e] > 0, expert_body, lambda e, out: out, e, out)
    return jax.lax.fori_loop(0, gate.shape[1], body, jnp.zeros_like(rows))


def _pad_rows(a: Array, heights: tuple[int, ...]) -> Array:
    """heights[0] spare rows: the last tile of the last group never reads or writes out of bounds."""
    return jnp.concatenate([a, jnp.zeros((heights[0], a.shape[1]), a.dtype)])


def _walk_forward(rows: Array, gate: Array, up: Array, down: Array, layer: Array, sizes: Array, starts: Array,
                  heights: tuple[int, ...]) -> Array:
    y = _grouped_swiglu_fwd_loop(_pad_rows(rows, heights), gate, up, down, layer, sizes, starts, heights)
    return y[:rows.shape[0]]


def _grouped_swiglu_forward(rows: Array, gate: Array, up: Array, down: Array, layer: Array, sizes: Array,
                            starts: Array, heights: tuple[int, ...]) -> Array:
    """The native kernel where it applies (float32 on CPU, see clover_jax.native), else the tile walk."""
    walk = partial(_walk_forward, heights=heights)
    f32 = all(a.dtype == jnp.float32 for a in (rows, gate, up, down))
    if not (f32 and jax.default_backend() == "cpu" and native.available()):
        return walk(rows, gate, up, down, layer, sizes, starts)
    call_native = lambda rows, gate, up, down, layer, sizes, starts: native.grouped_swiglu(
        rows, gate, up, down, layer, sizes)
    return jax.lax.platform_dependent(rows, gate, up, down, layer, sizes, starts, cpu=call_native, default=walk)


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _grouped_swiglu(rows: Array, gate: Array, up: Array, down: Array, layer: Array, sizes: Array, starts: Array,
                    heights: tuple[int, ...]) -> Array:
    return _grouped_swiglu_forward(rows, gate, up, down, layer, sizes, starts, heights)


def _grouped_swiglu_fwd(rows, gate, up, down, layer, sizes, starts, heights):
    y = _grouped_swiglu_forward(rows, gate, up, down, layer, sizes, starts, heights)
    return y, (rows, gate, up, down, layer, sizes, starts)


def _grouped_swiglu_bwd(heights, res, dy):
    """The same tile walk: per tile dX = dH W^T, and per expert dW_e = sum over tiles of X^T dH (rows
    past the group masked out), recomputing the tile's hidden activations instead of storing them."""
    rows, gate, up, down, layer, sizes, starts = res
    n_rows = rows.shape[0]
    rows, dy = _pad_rows(rows, heights), _pad_rows(dy, heights)
    f32 = jnp.float32

    def expert_body(e: Array, carry: tuple) -> tuple:
        dx, dgate, dup, ddown = carry
        wg, wu, wd = (_expert_weights(a, layer, e) for a in (gate, up, down))
        end = starts[e] + sizes[e]

        def tile_fn(row: Array, h: int, c: tuple) -> tuple:
            dx, dwg, dwu, dwd = c
            xt = jax.lax.dynamic_slice_in_dim(rows, row, h)
            inside = (row + jnp.arange(h) < end)[:, None]
            dyt = jnp.where(inside, jax.lax.dynamic_slice_in_dim(dy, row, h), 0).astype(wd.dtype)
            g = (xt @ wg).astype(f32)
            u = (xt @ wu).astype(f32)
            sg = jax.nn.sigmoid(g)
            act = g * sg
            hid = (act * u).astype(wd.dtype)
            dhid = (dyt @ wd.T).astype(f32)
            du = dhid * act
            dg = dhid * u * sg * (1 + g * (1 - sg))
            du, dg = du.astype(wu.dtype), dg.astype(wg.dtype)
            dwd = dwd + jnp.dot(hid.T, dyt, preferred_element_type=f32)
            dwg = dwg + jnp.dot(xt.T, dg, preferred_element_type=f32)
            dwu = dwu + jnp.dot(xt.T, du, preferred_element_type=f32)
            dxt = dg @ wg.T + du @ wu.T
            return jax.lax.dynamic_update_slice_in_dim(dx, dxt.astype(dx.dtype), row, 0), dwg, dwu, dwd

        zeros = lambda a: jnp.zeros_like(a, f32)  # zeros_like keeps shard_map varying-axes types
        dx, dwg, dwu, dwd = _walk_group(starts[e], sizes[e], heights, tile_fn, (dx, zeros(wg), zeros(wu), zeros(wd)))
        put = lambda acc, d: jax.lax.dynamic_update_slice(
            acc, d.astype(acc.dtype)[None, None], (layer, e, 0, 0))
        return dx, put(dgate, dwg), put(dup, dwu), put(ddown, dwd)

    init = (jnp.zeros_like(rows), jnp.zeros_like(gate), jnp.zeros_like(up), jnp.zeros_like(down))
    body = lambda e, c: jax.lax.cond(sizes[e] > 0, expert_body, lambda e, c: c, e, c)  # empty: zero grads
    dx, dgate, dup, ddown = jax.lax.fori_loop(0, gate.shape[1], body, init)
    return dx[:n_rows], dgate, dup, ddown, None, None, None


_grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)


def grouped_swiglu(rows: Array, sizes: Array, gate: Array, up: Array, down: Array, layer: Array | None = None,
                   heights: tuple[int, ...] | None = None) -> Array:
    """SwiGLU of rows sorted by expert (group sizes `sizes`), each contiguous group through its expert.

    gate/up [E, D, F], down [E, F, D]; or all stacked over layers [L, E, ...] with `layer` choosing one
    (then no layer's weights are copied out of the stack). Dropless; differentiable (custom VJP).
    """
    if layer is None:
        gate, up, down, layer = gate[None], up[None], down[None], 0
    heights = heights or tile_heights(rows.shape[0])
    starts = jnp.cumsum(sizes) - sizes
    return _grouped_swiglu(rows, gate, up, down, jnp.asarray(layer, jnp.int32), sizes.astype(jnp.int32),
                           starts.astype(jnp.int32), heights)


@register("tiled")
def dispatch_tiled(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig, layer: Array | None = None
                   ) -> tuple[Array, Array]:
    s = sort_by_expert(x, r, cfg.n_experts)
    y = grouped_swiglu(s.rows, s.group_sizes, w.gate, w.up, w.down, layer)
    return combine_sorted(y, s, r, x.dtype), _no_drops()


# Strategies that take expert weights still stacked over layers plus a `layer` index (see moe_block).
TAKES_LAYER_STACK: set[str] = {"tiled"}


def known_dispatches() -> list[str]:
    import clover_jax.expert_parallel  # noqa: F401  (registers the ep_* strategies)

    return sorted(DISPATCH)


def get_dispatch(name: str) -> Dispatch:
    """The strategy called `name`; ValueError listing the known ones otherwise."""
    if name not in DISPATCH and name.startswith("ep_"):
        import clover_jax.expert_parallel  # noqa: F401  (registers the ep_* strategies)
    if name not in DISPATCH:
        raise ValueError(f"unknown MoE dispatch {name!r}; known: {', '.join(known_dispatches())}")
    return DISPATCH[name]


def moe_block(x: Array, w: MoEWeights, cfg: ModelConfig, dispatch: str | None = None,
              layer: Array | None = None) -> tuple[Array, MoEStats]:
    """x [B, T, D] -> [B, T, D]: routed experts plus the (ungated) shared expert.

    With `layer`, w.gate/up/down are still stacked over layers ([L, E, ...]) and `layer` picks one:
    strategies in TAKES_LAYER_STACK slice single experts from the stack, the others get the layer.
    """
    name = dispatch or cfg.moe_dispatch
    get_dispatch(name)
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    r = route(flat, w, cfg)
    if layer is None:
        y, dropped = DISPATCH[name](flat, r, w, cfg)
    elif name in TAKES_LAYER_STACK:
        y, dropped = DISPATCH[name](flat, r, w, cfg, layer=layer)
    else:
        w = w.replace(gate=w.gate[layer], up=w.up[layer], down=w.down[layer])
        y, dropped = DISPATCH[name](flat, r, w, cfg)
    if w.shared is not None:
        y = y + swiglu(flat, w.shared)
    return y.reshape(b, t, d), stats(r, cfg.n_experts, dropped)
