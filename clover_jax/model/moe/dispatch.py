"""The MoE block and its dispatch strategies, in one explicit table.

Routing is always float32 (`routing`). A dispatch strategy takes the routed token copies and returns
the weighted sum of expert outputs per token; every strategy computes the same function (`dense` is
the test oracle), they differ only in how the work is laid out:

- `dense`:  every expert on every token, weighted by the (mostly zero) routing weights.
- `ragged`: sort token copies by expert, `jax.lax.ragged_dot` grouped matmuls, unsort.
- `tiled`:  sort token copies by expert, then the grouped SwiGLU walk (`grouped_swiglu`): dropless,
            slices each active expert's matrices once per pass, and takes the expert weights still
            stacked over layers, so it is the fast path where `ragged_dot` has no real kernel (CPU).
- `ep_gather`, `ep_a2a`, `ep_ragged_a2a`: expert parallel under `shard_map` on the `mesh` argument
            (`expert_parallel`).

Every strategy is called as `fn(x [N, D], routing, weights, cfg, mesh, layer) -> (y [N, D], dropped [])`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.errors import ConfigError
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import quant
from clover_jax.model.layers import swiglu
from clover_jax.model.moe import expert_parallel
from clover_jax.model.moe.grouped_swiglu import grouped_swiglu
from clover_jax.model.moe.routing import Coreset, MoEStats, Routing, route, stats
from clover_jax.model.moe.sorting import combine_sorted, sort_by_expert
from clover_jax.model.params import MoEWeights

Array = jax.Array

DispatchFn = Callable[[Array, Routing, MoEWeights, ModelConfig, MeshRules | None, Array | None], tuple[Array, Array]]


def _no_drops() -> Array:
    return jnp.zeros((), jnp.int32)


def dispatch_dense(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig, mesh: MeshRules | None = None,
                   layer: Array | None = None) -> tuple[Array, Array]:
    """Every expert on every token, weighted by the routing weights: x [N, D] -> (y [N, D], dropped 0)."""
    combine = jnp.zeros((x.shape[0], cfg.n_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], r.experts].add(r.weights)
    h = jax.nn.silu(quant.einsum("nd,edf->enf", x, w.gate)) * quant.einsum("nd,edf->enf", x, w.up)
    y = quant.einsum("enf,efd->end", h, w.down)
    out = jnp.einsum("end,ne->nd", y.astype(jnp.float32), combine)
    return out.astype(x.dtype), _no_drops()


def dispatch_ragged(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig, mesh: MeshRules | None = None,
                    layer: Array | None = None) -> tuple[Array, Array]:
    """Copies sorted by expert through `jax.lax.ragged_dot` grouped matmuls: x [N, D] -> (y [N, D],
    dropped 0)."""
    s = sort_by_expert(x, r, cfg.n_experts)
    g = quant.ragged_dot(s.rows, w.gate, s.group_sizes)
    u = quant.ragged_dot(s.rows, w.up, s.group_sizes)
    y = quant.ragged_dot(jax.nn.silu(g) * u, w.down, s.group_sizes)
    return combine_sorted(y, s, r, x.dtype), _no_drops()


def dispatch_tiled(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig, mesh: MeshRules | None = None,
                   layer: Array | None = None) -> tuple[Array, Array]:
    """With `layer`, w.gate/up/down are still stacked over layers ([L, E, ...])."""
    s = sort_by_expert(x, r, cfg.n_experts)
    y = grouped_swiglu(s.rows, s.group_sizes, w.gate, w.up, w.down, layer)
    return combine_sorted(y, s, r, x.dtype), _no_drops()


# The strategies by name: one explicit table (no registration by import side effects).
DISPATCH: dict[str, DispatchFn] = {
    "dense": dispatch_dense,
    "ragged": dispatch_ragged,
    "tiled": dispatch_tiled,
    "ep_gather": expert_parallel.dispatch_ep_gather,
    "ep_a2a": expert_parallel.dispatch_ep_a2a,
    "ep_ragged_a2a": expert_parallel.dispatch_ep_ragged_a2a,
}
# Strategies that take the expert weights still stacked over layers plus a `layer` index.
LAYER_STACK = frozenset({"tiled"})


def known_dispatches() -> list[str]:
    """The strategy names, sorted."""
    return sorted(DISPATCH)


def get_dispatch(name: str) -> DispatchFn:
    """The strategy called `name`; ConfigError (a ValueError) listing the known ones otherwise."""
    if name not in DISPATCH:
        raise ConfigError(f"unknown MoE dispatch {name!r}; known: {', '.join(known_dispatches())}")
    return DISPATCH[name]


def takes_layer_stack(name: str) -> bool:
    """Whether strategy `name` indexes `[layer, expert]` in the layer-stacked expert weights itself."""
    get_dispatch(name)
    return name in LAYER_STACK


def choose_dispatch(mesh: MeshRules | None) -> str:
    """A sensible strategy for a mesh: `tiled` on one device, else dropless expert parallel
    (`ep_gather` on CPU devices, `ep_ragged_a2a` on GPU/TPU)."""
    if mesh is None or mesh.n_devices == 1:
        return "tiled"
    return "ep_gather" if expert_parallel.platform(mesh.mesh) == "cpu" else "ep_ragged_a2a"


def moe_block(x: Array, w: MoEWeights, cfg: ModelConfig, dispatch: str | None = None,
              layer: Array | None = None, mesh: MeshRules | None = None,
              coreset: Coreset | None = None) -> tuple[Array, MoEStats]:
    """x [B, T, D] -> [B, T, D]: routed experts plus the shared expert (scaled by sigmoid(x @ shared_gate)
    when the weights have that gate, as Qwen3.5 has it; else added as is).

    With `layer`, w.gate/up/down are still stacked over layers ([L, E, ...]) and `layer` picks one:
    strategies in LAYER_STACK slice single experts from the stack, the others get the layer.
    `mesh` is where the expert-parallel strategies run (None: one device). `coreset`: the rows [B * T] that
    form blocks being denoised, for the block expert coreset (`routing.route`).
    """
    name = dispatch or cfg.moe_dispatch
    fn = get_dispatch(name)
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    r = route(flat, w, cfg, coreset)
    if layer is not None and name not in LAYER_STACK:
        w = w.replace(gate=quant.index(w.gate, layer), up=quant.index(w.up, layer), down=quant.index(w.down, layer))
        layer = None
    y, dropped = fn(flat, r, w, cfg, mesh, layer)
    if w.shared is not None:
        shared = swiglu(flat, w.shared)
        if w.shared_gate is not None:
            shared = jax.nn.sigmoid(flat @ w.shared_gate) * shared
        y = y + shared
    return y.reshape(b, t, d), stats(r, cfg.n_experts, dropped)
