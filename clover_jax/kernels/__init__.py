"""Native CPU kernels for what XLA:CPU does slowly, built on first use and falling back cleanly.

XLA:CPU runs a matmul whose operand is a dynamic slice (one expert's rows, one expert's weights)
on a single thread and copies the sliced weights first; the grouped SwiGLU in `grouped_swiglu.cc`
multiplies each expert's group in place, its rows split over XLA's own thread pool, with the small
register-blocked GEMM of `gemm.h`. It is compiled once per source/jaxlib version with the
machine's C++ compiler (-march=native) against jaxlib's own XLA FFI headers and cached under
$CLOVER_JAX_CACHE (default ~/.cache/clover_jax).

Nothing here is required: without a compiler (or if the build fails), `available()` is False, the
reason is logged once (and kept in `unavailable_reason()`), and callers use their pure-JAX path;
CLOVER_KERNELS=0 switches the kernels off (CLOVER_NATIVE=0, the old spelling, too).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

# FFI target names -> the handler symbols of the library
GROUPED_SWIGLU = "clover_grouped_swiglu_f32"
_TARGETS = {GROUPED_SWIGLU: "CloverGroupedSwiglu"}
_HERE = Path(__file__).parent
_COMPILED = (_HERE / "grouped_swiglu.cc",)
_SOURCES = (*_COMPILED, _HERE / "gemm.h", _HERE / "parallel.h")
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
# glibc's vector math library: -ffast-math vectorises the SiLU's expf through it.
_LIBS = ("-lmvec",) if sys.platform.startswith("linux") else ()
_reason: list[str] = []


def unavailable_reason() -> str | None:
    """Why the CPU kernels failed to load (None if they loaded, or nobody asked yet)."""
    return _reason[0] if _reason else None


def _cache_dirs() -> list[Path]:
    """Where builds are kept: $CLOVER_JAX_CACHE, else ~/.cache/clover_jax, then the temp directory
    (a read-only or full home directory should not cost the kernels)."""
    user = os.environ.get("CLOVER_JAX_CACHE")
    first = Path(user) if user else Path.home() / ".cache" / "clover_jax"
    user_id = os.getuid() if hasattr(os, "getuid") else "user"
    return [first / "kernels", Path(tempfile.gettempdir()) / f"clover_jax-{user_id}" / "kernels"]


def _cpu_model() -> str:
    """The CPU's model name and feature flags, where Linux tells them."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return " ".join(sorted({ln for ln in info if ln.startswith(("model name", "flags"))}))


def _build(compiler: str) -> Path:
    """The compiled library, built now unless this exact build is cached (written atomically)."""
    source = b"".join(p.read_bytes() for p in _SOURCES)
    # -march=native: the build is only good for this CPU model (a home directory may be shared).
    key = " ".join((compiler, *_FLAGS, *_LIBS, jaxlib.__version__, platform.machine(), _cpu_model()))
    key = hashlib.sha256(source + key.encode()).hexdigest()[:16]
    name = f"clover_kernels-{key}.so"
    for folder in _cache_dirs():
        if (folder / name).exists():
            return folder / name
    for folder in _cache_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as err:  # unwritable: try the next place
            log.info("cannot build into %s (%s)", folder, err)
            continue
        return _compile(compiler, folder / name)
    raise RuntimeError(f"no writable directory to build the kernels into: {[str(f) for f in _cache_dirs()]}")


def _compile(compiler: str, lib: Path) -> Path:
    log.info("building clover_jax's CPU kernels into %s (once per machine, a few seconds)", lib)
    fd, tmp = tempfile.mkstemp(dir=lib.parent, prefix=lib.name, suffix=".tmp")
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _COMPILED), "-o", tmp, *_LIBS]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, lib)  # concurrent builders race harmlessly: each rename is whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def available() -> bool:
    """Whether the kernels are loaded (built on the first call) and not switched off (CLOVER_KERNELS=0 or
    `switched_off()`). Read when a function is traced: switch before a jitted function's first call."""
    return not _OFF and not _off_by_env() and _load()


def _off_by_env() -> bool:
    return "0" in (os.environ.get("CLOVER_KERNELS"), os.environ.get("CLOVER_NATIVE"))  # NATIVE: the old name


_OFF: list[bool] = []


@contextmanager
def switched_off() -> Iterator[None]:
    """Functions traced inside take their pure-JAX paths (to compare the two, as benchmarks/forward.py does)."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else c++ or g++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@cache
def _load() -> bool:
    compiler_ = compiler()
    try:
        if compiler_ is None:
            raise RuntimeError("no C++ compiler (set CXX or install g++)")
        lib = ctypes.CDLL(str(_build(compiler_)))
        for name, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as err:  # any failure: the pure-JAX path is always there
        _reason.append(f"{type(err).__name__}: {err}")
        log.warning("clover_jax CPU kernels unavailable, using the pure-JAX path: %s", _reason[0])
        return False
    _LOADED.append(lib)  # keep the library mapped for the process's life
    return True


_LOADED: list[ctypes.CDLL] = []


def _varying(a: jax.Array) -> frozenset:
    """The shard_map mesh axes `a` varies over (empty outside shard_map)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10; older releases call it `vma`
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(t, "vma", ()))


def _call(target: str, out_shape: tuple[int, ...], *args: jax.Array) -> jax.Array:
    """ffi_call with shard_map's varying-axes typing: inside shard_map every operand and the result
    vary over the union of the operands' varying mesh axes (an FFI call does not infer it)."""
    vma = frozenset().union(*map(_varying, args))
    if vma:
        args = tuple(a if _varying(a) == vma else jax.lax.pcast(a, tuple(vma - _varying(a)), to="varying")
                     for a in args)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, args[0].dtype), vmap_method="sequential")(*args)
    return jax.lax.pcast(out, tuple(vma), to="varying") if vma else out


def grouped_swiglu(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, layer: jax.Array,
                   sizes: jax.Array) -> jax.Array:
    """rows [R, D] sorted by expert, group sizes [E] (int32), weights stacked over layers (gate/up
    [L, E, D, F], down [L, E, F, D], float32), `layer` an int32 scalar -> [R, D]; rows past the last
    group come out zero. CPU only; check `available()` first."""
    return _call(GROUPED_SWIGLU, rows.shape, rows, gate, up, down, layer, sizes)

