"""The model's cache: what a window leaves for the windows after it.

Layout (`KVCache`), one leaf per layer stack, rows on axis 1:
  dense_k / dense_v   [dense layers, B, S, kv_heads, head_dim]   attention K/V of the dense stack (or None)
  moe_k / moe_v       [MoE attention layers, B, S, kv_heads, head_dim]
  linear              hybrid configs: each Gated DeltaNet layer's fixed-size state (`gated_deltanet.MixerState`:
                      recurrent [layers, B, value heads, key dim, value dim] float32, conv_tail
                      [layers, B, K - 1, conv channels]), whatever the context length; None otherwise.

The attention K/V are kept per column: a window written at column `cache_offset` fills columns
[offset, offset + W) (`transformer.forward`), so K/V follow their columns when rows move (`shift_left`). The
Gated DeltaNet state has no columns: it is the state after the committed columns, moved with its row only.

Placement (`axes`, `shardings`): rows over the mesh's batch axes; attention K/V split by KV head; the Gated
DeltaNet state by value head and its conv tail by key-head group, as the weights that write them are
(`params.GatedDeltaNetWeights`), so no pass reshards the cache. The sampler, the serving engine and
`clover plan` all place a cache through these functions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import gated_deltanet

Array = jax.Array
_KV_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")
_ROWS = 1  # the rows' axis of every cache leaf


@struct.dataclass
class KVCache:
    """Keys and values of every attention layer and, for hybrid configs, the Gated DeltaNet states (see the
    module docstring for the layout)."""

    dense_k: Any
    dense_v: Any
    moe_k: Any
    moe_v: Any
    linear: Any = None  # gated_deltanet.MixerState with [linear layers, B, ...] leaves, or None

    @property
    def length(self) -> int:
        """Cache columns S."""
        return (self.moe_k if self.moe_k is not None else self.dense_k).shape[2]


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype: Any = None) -> KVCache:
    """A zero cache of S = `length` columns for `batch` sequences, K/V in `dtype` (default the config's), the
    Gated DeltaNet recurrent state in float32; None for a stack the config does not have."""
    dt = jnp.dtype(cfg.dtype) if dtype is None else dtype

    def zeros(n: int) -> Array | None:
        return jnp.zeros((n, batch, length, cfg.n_kv_heads, cfg.head_dim), dt) if n else None

    n_attn = cfg.n_moe_layers - cfg.n_linear_layers
    linear = None
    if cfg.is_hybrid:
        n = cfg.n_linear_layers
        linear = gated_deltanet.MixerState(
            jnp.zeros((n, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                      jnp.float32),
            jnp.zeros((n, batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), dt))
    return KVCache(zeros(cfg.n_dense_layers), zeros(cfg.n_dense_layers), zeros(n_attn), zeros(n_attn), linear)


def axes(cache: KVCache) -> KVCache:
    """The logical axes of every leaf of `cache` (a KVCache of axis-name tuples, None where it has no leaf)."""
    def kv(x: Any) -> tuple[str | None, ...] | None:
        return None if x is None else _KV_AXES

    linear = cache.linear
    if linear is not None:
        linear = gated_deltanet.MixerState(recurrent=("layers", "batch", "linear_heads", None, None),
                                           conv_tail=("layers", "batch", None, "linear_key_heads"))
    return KVCache(kv(cache.dense_k), kv(cache.dense_v), kv(cache.moe_k), kv(cache.moe_v), linear)


def shardings(cache: KVCache, mesh: MeshRules) -> KVCache:
    """Where each leaf of `cache` lives on `mesh` (NamedShardings from `axes` and the mesh's rules)."""
    def is_axes(x: Any) -> bool:  # a tuple of axis names, not the MixerState (a NamedTuple) that holds them
        return isinstance(x, tuple) and not hasattr(x, "_fields")

    return jax.tree.map(mesh.sharding, axes(cache), is_leaf=is_axes)


def abstract(cfg: ModelConfig, batch: int, length: int, mesh: MeshRules | None = None) -> KVCache:
    """`init_cache`'s leaves as ShapeDtypeStructs (nothing allocated), placed by `shardings` on `mesh`."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, length))
    if mesh is None:
        return shapes
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                        shardings(shapes, mesh))


# ---- rows ----------------------------------------------------------------------------------------------


def take_rows(cache: KVCache | None, n: int) -> KVCache | None:
    """Rows [0, n) of every leaf."""
    return None if cache is None else jax.tree.map(lambda x: x[:, :n], cache)


def put_rows(big: KVCache | None, small: KVCache | None) -> KVCache | None:
    """`big` with its first rows replaced by `small`'s."""
    if big is None:
        return None
    return jax.tree.map(lambda x, y: x.at[:, :y.shape[_ROWS]].set(y.astype(x.dtype)), big, small)


def write_row(big: KVCache | None, one: KVCache | None, row: Array) -> KVCache | None:
    """`big` with row `row` replaced by the single row of `one`."""
    if big is None:
        return None
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y[:, 0].astype(x.dtype), row, _ROWS),
                        big, one)


def write_rows(big: KVCache | None, new: KVCache | None, rows: Array) -> KVCache | None:
    """`big` with rows `rows` [k] replaced by the k rows of `new`, in order; an index outside `big`'s rows writes
    nothing (a padding row)."""
    if big is None:
        return None
    at = (slice(None),) * _ROWS + (rows,)
    return jax.tree.map(lambda x, y: x.at[at].set(y.astype(x.dtype), mode="drop"), big, new)


def read_row(cache: KVCache | None, row: Array) -> KVCache | None:
    """Row `row` of every leaf, as a one-row cache (a copy: later writes to `cache` do not reach it)."""
    return None if cache is None else jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row, _ROWS, True),
                                                   cache)


def _kv_map(cache: KVCache, fn: Any) -> KVCache:
    """`fn` on every attention K/V leaf ([layers, B, S, ...]); the Gated DeltaNet state, which has no columns,
    as it is."""
    def f(x: Array | None) -> Array | None:
        return None if x is None else fn(x)

    return cache.replace(dense_k=f(cache.dense_k), dense_v=f(cache.dense_v), moe_k=f(cache.moe_k), moe_v=f(cache.moe_v))


def roll_columns(cache: KVCache, n: Array | int) -> KVCache:
    """Every attention K/V column moved `n` columns left (traced; the first n wrap round to the end; a negative n
    moves them right)."""
    return _kv_map(cache, lambda x: jnp.roll(x, -n, axis=2))


def resize_columns(cache: KVCache, length: int) -> KVCache:
    """The attention K/V cut to their first `length` columns, or padded with zero columns to `length`."""
    def f(x: Array) -> Array:
        s = x.shape[2]
        if length <= s:
            return x[:, :, :length]
        return jnp.concatenate([x, jnp.zeros((*x.shape[:2], length - s, *x.shape[3:]), x.dtype)], axis=2)

    return _kv_map(cache, f)


def move_row(cache: KVCache | None, src: Array, dst: Array) -> KVCache | None:
    """Row `dst` := row `src` in every leaf."""
    def move(x: Array) -> Array:
        return jax.lax.dynamic_update_index_in_dim(x, jax.lax.dynamic_index_in_dim(x, src, _ROWS, False), dst, _ROWS)

    return None if cache is None else jax.tree.map(move, cache)


def select_rows(pick: Array, a: KVCache, b: KVCache) -> KVCache:
    """Per row: `a`'s leaves where pick [B] else `b`'s."""
    def sel(x: Array, y: Array) -> Array:
        return jnp.where(pick.reshape((1,) + pick.shape + (1,) * (x.ndim - 2)), x, y)

    return jax.tree.map(sel, a, b)


def shift_left(cache: KVCache, n: int, pick: Array) -> KVCache:
    """For rows where pick [B]: every attention K/V column moves n columns left (the last n become zero), as
    the row's tokens do; the Gated DeltaNet state, which has no columns, stays. Other rows are unchanged."""
    def shift(x: Array | None) -> Array | None:
        if x is None:
            return None
        s = x.shape[2]
        moved = jnp.concatenate([x[:, :, n:s], jnp.zeros((*x.shape[:2], n, *x.shape[3:]), x.dtype)], axis=2)
        return jnp.where(pick.reshape((1, -1) + (1,) * (x.ndim - 2)), moved, x)

    return cache.replace(dense_k=shift(cache.dense_k), dense_v=shift(cache.dense_v), moe_k=shift(cache.moe_k),
                         moe_v=shift(cache.moe_v))
