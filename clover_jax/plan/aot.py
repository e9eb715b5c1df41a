"""Compiling a pass for a TPU topology on any host: libtpu describes the slice, `jit(...).lower(...)
.compile()` for it returns the TPU compiler's own memory and cost analysis, and a compiler "ran out of
memory" is reported as the honest "does not fit"."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding

from clover_jax.config import ModelConfig
from clover_jax.errors import PlanError
from clover_jax.mesh.layouts import Layout, make_mesh
from clover_jax.mesh.rules import MeshRules, ShardingRules, logical_to_spec
from clover_jax.model import cache as kv_cache
from clover_jax.model import transformer
from clover_jax.plan.arithmetic import PassShape


def libtpu_available() -> bool:
    """Whether libtpu is installed (the `tpu` extra), so TPU topologies can be compiled for."""
    return importlib.util.find_spec("libtpu") is not None


def _quiet_libtpu_env() -> None:
    # Another process on this host may hold libtpu's lock file (any JAX process that probed for a
    # TPU); planning only compiles, so sharing is safe. The rest silences "no TPU metadata" noise.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def topology_mesh(layout: Layout) -> jax.sharding.Mesh:
    """A Mesh of the layout's TPU topology (no TPU needed: libtpu describes it)."""
    if not layout.topology:
        raise PlanError(f"layout {layout.name!r} has no `topology` (e.g. \"v5e:2x4\") to compile for")
    if not libtpu_available():
        raise PlanError("compiling for a TPU topology needs libtpu: pip install 'jax[tpu]==<your jax version>'")
    _quiet_libtpu_env()
    with _captured_stderr() as log:
        try:
            topo = topologies.get_topology_desc(layout.topology, "tpu")
        except Exception as e:
            raise PlanError(f"libtpu could not describe topology {layout.topology!r}: {e}\n{log()}") from e
    return make_mesh(layout, list(topo.devices))


@contextlib.contextmanager
def _captured_stderr() -> Iterator[Callable[[], str]]:
    """libtpu's C++ start-up prints metadata-server warnings that mean nothing on a planning host:
    hold file descriptor 2 in a temp file, and hand the text back only if something fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@dataclass
class Compiled:
    """One AOT compile: whether it fit, how long it took, and the compiler's own analyses."""

    ok: bool
    seconds: float
    memory: dict[str, int] = field(default_factory=dict)
    flops: float | None = None
    bytes_accessed: float | None = None
    error: str = ""
    device_kind: str = ""

    @property
    def hbm_bytes(self) -> int:
        """Per-chip HBM the compiled program needs (arguments + outputs + temporaries - aliases + code)."""
        m = self.memory
        return (m.get("argument_size_in_bytes", 0) + m.get("output_size_in_bytes", 0)
                + m.get("temp_size_in_bytes", 0) - m.get("alias_size_in_bytes", 0)
                + m.get("generated_code_size_in_bytes", 0))


OOM = re.compile(r"(ran out of memory|resource_exhausted|exceeds the memory|out of memory)", re.IGNORECASE)


def _pass_fn(cfg: ModelConfig, p: PassShape, dispatch: str, mesh: MeshRules) -> Callable:
    def fn(weights, tokens, positions, mask, cache, offset):
        out = transformer.forward(weights, cfg, tokens, positions, mask, cache, offset,
                                  logits_start=p.window - p.logits_len if not p.cached else 0,
                                  logits_len=p.logits_len, dispatch=dispatch, mesh=mesh)
        return out.logits, out.cache

    return fn


def abstract_inputs(cfg: ModelConfig, p: PassShape, mesh: Any, rules: ShardingRules) -> tuple:
    """ShapeDtypeStructs (with shardings) for tokens, positions, mask, cache, offset."""

    def sds(shape, dtype, axes):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, logical_to_spec(axes, rules, mesh)))

    b, w = p.batch, p.window
    tokens = sds((b, w), jnp.int32, ("batch", "seq"))
    positions = sds((b, w), jnp.int32, ("batch", "seq"))
    mask = sds((b, w, p.kv_len), jnp.bool_, ("batch", "seq", None))
    # the cache as the sampler and the server place it (`model.cache.shardings`)
    cache = kv_cache.abstract(cfg, b, p.kv_len, MeshRules(mesh, rules)) if p.cached else None
    offset = sds((), jnp.int32, ())
    return tokens, positions, mask, cache, offset


def compile_pass(cfg: ModelConfig, p: PassShape, mesh: Any, rules: ShardingRules, weight_structs: Any,
                 dispatch: str) -> Compiled:
    """AOT-compile one pass for the mesh's devices; a compiler OOM comes back as ok=False."""
    args = (weight_structs, *abstract_inputs(cfg, p, mesh, rules))
    jitted = jax.jit(_pass_fn(cfg, p, dispatch, MeshRules(mesh, rules)), donate_argnums=(4,) if p.cached else ())
    return compile_jitted(jitted, args, mesh)


def compile_jitted(jitted: Any, args: tuple, mesh: Any) -> Compiled:
    """`jitted.lower(*args).compile()` for the devices of `mesh` (args: abstract values, static ones as the
    function takes them), with the compiler's memory and cost analyses; a compiler "out of memory" comes
    back as ok=False with its first line, any other failure is raised."""
    t0 = time.perf_counter()
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as e:  # the TPU compiler reports OOM as a JaxRuntimeError / XlaRuntimeError
        msg = str(e)
        if OOM.search(msg):
            first = next((ln.strip() for ln in msg.splitlines() if OOM.search(ln)), msg.splitlines()[0])
            return Compiled(False, time.perf_counter() - t0, error=first[:400])
        raise
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    memory = {k: int(getattr(mem, k)) for k in dir(mem) if k.endswith("_in_bytes")} if mem is not None else {}
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    cost = cost or {}
    kind = str(getattr(mesh.devices.flat[0], "device_kind", ""))
    return Compiled(True, seconds, memory, cost.get("flops"), cost.get("bytes accessed"), device_kind=kind)
