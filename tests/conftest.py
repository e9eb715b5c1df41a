"""Test setup: 8 fake CPU devices (set before JAX is imported) and float32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CLOVER_COMPILE_CACHE", "off")  # tests that need the on-disk cache turn it on themselves
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Most of the suite's time is XLA:CPU compiling small programs that then run for milliseconds: LLVM's cheapest
# code generation compiles them faster (five compile-bound sampler / hybrid tests: 161 s -> 122 s). Results move
# only by float rounding; subprocesses the tests start (notebook kernels, multi-host workers, `clover` runs)
# inherit the flag, so what they compute is compared with programs built the same way.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import contextlib  # noqa: E402
import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

_LIBC = ctypes.util.find_library("c")


_MAPS = "/proc/self/maps"
_MAPS_HIGH = 30_000  # of vm.max_map_count's default 65530


def _free_programs() -> None:
    jax.clear_caches()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError, TypeError):  # glibc only: give the freed heap back
        ctypes.CDLL(_LIBC).malloc_trim(0)


def _mappings() -> int:
    try:
        with open(_MAPS, "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _free_programs_when_mappings_run_high():
    """After a test that leaves the process with many memory mappings (a module that compiles thousands of programs
    reaches tens of thousands alone), drop JAX's compiled programs at once rather than at the module's end."""
    yield
    if _mappings() > _MAPS_HIGH:
        _free_programs()


@pytest.fixture(autouse=True, scope="module")
def _free_programs_between_modules():
    """After each test module (its own fixtures torn down first), drop JAX's compiled programs and trim the heap.

    A worker runs hundreds of tests, and every program they compile (each eager op's included) stays in JAX's caches
    otherwise, with its code mapped into the process: about 6 memory mappings an executable, so a worker that has
    compiled some ten thousand of them reaches Linux's vm.max_map_count (65530), the JIT's next mmap fails and XLA
    crashes with a segmentation fault mid-compile (seen in the full suite, never in a module alone), after the
    worker had also grown to several GB. Each module compiles what it needs again."""
    yield
    _free_programs()


@pytest.fixture(scope="session")
def devices() -> list:
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 fake CPU devices, got {len(devs)}"
    return devs
