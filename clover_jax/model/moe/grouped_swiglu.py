"""The grouped SwiGLU: rows sorted by expert, each contiguous group through its own expert's SwiGLU.

The walk takes each expert's group in tiles (heights 128, 64, ..., 8: full tiles, then the binary
expansion of the rest, so at most 7 padded rows per expert), multiplying each tile by that
expert's weights sliced straight out of the `[layer, expert]` stack; experts with no rows are
skipped. In float32 on CPU the forward pass is the CPU kernel of `clover_jax.kernels` instead
(same function, each group through a register-blocked GEMM on XLA's threads), where it builds.
Differentiable: a custom VJP runs the same tile walk backwards.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from clover_jax import kernels
from clover_jax.model import quant

Array = jax.Array


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
    take = lambda a: jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), e, 0,
                                                  keepdims=False)
    return jax.tree.map(take, w)  # an array, or a QArray's qvalue and scale


def _grouped_swiglu_fwd_loop(rows: Array, gate: Array, up: Array, down: Array, layer: Array, sizes: Array,
                             starts: Array, heights: tuple[int, ...]) -> Array:
    def expert_body(e: Array, out: Array) -> Array:
        wg, wu, wd = (_expert_weights(a, layer, e) for a in (gate, up, down))

        def tile_fn(row: Array, h: int, out: Array) -> Array:
            tile = jax.lax.dynamic_slice_in_dim(rows, row, h)
            y = quant.matmul(jax.nn.silu(quant.matmul(tile, wg)) * quant.matmul(tile, wu), wd)
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
    """The CPU kernel where it applies (float32 on CPU, see clover_jax.kernels), else the tile walk."""
    walk = partial(_walk_forward, heights=heights)
    f32 = all(not quant.is_quantized(a) and a.dtype == jnp.float32 for a in (rows, gate, up, down))
    if not (f32 and jax.default_backend() == "cpu" and kernels.available()):
        return walk(rows, gate, up, down, layer, sizes, starts)
    call_kernel = lambda rows, gate, up, down, layer, sizes, starts: kernels.grouped_swiglu(
        rows, gate, up, down, layer, sizes)
    return jax.lax.platform_dependent(rows, gate, up, down, layer, sizes, starts, cpu=call_kernel, default=walk)


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
