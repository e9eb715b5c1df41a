"""Meshes: the typed logical-axis rules table (`rules`) and the named mesh layouts of `sharding/` (`layouts`)."""

from clover_jax.mesh.layouts import Layout, layout_names, load_layout, make_mesh, mesh_from_arg
from clover_jax.mesh.rules import DEFAULT_RULES, MeshRules, ShardingRules, constrain, logical_to_spec

__all__ = ["DEFAULT_RULES", "Layout", "MeshRules", "ShardingRules", "constrain", "layout_names", "load_layout",
           "logical_to_spec", "make_mesh", "mesh_from_arg"]
