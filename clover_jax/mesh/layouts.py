"""Named mesh layouts: `sharding/NAME.toml` files with a mesh shape, axis names and logical-axis rules.

    --mesh cpu-8          a layout shipped in sharding/ (package data: works from any directory)
    --mesh path/to.toml   a layout file of your own

A layout is a description (`Layout`); `Layout.mesh_rules()` makes the concrete mesh and pairs it with
the layout's rules, the `MeshRules` that the model and the sampler take as `mesh=`.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from clover_jax.errors import ShardingError
from clover_jax.mesh.rules import DEFAULT_RULES, MeshRules, ShardingRules, as_tuple
from clover_jax.shipped import LAYOUT_DIR

MESH_AXES = ("data", "fsdp", "expert", "tensor")
PLATFORMS = ("cpu", "tpu", "gpu")


@dataclass(frozen=True)
class Layout:
    """A mesh layout as a `sharding/NAME.toml` file describes it: mesh shape and axes, logical-axis rules,
    platform and planning hints."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    rules: ShardingRules = DEFAULT_RULES
    platform: str = "cpu"  # cpu | tpu | gpu
    topology: str | None = None  # e.g. "v5e:2x4" for AOT planning on a TPU topology
    description: str = ""
    chip: str | None = None  # key into plan.CHIPS (v5e, v5p, v6e, h100, h200, cpu) for planning

    @property
    def n_devices(self) -> int:
        """Devices the mesh needs: the product of `shape`."""
        return int(np.prod(self.shape))

    def mesh_rules(self, devices: list | None = None) -> MeshRules:
        """The layout's mesh over `devices` (default all), with its rules."""
        return MeshRules(make_mesh(self, devices), self.rules)


def layout_names() -> list[str]:
    """The layouts shipped in sharding/."""
    if not LAYOUT_DIR.is_dir():
        return []
    return sorted(p.stem for p in LAYOUT_DIR.glob("*.toml"))


def load_layout(name_or_path: str) -> Layout:
    """A shipped layout by name, or a .toml file; ShardingError naming the problem otherwise."""
    path = name_or_path if name_or_path.endswith(".toml") else str(LAYOUT_DIR / f"{name_or_path}.toml")
    if not os.path.exists(path):
        raise ShardingError(f"unknown mesh layout {name_or_path!r}; known: {', '.join(layout_names())} "
                            "(or pass a path to a .toml file)")
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    mesh = doc.get("mesh", {})
    shape, axes = tuple(mesh.get("shape", ())), tuple(mesh.get("axes", ()))
    if not shape or len(shape) != len(axes):
        raise ShardingError(f"layout {path}: [mesh] needs `shape` and `axes` of the same length")
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
        raise ShardingError(f"layout {path}: unknown mesh axes {bad}; use {MESH_AXES}")
    if not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ShardingError(f"layout {path}: mesh shape {list(shape)} must be positive integers")
    if len(set(axes)) != len(axes):
        raise ShardingError(f"layout {path}: mesh axes {list(axes)} repeat a name")
    table: dict[str, Any] = {}
    for k, v in doc.get("rules", {}).items():
        table[k] = None if v in ("", "none", None) else (tuple(v) if isinstance(v, list) else v)
        for ax in as_tuple(table[k]):
            if ax not in MESH_AXES:
                raise ShardingError(f"layout {path}: rule {k} = {v!r} names unknown mesh axis {ax!r}; "
                                    f"use {MESH_AXES}")
    rules = ShardingRules.from_mapping(table, where=f"layout {path} [rules]")
    platform = doc.get("platform", "cpu")
    if platform not in PLATFORMS:
        raise ShardingError(f"layout {path}: platform {platform!r} must be one of {PLATFORMS}")
    topology = doc.get("topology")
    if platform == "tpu" and topology:
        dims = topology.split(":")[-1].split("x")
        if not all(d.isdigit() for d in dims) or int(np.prod([int(d) for d in dims])) != int(np.prod(shape)):
            raise ShardingError(f"layout {path}: topology {topology!r} does not hold the {int(np.prod(shape))} "
                                f"devices of mesh {list(shape)}")
    return Layout(name=os.path.basename(path)[:-5], shape=shape, axes=axes, rules=rules,
                  platform=platform, topology=topology, description=doc.get("description", ""),
                  chip=doc.get("chip"))


def make_mesh(layout: Layout, devices: list | None = None) -> Mesh:
    """A jax Mesh over the first prod(shape) devices (all processes' devices on multi-host)."""
    devices = jax.devices() if devices is None else devices
    if len(devices) < layout.n_devices:
        hint = (f" (on a CPU host, fake devices: XLA_FLAGS=--xla_force_host_platform_device_count={layout.n_devices})"
                if devices and devices[0].platform == "cpu" else "")
        raise ShardingError(f"layout {layout.name!r} needs {layout.n_devices} devices {layout.shape}, "
                            f"but {len(devices)} are available{hint}")
    devices = list(devices[: layout.n_devices])
    if devices[0].platform == "tpu":
        # Physical-torus-aware order: a logical axis should follow whole ICI rings where it can.
        arr = mesh_utils.create_device_mesh(layout.shape, devices, allow_split_physical_axes=True)
    else:
        arr = np.array(devices).reshape(layout.shape)
    return Mesh(arr, layout.axes)


def add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    """Add the optional `--mesh` flag (a layout name or .toml path; default one device) to `parser`."""
    parser.add_argument("--mesh", default=None,
                        help="mesh layout: a name from sharding/ (e.g. cpu-8) or a .toml path; default: one device")


def mesh_from_arg(name_or_path: str | None, devices: list | None = None) -> MeshRules | None:
    """The MeshRules of a `--mesh` value, or None without one. Raises ShardingError (say it as one line).

    Typical command body:
        mesh = layouts.mesh_from_arg(args.mesh)
        shardings = None if mesh is None else params.weight_shardings(cfg, mesh.mesh, mesh.rules)
        weights = params.init(cfg, key, shardings)        # or restore into `shardings`
        generate(weights, cfg, prompts, sc, mesh=mesh)
    """
    if name_or_path is None:
        return None
    layout = load_layout(name_or_path)
    init_distributed_from_env(layout)
    return layout.mesh_rules(devices)


def init_distributed_from_env(layout: Layout | None = None) -> bool:
    """Join a multi-process JAX job when $CLOVER_DISTRIBUTED=1 (call before anything touches a device).

    On TPU pods, SLURM or other clusters JAX finds the coordinator itself; elsewhere set
    CLOVER_COORDINATOR=host:port, CLOVER_NUM_PROCESSES and CLOVER_PROCESS_ID. CPU layouts use gloo
    collectives. Every process runs the same command; the mesh then spans all processes' devices.
    """
    if os.environ.get("CLOVER_DISTRIBUTED", "") not in ("1", "true", "yes"):
        return False
    if jax.distributed.is_initialized():
        return True
    if layout is not None and layout.platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {}
    if os.environ.get("CLOVER_COORDINATOR"):
        try:
            kwargs = dict(coordinator_address=os.environ["CLOVER_COORDINATOR"],
                          num_processes=int(os.environ["CLOVER_NUM_PROCESSES"]),
                          process_id=int(os.environ["CLOVER_PROCESS_ID"]))
        except (KeyError, ValueError) as e:
            raise ShardingError("CLOVER_COORDINATOR needs integer CLOVER_NUM_PROCESSES and CLOVER_PROCESS_ID "
                                f"({e})") from e
    timeout = os.environ.get("CLOVER_DISTRIBUTED_TIMEOUT_S")
    if timeout:
        kwargs["initialization_timeout"] = int(timeout)
    jax.distributed.initialize(**kwargs)
    return True
