"""Logical-axis rules: how named weight and activation axes map onto mesh axes.

Every weight declares logical axes (`model.params.ParamSpec.axes`). `ShardingRules` is the typed
table from each logical axis to a mesh axis, a tuple of them, or None (replicated); a misspelt
logical axis is an error when the table is built. `MeshRules` pairs a concrete `jax.sharding.Mesh`
with a table: it is what the model, the MoE dispatch and the sampler take as their `mesh=` argument,
explicitly (it is hashable, so it is part of a compiled program's static key), never from a global.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from clover_jax.errors import ShardingError

MeshAxes = str | tuple[str, ...] | None  # one mesh axis, several (major first), or replicated


def as_tuple(rule: MeshAxes) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple (empty for replicated)."""
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axes. The defaults are expert-parallel: experts over `expert`, heads (attention and
    Gated DeltaNet) and MLP widths over `tensor`, the batch over `data`; everything else replicated.

    Gated DeltaNet: `linear_key_heads` and `linear_heads` should map to the same mesh axes, so that each device
    holds the value heads that read its own key heads (`params.GatedDeltaNetWeights`); other choices still
    compute the same function, with more communication."""

    batch: MeshAxes = "data"
    seq: MeshAxes = None
    vocab: MeshAxes = None
    embed: MeshAxes = None
    q_heads: MeshAxes = "tensor"
    kv_heads: MeshAxes = "tensor"
    head_dim: MeshAxes = None
    mlp: MeshAxes = "tensor"
    experts: MeshAxes = "expert"
    expert_mlp: MeshAxes = "tensor"
    experts_replicated: MeshAxes = None
    linear_heads: MeshAxes = "tensor"  # Gated DeltaNet value heads (and their state)
    linear_key_heads: MeshAxes = "tensor"  # Gated DeltaNet key heads: the groups of its conv channels
    linear_conv: MeshAxes = None  # Gated DeltaNet conv channels inside a key-head group (q | k | v of that head)
    layers: MeshAxes = None
    norm: MeshAxes = None

    @classmethod
    def logical_axes(cls) -> tuple[str, ...]:
        """Every logical axis name, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], where: str = "rules") -> ShardingRules:
        """The defaults with `table`'s entries replaced; an unknown logical axis is a ShardingError."""
        unknown = sorted(set(table) - set(cls.logical_axes()))
        if unknown:
            raise ShardingError(f"{where}: unknown logical axes {unknown}; known: {', '.join(cls.logical_axes())}")
        return cls(**{k: None if v is None else (v if isinstance(v, str) else tuple(v)) for k, v in table.items()})

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes a logical axis maps to (empty for None or a replicated axis)."""
        return () if logical is None else as_tuple(getattr(self, logical))

    def replace(self, **changes: MeshAxes) -> ShardingRules:
        """A copy with the given logical axes mapped to new mesh axes."""
        return dataclasses.replace(self, **changes)


DEFAULT_RULES = ShardingRules()


def logical_to_spec(axes: tuple[str | None, ...], rules: ShardingRules, mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for logical axes; mesh axes of size 1 or absent from `mesh` are dropped."""
    out: list[Any] = []
    used: set[str] = set()
    for ax in axes:
        mesh_axes = list(rules.mesh_axes(ax))
        if mesh is not None:
            mesh_axes = [m for m in mesh_axes if m in mesh.shape and mesh.shape[m] > 1]
        mesh_axes = [m for m in mesh_axes if m not in used]  # one mesh axis shards one dim at most
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    return PartitionSpec(*out)


@dataclass(frozen=True)
class MeshRules:
    """A mesh and the rules that place logical axes on it: the `mesh=` argument of the model and sampler."""

    mesh: Mesh
    rules: ShardingRules = DEFAULT_RULES

    def spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        """The PartitionSpec of logical `axes` on this mesh (`logical_to_spec`)."""
        return logical_to_spec(axes, self.rules, self.mesh)

    def sharding(self, axes: tuple[str | None, ...]) -> NamedSharding:
        """The NamedSharding of logical `axes` on this mesh."""
        return NamedSharding(self.mesh, self.spec(axes))

    def size(self, mesh_axis: str) -> int:
        """The size of a mesh axis (1 when the mesh has no such axis)."""
        return int(self.mesh.shape.get(mesh_axis, 1))

    @property
    def n_devices(self) -> int:
        """Devices in the mesh."""
        return int(self.mesh.size)


def constrain(x: jax.Array, axes: tuple[str | None, ...], mesh: MeshRules | None) -> jax.Array:
    """`with_sharding_constraint` to the logical axes on `mesh`; the identity without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, mesh.sharding(axes))
