"""Compiled programs that outlive the process, under one per-user directory.

Two layers, both keyed so that a stale entry is never used:
  xla/       JAX's persistent compilation cache (compiled executables, keyed by JAX on the HLO), for
             every jitted function;
  programs/  whole compiled programs (`jax.experimental.serialize_executable`), keyed by everything
             their trace depends on: the program's static description, the argument shapes and dtypes,
             the jax / jaxlib versions and the backend's, this package's own source files and whether
             the CPU kernels are in use.
A second process then skips tracing, lowering and compiling: `load_or_compile` returns the compiled
program without running any Python of the model. Entries are executable code: the directory must be
the user's own (it is, by default), as for JAX's own cache.

`configure()` turns it on: `clover` calls it at start-up, Python users may call it themselves. The
place is `$CLOVER_COMPILE_CACHE` (a directory, or `off`), else `$XDG_CACHE_HOME/clover-jax`, else
`~/.cache/clover-jax`; a directory that cannot be written turns the cache off with one warning.
Nothing is cached until `configure()` has run.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jax

ENV = "CLOVER_COMPILE_CACHE"
OFF = ("off", "0", "none", "false", "no")
_DIR: list[str] = []  # the directory in use, when on


def default_dir() -> str:
    """`$XDG_CACHE_HOME/clover-jax`, else `~/.cache/clover-jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "clover-jax")


def configure(setting: str | None = None) -> str | None:
    """Use the cache in `setting` (a directory, or one of `OFF`); None: `$CLOVER_COMPILE_CACHE`, else
    `default_dir()`. Returns the directory in use, or None when the cache is off."""
    value = (os.environ.get(ENV, "") if setting is None else setting).strip()
    _DIR.clear()
    if value.lower() in OFF:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = os.path.abspath(os.path.expanduser(value or default_dir()))
    try:
        os.makedirs(os.path.join(path, "programs"), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        print(f"clover: warning: compile cache {path} is not writable ({e.strerror or e}); compiling from scratch "
              f"(set {ENV}=DIR or {ENV}=off)", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", os.path.join(path, "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program: each one costs seconds
    _DIR.append(path)
    return path


def directory() -> str | None:
    """The cache directory in use, or None when `configure` has not turned it on."""
    return _DIR[0] if _DIR else None


@cache
def source_fingerprint() -> str:
    """A digest of this package's Python and C++ sources and the jax / jaxlib versions: any change to
    the code that traces a program invalidates its serialized form."""
    import jaxlib

    h = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__}".encode())
    root = Path(__file__).resolve().parent
    for f in sorted(p for ext in ("*.py", "*.cc", "*.h") for p in root.rglob(ext)):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def load_or_compile(key: str, fn: Callable[..., tuple], args: Sequence[Any]) -> tuple[Any, bool]:
    """The compiled `jax.jit(fn)` for `args` (a flat sequence of arrays; `fn` returns a flat tuple of
    arrays), and whether it came from the cache. `key` must describe everything else the trace depends
    on (the FFI targets it calls must be registered before a load). A damaged entry is compiled again
    and replaced; a failed write only costs the next process a compile."""
    from jax.experimental import serialize_executable

    cache_dir = directory()
    if cache_dir is None:
        raise RuntimeError("compile_cache.configure() has not turned the cache on")
    device = jax.devices()[0]
    full = f"{source_fingerprint()}\n{device.client.platform} {device.client.platform_version}\n{key}"
    path = os.path.join(cache_dir, "programs", hashlib.sha256(full.encode()).hexdigest()[:40] + ".xla")
    in_tree = jax.tree.structure((tuple(args), {}))
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                n_out = int.from_bytes(f.read(4), "little")
                payload = f.read()
            out_tree = jax.tree.structure(tuple(range(n_out)))
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=[device]), True
        except Exception:  # a torn or foreign file: compile again and overwrite it
            pass
    compiled = jax.jit(fn).lower(*args).compile()
    try:
        payload, _, out_tree = serialize_executable.serialize(compiled)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(out_tree.num_leaves.to_bytes(4, "little"))
            f.write(payload)
        os.replace(tmp, path)
    except Exception:  # not serializable here, or no room: this process still has its program
        pass
    return compiled, False
