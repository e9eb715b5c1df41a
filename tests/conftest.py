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

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def devices() -> list:
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 fake CPU devices, got {len(devs)}"
    return devs
