"""Checks that a native checkpoint directory is whole, before Orbax or tensorstore read any of it.

A damaged checkpoint (a deleted or truncated weight file, a missing Orbax metadata file, a config.json
that does not parse) otherwise surfaces as a long Orbax / tensorstore traceback that rarely names the
file at fault. `verify` names it in one line instead.

Saves record a manifest of the weights directory, `weights/clover_manifest.json`: every file under
weights/ (its path relative to weights/, `/`-separated) with its size in bytes. Sizes only, no
checksums: checking them is a stat per file, cheap for checkpoints of any size, and it catches what
actually happens to checkpoints (interrupted copies and syncs, deleted or truncated files); a checksum
would mean reading every byte on each load. Checkpoints written before the manifest existed are
checked for the Orbax files that must exist and for empty files only.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from clover_jax.errors import CheckpointError, CloverError

CONFIG_FILE = "config.json"
WEIGHTS_DIR = "weights"
MANIFEST_FILE = "clover_manifest.json"  # inside WEIGHTS_DIR, next to the files it lists
MANIFEST_FORMAT = 1
ORBAX_METADATA = "_METADATA"  # the tree of the saved arrays: every Orbax checkpoint has one
OCDBT_MANIFEST = "manifest.ocdbt"  # the root of an OCDBT database (the default format)

_REDO = "the checkpoint is damaged: re-create it (or re-convert it from its source)"
_MAYBE = "the checkpoint may be damaged: re-create it (or re-convert it from its source)"


def weights_files(wdir: str) -> dict[str, int]:
    """{path relative to `wdir` ('/'-separated): size in bytes} of every file under `wdir`, sorted by
    path; the manifest itself left out."""
    found = {}
    for root, dirs, files in os.walk(wdir):
        dirs.sort()
        for name in files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, wdir).replace(os.sep, "/")
            if rel != MANIFEST_FILE:
                found[rel] = os.path.getsize(full)
    return dict(sorted(found.items()))


def write_manifest(wdir: str) -> str:
    """Write the manifest of the finished weights directory `wdir` (after Orbax has written all of it);
    returns its path. Deterministic: the same files give the same bytes."""
    files = weights_files(wdir)
    doc = {"format": MANIFEST_FORMAT, "total_bytes": sum(files.values()), "files": files}
    out = os.path.join(wdir, MANIFEST_FILE)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    return out


def verify(path: str) -> str:
    """Check the native checkpoint at `path` without Orbax; returns the absolute weights directory.

    Raises a one-line CheckpointError naming the first problem found:
      - `path` is not a directory, has no config.json, or has no weights/ directory;
      - config.json cannot be read or is not a JSON object (the JSON error and its position);
      - an Orbax file that must exist is missing (weights/_METADATA; weights/manifest.ocdbt when the
        checkpoint is OCDBT, the format Clover-JAX writes) or does not parse (_METADATA);
      - with a manifest (weights/clover_manifest.json): a file it lists is missing or has another size
        (expected and actual size); without one (checkpoints from before the manifest): a file is empty,
        or there are no data files at all.
    Whether the config is a valid ModelConfig, and whether the weights match it, is left to the loaders.
    """
    path = os.path.abspath(path)  # Orbax resolves relative paths against its own idea of the cwd
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} is not a native checkpoint: no {CONFIG_FILE}")
    _read_json(cfg_path, f"{cfg_path} is not a valid config")
    wdir = os.path.join(path, WEIGHTS_DIR)
    if not os.path.isdir(wdir):
        hint = (" (it looks like a HuggingFace checkpoint: run `clover convert` first)"
                if any(f.endswith(".safetensors") for f in os.listdir(path)) else "")
        raise CheckpointError(f"{path!r} is not a native checkpoint: no {WEIGHTS_DIR}/ directory{hint}")
    where = f"checkpoint {path}"
    meta_path = os.path.join(wdir, ORBAX_METADATA)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{where}: the Orbax metadata file {WEIGHTS_DIR}/{ORBAX_METADATA} is missing; {_REDO}")
    meta = _read_json(meta_path, f"{where}: the Orbax metadata file {WEIGHTS_DIR}/{ORBAX_METADATA} is damaged")
    if meta.get("use_ocdbt", True) and not os.path.isfile(os.path.join(wdir, OCDBT_MANIFEST)):
        raise CheckpointError(f"{where}: the Orbax file {WEIGHTS_DIR}/{OCDBT_MANIFEST} is missing; {_REDO}")
    manifest_path = os.path.join(wdir, MANIFEST_FILE)
    if os.path.isfile(manifest_path):
        _check_manifest(where, wdir, manifest_path)
    else:
        _check_without_manifest(where, wdir)
    return wdir


def _read_json(path: str, what: str) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError starting with `what` if it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what}: invalid JSON at line {e.lineno} column {e.colno} (char {e.pos}): "
                              f"{e.msg}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CheckpointError(f"{what}: cannot read it: {e.strerror or e}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{what}: expected a JSON object, found {type(doc).__name__}")
    return doc


def _check_manifest(where: str, wdir: str, manifest_path: str) -> None:
    doc = _read_json(manifest_path, f"{where}: the weights manifest {WEIGHTS_DIR}/{MANIFEST_FILE} is damaged")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, int) for v in files.values()):
        raise CheckpointError(f"{where}: the weights manifest {WEIGHTS_DIR}/{MANIFEST_FILE} is damaged: "
                              "no {file: size} table")
    for rel, size in files.items():
        full = os.path.join(wdir, *rel.split("/"))
        try:
            actual = os.path.getsize(full)
        except OSError:
            raise CheckpointError(f"{where}: {WEIGHTS_DIR}/{rel} is missing (the manifest expects {size} bytes); "
                                  f"{_REDO}") from None
        if actual != size:
            short = "truncated" if actual < size else "the wrong size"
            raise CheckpointError(f"{where}: {WEIGHTS_DIR}/{rel} is {short}: {actual} bytes, the manifest expects "
                                  f"{size}; {_REDO}")


def _check_without_manifest(where: str, wdir: str) -> None:
    files = weights_files(wdir)
    empty = [rel for rel, size in files.items() if size == 0]
    if empty:
        raise CheckpointError(f"{where}: {WEIGHTS_DIR}/{empty[0]} is empty (0 bytes); {_REDO}")
    if not any(rel.startswith("d/") or "/d/" in rel for rel in files) and \
            not any(rel.endswith((".zarray", "zarr.json")) for rel in files):
        raise CheckpointError(f"{where}: {WEIGHTS_DIR}/ holds no weight data files (no d/ directory); {_REDO}")


def first_line(e: BaseException) -> str:
    """The first non-empty line of the innermost exception behind `e` (Orbax wraps tensorstore's
    precise message in its own), at most 400 characters; the exception's type name if it has no text."""
    seen = {id(e)}
    while True:
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        e = nxt
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    return line if len(line) <= 400 else line[:397] + "..."


@contextlib.contextmanager
def orbax_errors(path: str, what: str) -> Iterator[None]:
    """Turn any exception from Orbax / tensorstore inside the block into a one-line CheckpointError
    naming `what`, the checkpoint directory `path` and the first line of the underlying error (the last
    line of defence behind `verify`: content damage that keeps every file's size, say)."""
    try:
        yield
    except CloverError:
        raise
    except Exception as e:  # Orbax and tensorstore raise assorted types for a damaged directory
        line = first_line(e)
        hint = f"; {_MAYBE}" if "Error reading" in line else ""  # tensorstore's word for a bad file
        raise CheckpointError(f"cannot read {what} of checkpoint {os.path.abspath(path)}: {line}{hint}") from None
