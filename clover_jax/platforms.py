"""Which JAX backends a command starts: the ones this host has.

With libtpu installed (the `tpu` extra, which `clover plan` uses to compile for a TPU slice on any host) JAX starts
the TPU runtime on every run, and on a host without a TPU chip libtpu writes half a dozen lines of metadata-server
warnings to stderr before falling back to the CPU. `choose()` keeps the TPU backend out of a run when no TPU chip
is attached (the PCI devices tell, as JAX's own Cloud TPU start-up reads them), so a command's output is only its
own. Compiling for a TPU topology (`clover plan`) does not need the TPU backend started, so it is unaffected.

An explicit `JAX_PLATFORMS` (or `jax_platforms` already set) is left as it is.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path

_GOOGLE_PCI_VENDOR = "0x1ae0"
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def tpu_chips() -> int:
    """TPU chips attached to this host through PCI (Google's vendor id on a PCI device)."""
    n = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            n += Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR
        except OSError:
            continue
    return n


def choose() -> str | None:
    """Set JAX's platforms to the backends this host has, when libtpu is installed (or `TPU_LIBRARY_PATH` names
    one) but no TPU chip is attached (CUDA when a CUDA plugin and an NVIDIA device are present, and the CPU);
    returns the platforms set, or None when it left them to JAX. Call it before any JAX backend starts."""
    import jax

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return None
    libtpu = importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))
    if not libtpu or tpu_chips():
        return None
    gpu = any(importlib.util.find_spec(m) is not None for m in _CUDA_PLUGINS) and any(
        os.path.exists(d) for d in _NVIDIA_DEVICES)
    platforms = "cuda,cpu" if gpu else "cpu"
    jax.config.update("jax_platforms", platforms)
    return platforms


def describe() -> str:
    """One line on the backend a run uses: its platform and devices."""
    import jax

    devices = jax.devices()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    return f"backend {jax.default_backend()}: {len(devices)} device{'s' if len(devices) > 1 else ''} ({kinds})"
