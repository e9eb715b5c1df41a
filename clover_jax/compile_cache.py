"""Compiled programs that outlive the process, under one per-user directory.

Two layers, both keyed so that a stale entry is never used:
  xla/       JAX's persistent compilation cache (compiled executables, keyed by JAX on the HLO);
  programs/  traced programs serialized with `jax.export` (StableHLO), keyed by everything the trace
             depends on: the program's static description, the argument shapes and dtypes, the jax and
             jaxlib versions, this package's own source files and whether the CPU kernels are in use.
A second process then skips both tracing and compiling: `load_or_export` returns the traced program
without running any Python of the model.

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


def load_or_export(key: str, fn: Callable[..., Any], args: Sequence[Any],
                   custom_calls: Sequence[str] = ()) -> tuple[jax.export.Exported, bool]:
    """The traced program `fn(*args)` (args: a flat sequence of arrays), and whether it came from the
    cache. `key` must describe everything else the trace depends on; `custom_calls`: the FFI targets
    the program may call (exported with that safety check lifted; they must be registered to run).
    A damaged entry is replaced; a failed write only costs the next process a trace."""
    cache_dir = directory()
    if cache_dir is None:
        raise RuntimeError("compile_cache.configure() has not turned the cache on")
    digest = hashlib.sha256(f"{source_fingerprint()}\n{key}".encode()).hexdigest()[:40]
    path = os.path.join(cache_dir, "programs", f"{digest}.jaxexport")
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                return jax.export.deserialize(bytearray(f.read())), True
        except Exception:  # a torn or foreign file: trace again and overwrite it
            pass
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in custom_calls]
    exp = jax.export.export(jax.jit(fn), disabled_checks=checks)(*args)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(exp.serialize())
        os.replace(tmp, path)
    except OSError:
        pass
    return exp, False
