"""The CPU kernel of the grouped SwiGLU (clover_jax.kernels): exact against float64 numpy on every code path of
its GEMM, read from the right layer, used only where it applies, and a clean fallback without it."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from clover_jax import kernels
from clover_jax.model import moe

HAVE_COMPILER = kernels.compiler() is not None
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: clover_jax uses its pure-JAX path")


def _problem(d: int, f: int, sizes: list[int], pad: int = 0, n_layers: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    e = len(sizes)
    rows = rng.standard_normal((sum(sizes) + pad, d)).astype(np.float32)
    gate, up = (rng.normal(0, d ** -0.5, (n_layers, e, d, f)).astype(np.float32) for _ in range(2))
    down = rng.normal(0, f ** -0.5, (n_layers, e, f, d)).astype(np.float32)
    return rows, np.asarray(sizes, np.int32), gate, up, down


def _numpy_swiglu(rows, sizes, gate, up, down, layer: int) -> np.ndarray:
    r, g, u, dn = (np.asarray(a, np.float64) for a in (rows, gate[layer], up[layer], down[layer]))
    out, start = np.zeros_like(r), 0
    for e, n in enumerate(sizes):
        x = r[start:start + n]
        h = x @ g[e]
        out[start:start + n] = (h / (1 + np.exp(-h)) * (x @ u[e])) @ dn[e]
        start += n
    return out


@needs_compiler
@pytest.mark.parametrize(("d", "f", "sizes"), [
    (16, 24, [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 0, 64, 70, 5]),  # narrower than a panel: edge columns only
    (40, 48, [13, 0, 25, 1, 12]),  # whole panels plus edge columns; full 12-row blocks plus short tails
    (2080, 48, [3, 1030]),  # k so deep that B is walked in column blocks; a group longer than one chunk
])
def test_kernel_grouped_swiglu_against_numpy(d: int, f: int, sizes: list[int]) -> None:
    rows, sizes_, gate, up, down = _problem(d, f, sizes, pad=5)
    fn = jax.jit(moe.grouped_swiglu)
    assert kernels.available(), kernels.unavailable_reason()
    assert kernels.GROUPED_SWIGLU in fn.lower(rows, sizes_, gate, up, down, 1).as_text()
    y = np.asarray(fn(rows, sizes_, gate, up, down, 1))
    want = _numpy_swiglu(rows, sizes_, gate, up, down, layer=1)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not y[sum(sizes):].any()  # rows past the last group (padding) come out zero


@needs_compiler
def test_kernel_is_used_only_where_it_applies(monkeypatch) -> None:
    rows, sizes, gate, up, down = _problem(16, 24, [3, 5])
    # A fresh function each time: JAX reuses a function's trace, and the switch is read while tracing.
    lowered = lambda *a: jax.jit(lambda *a: moe.grouped_swiglu(*a)).lower(*a, 0).as_text()
    assert kernels.GROUPED_SWIGLU in lowered(rows, sizes, gate, up, down)
    bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (rows, gate, up, down)]
    assert kernels.GROUPED_SWIGLU not in lowered(bf16[0], sizes, *bf16[1:])  # float32 only
    with kernels.switched_off():
        assert kernels.GROUPED_SWIGLU not in lowered(rows, sizes, gate, up, down)
    assert kernels.GROUPED_SWIGLU in lowered(rows, sizes, gate, up, down)
    monkeypatch.setenv("CLOVER_NATIVE", "0")  # the old name of the switch
    assert kernels.GROUPED_SWIGLU not in lowered(rows, sizes, gate, up, down)
    monkeypatch.delenv("CLOVER_NATIVE")
    monkeypatch.setenv("CLOVER_KERNELS", "0")
    assert kernels.GROUPED_SWIGLU not in lowered(rows, sizes, gate, up, down)
    walk = jax.jit(lambda *a: moe.grouped_swiglu(*a))(rows, sizes, gate, up, down, 0)
    monkeypatch.delenv("CLOVER_KERNELS")
    again = jax.jit(lambda *a: moe.grouped_swiglu(*a))(rows, sizes, gate, up, down, 0)
    np.testing.assert_allclose(again, walk, rtol=1e-5, atol=1e-6)


@needs_compiler
def test_kernel_refuses_group_sizes_beyond_the_rows() -> None:
    rows, _, gate, up, down = _problem(16, 24, [3, 5])
    with pytest.raises(Exception, match="group sizes exceed the rows"):
        jax.block_until_ready(jax.jit(moe.grouped_swiglu)(rows, np.array([3, 6], np.int32), gate, up, down, 0))


@needs_compiler
def test_kernel_under_vmap_and_sharding(devices) -> None:
    rows, sizes, gate, up, down = _problem(16, 32, [10, 0, 14, 8])
    want = _numpy_swiglu(rows, sizes, gate, up, down, layer=1)
    batch = np.stack([rows, rows[::-1]])
    batched = jax.vmap(moe.grouped_swiglu, in_axes=(0, None, None, None, None, None))
    y = jax.jit(batched)(batch, sizes, gate, up, down, 1)
    np.testing.assert_allclose(y[0], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y[1], _numpy_swiglu(batch[1], sizes, gate, up, down, 1), rtol=1e-4, atol=1e-5)
    # Rows split over 8 devices, experts over 2: the call still sees whole operands and agrees.
    mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "expert"))  # as clover_jax.mesh.layouts builds them
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec)))
    sharded = [put(w, None, "expert") for w in (gate, up, down)]
    y = jax.jit(moe.grouped_swiglu)(put(rows, ("data", "expert")), sizes, *sharded, 1)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


@needs_compiler
def test_unwritable_cache_builds_in_the_temp_directory(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # CLOVER_JAX_CACHE names a file: no directory can be made there
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(blocker))
    first, fallback = kernels._cache_dirs()
    lib = kernels._build(kernels.compiler())
    assert lib.is_file() and lib.parent == fallback and first.parent == blocker


def test_failed_build_falls_back_to_pure_jax(tmp_path) -> None:
    """A compiler that fails: no target, the reason logged, and the right numbers from the JAX walk."""
    rows, sizes, gate, up, down = _problem(16, 8, [12, 8], n_layers=1)
    np.savez(tmp_path / "problem.npz", rows=rows, sizes=sizes, gate=gate, up=up, down=down)
    script = f"""
import numpy as np, jax
from clover_jax import kernels
from clover_jax.model import moe
p = np.load({str(tmp_path / "problem.npz")!r})
y = jax.jit(moe.grouped_swiglu)(p["rows"], p["sizes"], p["gate"], p["up"], p["down"], 0)
np.save({str(tmp_path / "y.npy")!r}, np.asarray(y))
print("available", kernels.available())
print("reason", kernels.unavailable_reason())
"""
    cache = tmp_path / "cache"
    env = {**os.environ, "CXX": "false", "CLOVER_JAX_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "available False" in out.stdout
    assert "reason RuntimeError: false" in out.stdout and "failed" in out.stdout
    assert "CPU kernels unavailable" in out.stderr
    assert not list(cache.rglob("*.so")) and not list(cache.rglob("*.tmp"))  # nothing half-written left
    want = _numpy_swiglu(rows, sizes, gate, up, down, layer=0)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-4, atol=1e-5)
