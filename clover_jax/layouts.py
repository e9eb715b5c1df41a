"""Named mesh layouts: `sharding/NAME.toml` files with a mesh shape, axis names and logical-axis rules.

    --mesh cpu-8          a layout shipped in sharding/
    --mesh path/to.toml   a layout file of your own
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clover_jax.sharding import DEFAULT_RULES, ShardingError

LAYOUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sharding")
MESH_AXES = ("data", "fsdp", "expert", "tensor")


@dataclass(frozen=True)
class Layout:
    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    rules: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_RULES))
    platform: str = "cpu"  # cpu | tpu | gpu
    topology: str | None = None  # e.g. "v5e:2x4" for AOT planning on a TPU topology
    description: str = ""

    @property
    def n_devices(self) -> int:
        return int(np.prod(self.shape))


def layout_names() -> list[str]:
    if not os.path.isdir(LAYOUT_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(LAYOUT_DIR) if f.endswith(".toml"))


def load_layout(name_or_path: str) -> Layout:
    path = name_or_path if name_or_path.endswith(".toml") else os.path.join(LAYOUT_DIR, f"{name_or_path}.toml")
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
    rules = dict(DEFAULT_RULES)
    for k, v in doc.get("rules", {}).items():
        rules[k] = None if v in ("", "none", None) else (tuple(v) if isinstance(v, list) else v)
    return Layout(name=os.path.basename(path)[:-5], shape=shape, axes=axes, rules=rules,
                  platform=doc.get("platform", "cpu"), topology=doc.get("topology"),
                  description=doc.get("description", ""))


def make_mesh(layout: Layout, devices: list | None = None):
    """A jax Mesh over the first prod(shape) devices (all processes' devices on multi-host)."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices() if devices is None else devices
    if len(devices) < layout.n_devices:
        raise ShardingError(f"layout {layout.name!r} needs {layout.n_devices} devices {layout.shape}, "
                            f"but {len(devices)} are available")
    arr = np.array(devices[: layout.n_devices]).reshape(layout.shape)
    return Mesh(arr, layout.axes)


def add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default=None,
                        help="mesh layout: a name from sharding/ (e.g. cpu-8) or a .toml path; default: one device")
