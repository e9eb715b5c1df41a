"""Logical-axis rules: how named weight/activation axes map onto mesh axes.

Every weight declares logical axes (params.ParamSpec.axes); a rules table maps each logical axis to
a mesh axis (or a tuple of them, or None for replicated). The named layouts in `sharding/*.toml`
carry a mesh shape and a rules table; `layouts.py` reads them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from clover_jax import params as P
from clover_jax.config import ModelConfig

Rules = Mapping[str, str | tuple[str, ...] | None]

# Expert-parallel by default: experts over `expert`, heads and MLP widths over `tensor`,
# batch over `data`. Axes not named here are replicated.
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "vocab": None,
    "embed": None,
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "experts_replicated": None,
    "layers": None,
    "norm": None,
    "seq": None,
}


class ShardingError(ValueError):
    """A mesh or rules table that cannot shard the model."""


def _mesh_axes(rule: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def logical_to_spec(axes: tuple[str | None, ...], rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for logical axes; mesh axes of size 1 or absent from `mesh` are dropped."""
    out: list[Any] = []
    used: set[str] = set()
    for ax in axes:
        mesh_axes = [] if ax is None else list(_mesh_axes(rules.get(ax)))
        if mesh is not None:
            mesh_axes = [m for m in mesh_axes if m in mesh.shape and mesh.shape[m] > 1]
        mesh_axes = [m for m in mesh_axes if m not in used]  # one mesh axis shards one dim at most
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    return PartitionSpec(*out)


def _check_divides(name: str, spec: P.ParamSpec, pspec: PartitionSpec, mesh: Mesh) -> None:
    for dim, (size, ax_name, part) in enumerate(zip(spec.shape, spec.axes, pspec, strict=True)):
        if part is None:
            continue
        n = int(np.prod([mesh.shape[a] for a in _mesh_axes(part)]))
        if size % n:
            raise ShardingError(
                f"weight {name!r} dim {dim} (logical axis {ax_name!r}, size {size}) is not divisible by "
                f"mesh axis {part!r} of size {n}; change the mesh or the rule for {ax_name!r}")


def weight_shardings(cfg_or_specs: ModelConfig | Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """NamedSharding per weight; raises ShardingError naming the weight, axis and sizes."""
    rules = DEFAULT_RULES if rules is None else rules
    specs = P.abstract(cfg_or_specs) if isinstance(cfg_or_specs, ModelConfig) else cfg_or_specs
    for name, spec in P.named_leaves(specs):
        _check_divides(name, spec, logical_to_spec(spec.axes, rules, mesh), mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s.axes, rules, mesh)), specs,
                        is_leaf=P.is_spec)


# ---- activation constraints ------------------------------------------------------------------
# The model calls `constrain(x, axes)` at a few points; it is a no-op unless a mesh context is set,
# so single-device code never pays for (or depends on) sharding.

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("clover_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | None = None) -> Iterator[Mesh]:
    """Activate a mesh and rules for activation constraints and expert-parallel dispatch."""
    token = _ACTIVE.set((mesh, DEFAULT_RULES if rules is None else rules))
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> tuple[Mesh, Rules] | None:
    return _ACTIVE.get()


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules, mesh)))
