"""Atomic directories: everything is written into `<dest>.tmp-<random>` next to the destination and
renamed into place at the end, so a failed or killed write never leaves a half-written destination,
and an existing destination survives any failure before the swap. Works across processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from clover_jax.errors import CheckpointError


def _sync(tag: str) -> None:
    """Barrier across processes (no-op in a single-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(tag)


def _shared_token() -> str:
    """A random token that every process agrees on (process 0's draw)."""
    token = uuid.uuid4().int & 0x7FFFFFFF
    if jax.process_count() > 1:
        token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
    return f"{token:08x}"


def is_primary() -> bool:
    """Whether this is process 0 (the one that creates, renames and writes shared files)."""
    return jax.process_index() == 0


@contextlib.contextmanager
def atomic_directory(dest: str, force: bool = False) -> Iterator[str]:
    """Yield a fresh temp dir next to `dest`; on success rename it to `dest`, on error delete it.

    An existing `dest` is refused unless `force`; then it is swapped out only after the new
    directory is complete, so the old one survives any failure before that point. In a
    multi-process run every process gets the same temp dir (each writes its own shards into it);
    process 0 creates and renames it, with barriers around both.
    """
    dest = os.path.abspath(dest)
    if os.path.lexists(dest) and not force:
        raise CheckpointError(f"destination {dest} already exists (use --force / force=True to replace it)")
    parent = os.path.dirname(dest)
    token = _shared_token()
    tmp = f"{dest}.tmp-{token}"
    if is_primary():
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    _sync(f"clover-atomic-mkdir-{token}")
    try:
        yield tmp
        _sync(f"clover-atomic-written-{token}")
        if is_primary():
            _fsync_dir(tmp)
            if os.path.lexists(dest):
                old = f"{dest}.tmp-old-{token}"
                os.rename(dest, old)
                os.rename(tmp, dest)
                shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)
            else:
                os.rename(tmp, dest)
            _fsync_dir(parent)
        _sync(f"clover-atomic-renamed-{token}")
    except BaseException:
        if is_primary():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
