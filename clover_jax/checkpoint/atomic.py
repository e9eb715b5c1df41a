"""Atomic directories: everything is written into `<dest>.tmp-<random>` next to the destination and
renamed into place at the end, so a failed or killed write never leaves a half-written destination,
and an existing destination survives any failure before the swap. Works across processes.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import uuid
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from clover_jax.errors import CheckpointError
from clover_jax.paths import unwritable_reason


def sync_processes(tag: str) -> None:
    """Barrier across processes (no-op in a single-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(tag)


def _shared_token() -> str:
    """A random token that every process agrees on (process 0's draw)."""
    token = int(share_from_primary(np.array(uuid.uuid4().int & 0x7FFFFFFF, dtype=np.int32)))
    return f"{token:08x}"


def share_from_primary(value: np.ndarray) -> np.ndarray:
    """Process 0's `value` in every process (itself in a single-process run); a collective: every process calls
    it with an array of the same shape and dtype."""
    if jax.process_count() > 1 and value.size:
        return np.asarray(multihost_utils.broadcast_one_to_all(value))
    return value


def is_primary() -> bool:
    """Whether this is process 0 (the one that creates, renames and writes shared files)."""
    return jax.process_index() == 0


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_destination(dest: str, force: bool, sources: Sequence[str] = (), what: str = "destination") -> str:
    """Refuse, before any work, a `dest` that would lose the user's data or cannot be written; returns
    its absolute path. CheckpointError when `dest` holds anything and not `force`, when it is a source,
    inside one or holds one (replacing it would delete the source), or when its parent cannot be written."""
    dest = os.path.abspath(dest)
    real = os.path.realpath(dest)
    for src in sources:
        s = os.path.realpath(src)
        if _inside(real, s) or _inside(s, real):
            relation = "is" if real == s else "lies inside" if _inside(real, s) else "holds"
            raise CheckpointError(f"{what} {dest} {relation} the source {os.path.abspath(src)}: choose another {what}")
    if os.path.lexists(dest) and not force:
        raise CheckpointError(f"{what} {dest} already exists (pass --force to replace it; the old copy stays "
                              "until the new one is complete)")
    reason = unwritable_reason(dest)
    if reason:
        raise CheckpointError(f"{what} {dest}: {reason}")
    return dest


def stale_temporaries(dest: str) -> list[str]:
    """`<dest>.tmp-*` directories that an earlier killed write left behind."""
    return sorted(glob.glob(glob.escape(os.path.abspath(dest)) + ".tmp-*"))


def report_stale(dest: str, force: bool, keep: str | None = None) -> None:
    """Warn about the unfinished `<dest>.tmp-*` of earlier killed runs (other than `keep`, one being continued),
    or remove them when `force`; process 0 only."""
    stale = [t for t in stale_temporaries(dest) if t != keep]
    if not stale or not is_primary():
        return
    if force:
        for path in stale:
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        print(f"clover: removed {len(stale)} unfinished {os.path.basename(dest)}.tmp-* left by an earlier "
              "killed run", file=sys.stderr)
    else:
        print(f"clover: warning: {len(stale)} unfinished {os.path.basename(dest)}.tmp-* left by an earlier killed "
              f"run ({', '.join(stale)}); delete them, or pass --force to have them removed", file=sys.stderr)


@contextlib.contextmanager
def atomic_directory(dest: str, force: bool = False) -> Iterator[str]:
    """Yield a fresh temp dir next to `dest`; on success rename it to `dest`, on error delete it.

    An existing `dest` is refused unless `force`; then it is swapped out only after the new
    directory is complete, so the old one survives any failure before that point. In a
    multi-process run every process gets the same temp dir (each writes its own shards into it);
    process 0 creates and renames it, with barriers around both. Unfinished `<dest>.tmp-*` directories of
    an earlier killed run are reported, and removed when `force`.
    """
    dest = os.path.abspath(dest)
    if os.path.lexists(dest) and not force:
        raise CheckpointError(f"destination {dest} already exists (pass --force / force=True to replace it)")
    report_stale(dest, force)
    parent = os.path.dirname(dest)
    token = _shared_token()
    tmp = f"{dest}.tmp-{token}"
    if is_primary():
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    sync_processes(f"clover-atomic-mkdir-{token}")
    try:
        yield tmp
        sync_processes(f"clover-atomic-written-{token}")
        if is_primary():
            swap_into_place(tmp, dest, f"{dest}.tmp-old-{token}")
        sync_processes(f"clover-atomic-renamed-{token}")
    except BaseException:
        if is_primary():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_into_place(tmp: str, dest: str, old: str) -> None:
    """Rename the finished directory `tmp` to `dest`; an existing `dest` is first renamed to `old` and deleted
    after the swap. Both directories are fsynced around it."""
    fsync_dir(tmp)
    if os.path.lexists(dest):
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)
    else:
        os.rename(tmp, dest)
    fsync_dir(os.path.dirname(dest))


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries), ignoring filesystems that refuse it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
