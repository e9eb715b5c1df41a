"""Expert-parallel MoE dispatch under `jax.shard_map`.

Experts are split over the mesh axes that the rule for `experts` names (the "expert axis", size
n_ep), each expert's width over the axes of `expert_mlp` (the "tensor axis"), tokens over the axes
of `batch`. Three strategies, listed in `dispatch.DISPATCH` (same signature and result as `dense`):

- `ep_gather`:     tokens stay where they are (replicated over the expert axis); each shard runs
                   the token copies routed to its own experts, then `psum_scatter` (or `psum`) adds
                   the partial outputs. Dropless; no all-to-all; best for small batches (a
                   denoising pass over one block).
- `ep_a2a`:        tokens split over the expert axis too; each shard packs its token copies into
                   a fixed [n_ep, C, D] buffer (C = capacity per destination shard), `all_to_all`,
                   local experts, `all_to_all` back. Copies beyond C are dropped and counted. Runs
                   anywhere (also on CPU).
- `ep_ragged_a2a`: like `ep_a2a` but dropless: variable-sized chunks with `lax.ragged_all_to_all`
                   into a receive buffer large enough for the worst case. TPU/GPU only.

The mesh and rules are the `mesh` argument (a `mesh.rules.MeshRules`); without one, a one-device
mesh is used (the strategies then equal `dense` trivially). Knobs read at trace time (a jitted
function keeps the value it was traced with):

- capacity factor of `ep_a2a`: `capacity_factor(cf)` context, else $CLOVER_EP_CAPACITY_FACTOR,
  else `CAPACITY_FACTOR`. C = ceil(cf * local_copies / n_ep), at most local_copies (cf >= n_ep
  never drops).
- local grouped matmul: `local_matmul("ragged"|"tiled"|"dense")` context, else
  $CLOVER_EP_LOCAL_MATMUL, else `auto` (`tiled` = the grouped SwiGLU walk on CPU devices,
  `lax.ragged_dot` on TPU/GPU).

All three are differentiable (training under a mesh): inputs replicated over a mesh axis get their
gradients psum-ed over it (see `_same_vma`). `MoEStats.dropped` reports `ep_a2a`'s drops.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from clover_jax.config import ModelConfig
from clover_jax.errors import ShardingError
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import quant
from clover_jax.model.moe.grouped_swiglu import grouped_swiglu
from clover_jax.model.moe.routing import Routing
from clover_jax.model.moe.sorting import combine_sorted, sort_by_expert
from clover_jax.model.params import MoEWeights

Array = jax.Array

CAPACITY_FACTOR = 2.0
LOCAL_MATMULS = ("auto", "ragged", "tiled", "dense")

_CAPACITY: contextvars.ContextVar[float | None] = contextvars.ContextVar("clover_ep_capacity", default=None)
_LOCAL: contextvars.ContextVar[str | None] = contextvars.ContextVar("clover_ep_local", default=None)


@contextlib.contextmanager
def capacity_factor(cf: float) -> Iterator[float]:
    """Capacity factor for `ep_a2a` while tracing inside this context."""
    if not cf > 0:
        raise ValueError(f"capacity factor must be positive, got {cf}")
    token = _CAPACITY.set(float(cf))
    try:
        yield float(cf)
    finally:
        _CAPACITY.reset(token)


def current_capacity_factor() -> float:
    """The `ep_a2a` capacity factor: the `capacity_factor` context, else
    $CLOVER_EP_CAPACITY_FACTOR (ValueError unless positive), else `CAPACITY_FACTOR`."""
    cf = _CAPACITY.get()
    if cf is not None:
        return cf
    env = os.environ.get("CLOVER_EP_CAPACITY_FACTOR")
    if env:
        try:
            cf = float(env)
        except ValueError:
            cf = -1.0
        if not cf > 0:
            raise ValueError(f"CLOVER_EP_CAPACITY_FACTOR must be a positive number, got {env!r}")
        return cf
    return CAPACITY_FACTOR


@contextlib.contextmanager
def local_matmul(impl: str) -> Iterator[str]:
    """Grouped-matmul implementation for the local experts while tracing inside this context."""
    if impl not in LOCAL_MATMULS:
        raise ValueError(f"local matmul must be one of {LOCAL_MATMULS}, got {impl!r}")
    token = _LOCAL.set(impl)
    try:
        yield impl
    finally:
        _LOCAL.reset(token)


def _local_impl(mesh: Mesh) -> str:
    impl = _LOCAL.get() or os.environ.get("CLOVER_EP_LOCAL_MATMUL", "auto")
    if impl not in LOCAL_MATMULS:
        raise ValueError(f"CLOVER_EP_LOCAL_MATMUL must be one of {LOCAL_MATMULS}, got {impl!r}")
    if impl == "auto":
        impl = "tiled" if platform(mesh) == "cpu" else "ragged"
    return impl


def platform(mesh: Mesh) -> str:
    """The platform of the mesh's devices: cpu, gpu or tpu."""
    return str(mesh.devices.flat[0].platform)


# ---- mesh axes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EPAxes:
    """Which mesh axes shard tokens, experts and expert widths (derived from the rules)."""

    mesh: Mesh
    token: tuple[str, ...]
    expert: tuple[str, ...]
    tensor: tuple[str, ...]

    def size(self, axes: tuple[str, ...]) -> int:
        """Shards along `axes`: the product of their mesh sizes (1 for none)."""
        return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

    @property
    def n_ep(self) -> int:
        """Expert shards: the size of the expert axes."""
        return self.size(self.expert)

    def index(self, axes: tuple[str, ...]) -> Array:
        """Linear index of this shard along `axes` (major first, as PartitionSpec tuples order them)."""
        idx = jnp.zeros((), jnp.int32)
        for a in axes:
            idx = idx * self.mesh.shape[a] + jax.lax.axis_index(a)
        return idx


def _spec(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def ep_axes(cfg: ModelConfig, mesh_rules: MeshRules | None) -> EPAxes:
    """Expert-parallel axes of `mesh_rules` (a one-device mesh when None)."""
    if mesh_rules is None:
        mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
        return EPAxes(mesh, (), (), ())
    mesh, rules = mesh_rules.mesh, mesh_rules.rules

    def axes_of(logical: str, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
        return tuple(a for a in rules.mesh_axes(logical) if a in mesh.shape and mesh.shape[a] > 1 and a not in exclude)

    expert = axes_of("experts")
    tensor = axes_of("expert_mlp", expert)
    token = axes_of("batch", expert + tensor)
    ax = EPAxes(mesh, token, expert, tensor)
    if cfg.n_experts % ax.n_ep:
        raise ShardingError(
            f"{cfg.n_experts} experts cannot be split over mesh axes {expert} of size {ax.n_ep}")
    if cfg.expert_mlp_dim % ax.size(tensor):
        raise ShardingError(
            f"expert width {cfg.expert_mlp_dim} cannot be split over mesh axes {tensor} of size {ax.size(tensor)}")
    return ax


def _weight_specs(ax: EPAxes, w: MoEWeights) -> tuple:
    """shard_map specs of w.gate, w.up, w.down (for quantized weights, a spec each for qvalue and scale)."""
    e, t = _spec(ax.expert), _spec(ax.tensor)
    specs = PartitionSpec(e, None, t), PartitionSpec(e, None, t), PartitionSpec(e, t, None)
    return tuple(quant.leaf_spec(p, a) for p, a in zip(specs, (w.gate, w.up, w.down), strict=True))


def _pad_tokens(x: Array, r: Routing, multiple: int) -> tuple[Array, Array, Array]:
    """Pad the token dimension to a multiple of the token shards; padded copies route to expert -1."""
    n = x.shape[0]
    pad = (-n) % multiple
    experts, weights = r.experts, r.weights
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, x.shape[1]), x.dtype)])
        experts = jnp.concatenate([experts, jnp.full((pad, experts.shape[1]), -1, experts.dtype)])
        weights = jnp.concatenate([weights, jnp.zeros((pad, weights.shape[1]), weights.dtype)])
    return x, experts, weights


# ---- local grouped matmul -------------------------------------------------------------------------


def _varying(a: Array) -> set[str]:
    """Manual mesh axes `a` varies over (the aval field moved between JAX releases)."""
    aval = jax.typeof(a)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return set(vma or ())


def _same_vma(*arrays: Array) -> list[Array]:
    """Mark every array as varying over the union of the mesh axes any of them varies over.

    Each local function starts with this on its differentiable inputs: then (1) a loop carry that
    starts from the rows and accumulates weights keeps its type, and (2) the gradient of an input
    replicated over an axis is psum-ed over it. Without it, rows gathered by shard-dependent
    indices (the sort by local expert) carried only this shard's part of dx. `pcast` costs nothing
    at run time; its transpose is that psum.
    """
    leaves, treedef = jax.tree.flatten(list(arrays))  # a quantized weight is two leaves
    axes = set().union(*(_varying(a) for a in leaves))
    out = []
    for a in leaves:
        missing = tuple(sorted(axes - _varying(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return jax.tree.unflatten(treedef, out)


def local_swiglu(rows: Array, local_ids: Array, gate: Array, up: Array, down: Array, impl: str) -> Array:
    """SwiGLU of each (unsorted) row through its local expert; local_ids == n_local marks an empty row (-> 0)."""
    n_local = gate.shape[0]
    valid = local_ids < n_local
    if impl == "dense":
        onehot = (local_ids[:, None] == jnp.arange(n_local)[None]).astype(rows.dtype)
        h = jax.nn.silu(quant.einsum("md,edf->emf", rows, gate)) * quant.einsum("md,edf->emf", rows, up)
        y = quant.einsum("emf,efd->emd", h, down)
        return jnp.einsum("emd,me->md", y, onehot)
    order = jnp.argsort(local_ids, stable=True)
    sorted_rows = rows[order]
    sizes = jnp.zeros((n_local + 1,), jnp.int32).at[local_ids].add(1)[:n_local]
    if impl == "ragged":
        g = quant.ragged_dot(sorted_rows, gate, sizes)
        u = quant.ragged_dot(sorted_rows, up, sizes)
        y = quant.ragged_dot(jax.nn.silu(g) * u, down, sizes)
    elif impl == "tiled":
        sorted_rows, gate, up, down = _same_vma(sorted_rows, gate, up, down)
        y = grouped_swiglu(sorted_rows, sizes, gate, up, down)
    else:
        raise ValueError(f"unknown local matmul {impl!r}")
    y = jnp.zeros_like(y).at[order].set(y)
    return jnp.where(valid[:, None], y, 0)


def _combine(y_copies: Array, weights: Array, dtype: jnp.dtype) -> Array:
    """Sum each token's k expert outputs [n*k, D] with its routing weights [n, k]."""
    n, k = weights.shape
    return jnp.einsum("nkd,nk->nd", y_copies.reshape(n, k, -1).astype(jnp.float32), weights).astype(dtype)


def _shard_map(fn: Callable, ax: EPAxes, in_specs: tuple, out_specs: object) -> Callable:
    return jax.shard_map(fn, mesh=ax.mesh, in_specs=in_specs, out_specs=out_specs)


# ---- strategies -----------------------------------------------------------------------------------


def dispatch_ep_gather(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig, mesh: MeshRules | None = None,
                       layer: Array | None = None) -> tuple[Array, Array]:
    """`ep_gather`: each expert shard runs the copies routed to its experts, partial outputs summed;
    x [N, D] -> (y [N, D], dropped 0). ShardingError if experts or widths do not split."""
    ax = ep_axes(cfg, mesh)
    n_tok, n_ep = ax.size(ax.token), ax.n_ep
    n = x.shape[0]
    xp, experts, weights = _pad_tokens(x, r, n_tok)
    scatter = (xp.shape[0] // n_tok) % n_ep == 0
    e_local = cfg.n_experts // n_ep
    impl = _local_impl(ax.mesh)

    def local(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array) -> Array:
        x, weights, gate, up, down = _same_vma(x, weights, gate, up, down)
        k = experts.shape[1]
        rel = experts - ax.index(ax.expert) * e_local
        mine = (rel >= 0) & (rel < e_local)
        ids = jnp.where(mine, rel, e_local).reshape(-1)
        rows = jnp.repeat(x, k, axis=0)
        y = local_swiglu(rows, ids, gate, up, down, impl)
        y = _combine(y, jnp.where(mine, weights, 0.0), jnp.float32)
        if ax.expert:
            y = jax.lax.psum_scatter(y, ax.expert, scatter_dimension=0, tiled=True) if scatter \
                else jax.lax.psum(y, ax.expert)
        if ax.tensor:
            y = jax.lax.psum(y, ax.tensor)
        return y.astype(x.dtype)

    tok = PartitionSpec(_spec(ax.token), None)
    out = PartitionSpec(_spec(ax.token + ax.expert) if scatter else _spec(ax.token), None)
    y = _shard_map(local, ax, (tok, tok, tok, *_weight_specs(ax, w)), out)(xp, experts, weights, w.gate, w.up, w.down)
    return y[:n], jnp.zeros((), jnp.int32)


def a2a_capacity(local_copies: int, n_ep: int, cf: float) -> int:
    """Slots per (source shard, destination shard) pair for `ep_a2a`."""
    return max(1, min(local_copies, math.ceil(cf * local_copies / n_ep)))


def dispatch_ep_a2a(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig, mesh: MeshRules | None = None,
                    layer: Array | None = None) -> tuple[Array, Array]:
    """`ep_a2a`: copies sent to their experts' shards by `all_to_all` in buffers of fixed capacity;
    x [N, D] -> (y [N, D], dropped [] int32 copies over capacity, all shards)."""
    ax = ep_axes(cfg, mesh)
    split = ax.token + ax.expert
    n_split, n_ep = ax.size(split), ax.n_ep
    n = x.shape[0]
    xp, experts, weights = _pad_tokens(x, r, n_split)
    k = experts.shape[1]
    copies = xp.shape[0] // n_split * k
    cap = a2a_capacity(copies, n_ep, current_capacity_factor())
    e_local = cfg.n_experts // n_ep
    impl = _local_impl(ax.mesh)

    def local(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array) -> tuple[Array, Array]:
        x, weights, gate, up, down = _same_vma(x, weights, gate, up, down)
        d = x.shape[1]
        flat_e = experts.reshape(-1)
        dest = jnp.where(flat_e >= 0, flat_e // e_local, -1)
        onehot = (dest[:, None] == jnp.arange(n_ep)[None]).astype(jnp.int32)
        pos = jnp.take_along_axis(jnp.cumsum(onehot, 0) - 1, jnp.maximum(dest, 0)[:, None], 1)[:, 0]
        keep = (dest >= 0) & (pos < cap)
        dropped = jnp.sum((dest >= 0) & ~keep).astype(jnp.int32)
        slot = jnp.where(keep, dest * cap + pos, n_ep * cap)  # the extra last slot swallows drops
        send = jnp.zeros((n_ep * cap + 1, d), x.dtype).at[slot].set(jnp.repeat(x, k, axis=0))
        send_ids = jnp.full((n_ep * cap + 1,), -1, jnp.int32).at[slot].set(flat_e - dest * e_local)
        send, send_ids = send[:-1].reshape(n_ep, cap, d), send_ids[:-1].reshape(n_ep, cap)
        if ax.expert:
            send = jax.lax.all_to_all(send, ax.expert, 0, 0, tiled=True)
            send_ids = jax.lax.all_to_all(send_ids, ax.expert, 0, 0, tiled=True)
        ids = jnp.where(send_ids >= 0, send_ids, e_local).reshape(-1)
        y = local_swiglu(send.reshape(-1, d), ids, gate, up, down, impl).reshape(n_ep, cap, d)
        if ax.expert:
            y = jax.lax.all_to_all(y, ax.expert, 0, 0, tiled=True)
        y = jnp.concatenate([y.reshape(-1, d), jnp.zeros((1, d), y.dtype)])[slot]
        out = _combine(y, weights, jnp.float32)
        if ax.tensor:
            out = jax.lax.psum(out, ax.tensor)
        if split:
            dropped = jax.lax.psum(dropped, split)
        return out.astype(x.dtype), dropped

    tok = PartitionSpec(_spec(split), None)
    fn = _shard_map(local, ax, (tok, tok, tok, *_weight_specs(ax, w)), (tok, PartitionSpec()))
    y, dropped = fn(xp, experts, weights, w.gate, w.up, w.down)
    return y[:n], dropped


_EMULATE_RAGGED: contextvars.ContextVar[bool] = contextvars.ContextVar("clover_ep_emulate_ragged", default=False)


@contextlib.contextmanager
def emulated_ragged_all_to_all() -> Iterator[None]:
    """Trace `ep_ragged_a2a` with an all_gather-based stand-in for `ragged_all_to_all` (same
    semantics, n_ep times the traffic): lets CPU tests check the offsets bookkeeping."""
    token = _EMULATE_RAGGED.set(True)
    try:
        yield
    finally:
        _EMULATE_RAGGED.reset(token)


def _ragged_all_to_all_reference(operand: Array, output: Array, input_offsets: Array, send_sizes: Array,
                                 output_offsets: Array, recv_sizes: Array, *, axis_name: tuple[str, ...],
                                 me: Array, n: int) -> Array:
    """`lax.ragged_all_to_all` as documented, built from all_gather and scatters."""
    del recv_sizes  # implied by the senders' send_sizes
    ops = jax.lax.all_gather(operand, axis_name, tiled=False)
    ins, sends, outs = (jax.lax.all_gather(a, axis_name, tiled=False) for a in
                        (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(operand.shape[0])
    for s in range(n):
        ok = rows < sends[s, me]
        src = jnp.minimum(ins[s, me] + rows, operand.shape[0] - 1)
        dst = jnp.where(ok, outs[s, me] + rows, output.shape[0])  # out of bounds: dropped
        output = output.at[dst].set(ops[s][src], mode="drop")
    return output


def dispatch_ep_ragged_a2a(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig, mesh: MeshRules | None = None,
                           layer: Array | None = None) -> tuple[Array, Array]:
    """`ep_ragged_a2a`: dropless, copies sent by `lax.ragged_all_to_all`; x [N, D] -> (y [N, D],
    dropped 0). NotImplementedError on CPU outside `emulated_ragged_all_to_all`."""
    ax = ep_axes(cfg, mesh)
    emulate = _EMULATE_RAGGED.get()
    if platform(ax.mesh) == "cpu" and not emulate:
        raise NotImplementedError(
            "ep_ragged_a2a needs jax.lax.ragged_all_to_all, which XLA implements on TPU and GPU only; "
            "on CPU use ep_a2a (capacity-limited) or ep_gather (dropless)")
    split = ax.token + ax.expert
    n_split, n_ep = ax.size(split), ax.n_ep
    n = x.shape[0]
    xp, experts, weights = _pad_tokens(x, r, n_split)
    e_local, n_exp = cfg.n_experts // n_ep, cfg.n_experts
    impl = _local_impl(ax.mesh)

    def local(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array) -> Array:
        x, weights, gate, up, down = _same_vma(x, weights, gate, up, down)
        nk, d = experts.size, x.shape[1]
        k = experts.shape[1]
        flat_e = jnp.where(experts >= 0, experts, n_exp).reshape(-1)  # padding copies sort last
        order = jnp.argsort(flat_e, stable=True)
        sorted_e = flat_e[order]
        rows = x[order // k]
        dest = jnp.where(sorted_e < n_exp, sorted_e // e_local, n_ep)
        send_sizes = jnp.zeros((n_ep + 1,), jnp.int32).at[dest].add(1)[:n_ep]
        in_offsets = jnp.cumsum(send_sizes) - send_sizes
        me = ax.index(ax.expert)
        if emulate:
            ragged = functools.partial(_ragged_all_to_all_reference, me=me, n=n_ep)
        else:
            ragged = jax.lax.ragged_all_to_all
        # sizes[s, j]: copies shard s sends to shard j; every shard needs its column and row offsets.
        sizes = jax.lax.all_gather(send_sizes, ax.expert, tiled=False).reshape(n_ep, n_ep)
        out_offsets = (jnp.cumsum(sizes, 0) - sizes)[me]
        recv_sizes = sizes[:, me]
        recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
        back_offsets = (jnp.cumsum(sizes, 1) - sizes)[:, me]
        buf = n_ep * nk  # worst case: every shard sends all its copies here
        local_ids = jnp.where(sorted_e < n_exp, sorted_e - dest * e_local, -1).astype(jnp.int32)
        recv = ragged(rows, jnp.zeros((buf, d), x.dtype), in_offsets, send_sizes,
                                         out_offsets, recv_sizes, axis_name=ax.expert)
        recv_ids = ragged(local_ids[:, None], jnp.full((buf, 1), -1, jnp.int32), in_offsets,
                                             send_sizes, out_offsets, recv_sizes, axis_name=ax.expert)[:, 0]
        ids = jnp.where(recv_ids >= 0, recv_ids, e_local)
        y = local_swiglu(recv, ids, gate, up, down, impl)
        back = ragged(y, jnp.zeros((nk, d), y.dtype), recv_offsets, recv_sizes,
                                         back_offsets, send_sizes, axis_name=ax.expert)
        y_copies = jnp.zeros_like(back).at[order].set(back)
        out = _combine(y_copies, weights, jnp.float32)
        if ax.tensor:
            out = jax.lax.psum(out, ax.tensor)
        return out.astype(x.dtype)

    if not ax.expert:  # nothing to exchange: the grouped matmul alone
        s = sort_by_expert(x, r, cfg.n_experts)
        ids = jnp.repeat(jnp.arange(cfg.n_experts), s.group_sizes, total_repeat_length=s.rows.shape[0])
        y = local_swiglu(s.rows, ids, w.gate, w.up, w.down, impl)
        return combine_sorted(y, s, r, x.dtype), jnp.zeros((), jnp.int32)
    tok = PartitionSpec(_spec(split), None)
    y = _shard_map(local, ax, (tok, tok, tok, *_weight_specs(ax, w)), tok)(xp, experts, weights, w.gate, w.up, w.down)
    return y[:n], jnp.zeros((), jnp.int32)
