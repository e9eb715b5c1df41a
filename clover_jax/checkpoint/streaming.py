"""Streaming checkpoints for conversion: `save_streaming` writes a native checkpoint whose weights
are produced one storage chunk at a time (`LazyLeaf`: one layer, part of one layer's experts, a
block of embedding rows), and `WeightReader` reads any slice back alone, so peak memory stays near
one chunk, never the model.

A write given a `fingerprint` is resumable (single process): everything goes into a temp dir next to the
destination that holds a journal (JOURNAL_FILE, see `_Journal`) of each weight chunk once tensorstore has
committed it; a kill -9 leaves the temp dir behind, and a rerun with the same fingerprint writes only the
chunks the journal does not list, into the same Orbax / tensorstore arrays.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging as absl_logging
from etils import epath
from orbax.checkpoint import type_handlers as th
from orbax.checkpoint._src.metadata import checkpoint as ocp_metadata
from orbax.checkpoint._src.metadata import step_metadata_serialization
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from clover_jax.checkpoint.atomic import atomic_directory, report_stale, stale_temporaries, swap_into_place
from clover_jax.checkpoint.format import (
    CONFIG_FILE,
    WEIGHTS_DIR,
    check_leaves,
    current_leaves,
    legacy_leaves,
    load_checkpoint_config,
    read_migrated,
    stored_leaves,
    write_metadata_files,
)
from clover_jax.checkpoint.verify import orbax_errors, write_manifest
from clover_jax.config import ModelConfig
from clover_jax.errors import CheckpointError


@dataclass(frozen=True)
class LazyLeaf:
    """An array that does not exist yet, produced one storage chunk at a time: `read(index)` returns
    `array[index]` for `index` a tuple of slices covering one chunk of shape `chunk` (edge chunks may
    be smaller). Stacked layer weights use chunks of one layer (or part of one layer's experts).
    """

    shape: tuple[int, ...]
    dtype: Any
    read: Callable[[tuple[slice, ...]], np.ndarray]
    chunk: tuple[int, ...] | None = None  # None: one chunk, the whole array

    @property
    def size(self) -> int:
        """Number of elements: the product of `shape`."""
        return int(np.prod(self.shape))

    @property
    def ndim(self) -> int:
        """Number of dimensions of `shape`."""
        return len(self.shape)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The shape of one storage chunk: `chunk`, or the whole `shape` when it is None."""
        return tuple(self.shape if self.chunk is None else self.chunk)

    def blocks(self) -> Iterator[tuple[slice, ...]]:
        """Chunk indices in C order."""
        axes = [[slice(o, min(o + c, n)) for o in range(0, n, c)] for n, c in zip(self.shape, self.chunk_shape,
                                                                                   strict=True)]
        yield from itertools.product(*axes)


JOURNAL_FILE = ".clover-resume.jsonl"  # in the temp dir of a resumable write


def _lazy_handler(journal: _Journal | None = None, done: Collection[tuple[str, tuple[int, ...]]] = ()) -> Any:
    """An Orbax type handler that writes a LazyLeaf chunk by chunk into the checkpoint's tensorstore.

    Each chunk is one storage chunk, so a restore into any sharding reads only what each device needs.
    The stored array is an ordinary one: `StandardCheckpointer.restore` reads it like any other.
    With a `journal`, each chunk is recorded there once tensorstore has committed its write, and the chunks
    in `done` ((leaf name, chunk start indices): an interrupted run's) are neither read nor written.
    """
    class LazyLeafHandler(th.NumpyHandler):
        def __init__(self) -> None:
            super().__init__(deepcopy_host_arrays=False)

        async def _background_serialize(self, values: Any, infos: Any, args: Any = None) -> None:
            for value, info, arg in zip(values, infos, args, strict=True):
                await info.await_path_creation()
                spec = ts_utils.build_array_write_spec(
                    info=info, arg=arg, global_shape=value.shape, local_shape=value.chunk_shape,
                    dtype=np.dtype(value.dtype), use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
                    metadata_key=self._metadata_key).json
                t = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
                for idx in value.blocks():  # one chunk in memory at a time
                    start = tuple(s.start for s in idx)
                    if (info.name, start) in done:
                        continue
                    shape = tuple(s.stop - s.start for s in idx)
                    await t[idx].write(_checked(value, value.read(idx), shape),
                                       can_reference_source_data_indefinitely=True)
                    if journal is not None:
                        journal.add([info.name, list(start)])

    return LazyLeafHandler()


def _checked(leaf: LazyLeaf, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(leaf.dtype):
        raise CheckpointError(f"internal: a slice of shape {a.shape} {a.dtype}, expected {shape} {leaf.dtype}")
    return a


_HANDLER_REGISTERED = False


def save_streaming(path: str, cfg: ModelConfig, leaves: Mapping[str, LazyLeaf], tokenizer_dir: str | None = None,
                   extra_files: Mapping[str, str] | None = None, force: bool = False, *,
                   extra_dirs: Mapping[str, Callable[[str], None]] | None = None, fingerprint: str | None = None,
                   resume: bool = True, on_skip: Callable[[int], None] | None = None) -> str:
    """Like save_model, but each weight is a LazyLeaf produced one chunk at a time (conversion); returns the
    checkpoint's absolute path.

    extra_dirs: {name: fill}: a subdirectory `name` next to config.json, created empty, then `fill(its path)`.
    fingerprint: makes the write resumable; any string that identifies what is written (a conversion's source
    and options). A rerun after a kill, with the same fingerprint and the same weights (names, shapes, dtypes,
    chunks), continues the interrupted run's temp dir: it prints one line to stderr saying how much was written,
    skips the chunks and extra dirs the journal lists as finished (their `read` / `fill` are not called) and
    writes the rest; `on_skip(nbytes)` is then called once, before anything is written, with the bytes skipped
    (the chunks' as stored, the extra dirs' files' sizes), e.g. a progress bar's update. A run killed during
    Orbax's finalize (the OCDBT merge, at the very end) is started over, with a line that says so.
    resume=False discards the temp dir of an interrupted run with this fingerprint and starts over (one line).
    Temp dirs of other fingerprints are left alone (reported as stale, removed with `force`, as without a
    fingerprint). Ctrl-C (KeyboardInterrupt) keeps the temp dir of a resumable write; any other error deletes
    it. Single process only: in a multi-process run the fingerprint is ignored (an ordinary write). Without a
    fingerprint: an ordinary atomic write, nothing kept, nothing printed.
    """
    global _HANDLER_REGISTERED
    check_leaves(cfg, {n: (a.shape, a.dtype) for n, a in leaves.items()}, "the weights being saved")
    for name in extra_dirs or {}:
        if os.path.basename(name) != name or name in (CONFIG_FILE, WEIGHTS_DIR, "", ".", "..") \
                or name in (extra_files or {}):
            raise CheckpointError(f"extra directory name {name!r} must be a plain name, not {CONFIG_FILE}, "
                                  f"{WEIGHTS_DIR} or an extra file's")
    if not _HANDLER_REGISTERED:
        # A LazyLeaf is written as the array it streams (the typestr of Orbax's array handler): an intended
        # override, registered once per process, without Orbax's warning about the collision.
        before = absl_logging.get_verbosity()
        absl_logging.set_verbosity(absl_logging.ERROR)
        try:
            th.register_type_handler(LazyLeaf, _lazy_handler(), override=True)
        finally:
            absl_logging.set_verbosity(before)
        _HANDLER_REGISTERED = True
    if fingerprint is None or jax.process_count() > 1:
        with atomic_directory(path, force) as tmp:
            write_metadata_files(tmp, cfg, tokenizer_dir, extra_files)
            for name, fill in (extra_dirs or {}).items():
                os.mkdir(os.path.join(tmp, name))
                fill(os.path.join(tmp, name))
            with ocp.PyTreeCheckpointer() as ckptr:
                ckptr.save(os.path.join(tmp, WEIGHTS_DIR), dict(leaves))
            write_manifest(os.path.join(tmp, WEIGHTS_DIR))
        return os.path.abspath(path)

    header = {"fingerprint": hashlib.sha256(fingerprint.encode()).hexdigest(), "layout": _layout(leaves)}
    with _resumable_directory(path, force, header, resume) as (tmp, journal, entries):
        done = {(e[0], tuple(e[1])) for e in entries or () if isinstance(e, list)}
        weights_done = {"weights": "done"} in (entries or ())
        if entries is not None:
            chunks = [(name, int(np.prod([s.stop - s.start for s in idx])) * np.dtype(a.dtype).itemsize,
                       (name, tuple(s.start for s in idx))) for name, a in leaves.items() for idx in a.blocks()]
            skipped = [n for _, n, key in chunks if weights_done or key in done]
            print(f"clover convert: resuming {os.path.abspath(path)} from an interrupted run: {len(skipped)} of "
                  f"{len(chunks)} chunks ({_size(sum(skipped))}) already written", file=sys.stderr)
            if on_skip is not None:
                on_skip(sum(skipped) + sum(_dir_bytes(os.path.join(tmp, n)) for n in extra_dirs or {}
                                           if {"dir": n} in entries))
        write_metadata_files(tmp, cfg, tokenizer_dir, extra_files)
        for name, fill in (extra_dirs or {}).items():
            if {"dir": name} not in (entries or ()):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)  # an interrupted fill's
                os.mkdir(os.path.join(tmp, name))
                fill(os.path.join(tmp, name))
                journal.add({"dir": name})
        wdir = os.path.join(tmp, WEIGHTS_DIR)
        if not weights_done:
            _save_weights(wdir, leaves, journal, done)
        write_manifest(wdir)
    return os.path.abspath(path)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _layout(leaves: Mapping[str, LazyLeaf]) -> str:
    """A digest of the weights' names, shapes, dtypes and chunks: a journal is only resumed by the same ones."""
    doc = {n: [list(a.shape), np.dtype(a.dtype).name, list(a.chunk_shape)] for n, a in sorted(leaves.items())}
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def _save_weights(wdir: str, leaves: Mapping[str, LazyLeaf], journal: _Journal,
                  done: Collection[tuple[str, tuple[int, ...]]]) -> None:
    """What `PyTreeCheckpointer.save(wdir, leaves)` writes, resumably: Orbax's PyTreeCheckpointHandler straight
    into `wdir` (the checkpointer would write into a temp dir of its own, renamed at the end: nothing to resume),
    skipping the chunks in `done`; then Orbax's finalize and the two files the checkpointer adds."""
    started = time.time_ns()
    os.makedirs(wdir, exist_ok=True)
    # Orbax's own for jax.Array too (there are none), as in the global registry: no warning, the same behaviour.
    registry = th.create_type_handler_registry((jax.Array, th.get_type_handler(jax.Array)),
                                               (LazyLeaf, _lazy_handler(journal, done)))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    try:
        handler.save(epath.Path(wdir), args=ocp.args.PyTreeSave(dict(leaves)))
        journal.add({"weights": "finalizing"})
        handler.finalize(epath.Path(wdir))
    finally:
        handler.close()
    meta = ocp_metadata.StepMetadata(item_handlers=handler.typestr(), init_timestamp_nsecs=started,
                                     commit_timestamp_nsecs=time.time_ns())
    with open(ocp_metadata.step_metadata_file_path(wdir), "w") as f:
        json.dump(step_metadata_serialization.serialize(meta), f)
    with open(os.path.join(wdir, "commit_success.txt"), "w") as f:
        f.write(f"Checkpoint commit was successful to {wdir}")
    journal.add({"weights": "done"})


class _Journal:
    """The progress of a resumable write: `<temp dir>/JOURNAL_FILE`, one JSON value a line. First the header
    {"fingerprint": sha256 of the caller's fingerprint, "layout": `_layout`}, then a line for each step finished,
    appended and flushed once it is on disk: `[leaf name, [chunk start indices]]` for a weight chunk (after its
    tensorstore write has committed), {"dir": name} for an extra directory, {"weights": "finalizing"} before
    Orbax's finalize and {"weights": "done"} after it. A kill while appending leaves a torn last line: ignored."""

    def __init__(self, tmp: str, header: Mapping[str, str] | None = None) -> None:
        self.path = os.path.join(tmp, JOURNAL_FILE)
        if header is not None:
            with open(self.path, "w") as f:
                f.write(json.dumps(header) + "\n")
        else:  # continuing: cut a torn last line, so that the next line starts on its own
            with open(self.path, "rb+") as f:
                f.truncate(f.read().rfind(b"\n") + 1)
        self._f = open(self.path, "a")  # noqa: SIM115 (closed by close())

    def add(self, entry: Any) -> None:
        """Append `entry` as one line and flush it."""
        if not self._f.closed:  # (a write that finishes after an interrupt)
            self._f.write(json.dumps(entry) + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(tmp: str) -> tuple[dict[str, Any] | None, list[Any]]:
        """(header, entries) of the journal in `tmp`; (None, []) if it has none or one that does not parse."""
        try:
            with open(os.path.join(tmp, JOURNAL_FILE), "rb") as f:
                values = [json.loads(line) for line in f.read().split(b"\n")[:-1]]  # [-1]: torn or empty
        except (OSError, ValueError):
            return None, []
        if not values or not isinstance(values[0], dict):
            return None, []
        return values[0], values[1:]


@contextlib.contextmanager
def _resumable_directory(dest: str, force: bool, header: Mapping[str, str],
                         resume: bool) -> Iterator[tuple[str, _Journal, list[Any] | None]]:
    """`atomic_directory` for a resumable write (one process): yields (temp dir, its journal, the entries of the
    interrupted run it continues, or None for a new one). The temp dir of an interrupted run whose journal has
    `header` is continued when `resume` (the one furthest on, if several), else deleted; one killed in Orbax's
    finalize is deleted too. On success the temp dir is renamed to `dest` (swapping out an existing one when
    `force`) and loses its journal; KeyboardInterrupt keeps it; any other error deletes it."""
    dest = os.path.abspath(dest)
    if os.path.lexists(dest) and not force:
        raise CheckpointError(f"destination {dest} already exists (pass --force / force=True to replace it)")
    ours = {}
    for t in stale_temporaries(dest):
        head, entries = _Journal.read(t)
        if head == header:
            ours[t] = entries
    tmp = max(ours, key=lambda t: len(ours[t])) if ours and resume else None
    discard = [] if resume else list(ours)
    if tmp is not None and {"weights": "finalizing"} in ours[tmp] and {"weights": "done"} not in ours[tmp]:
        print(f"clover convert: the interrupted run of {dest} was killed while finalizing its weights (the OCDBT "
              "merge); starting over", file=sys.stderr)
        discard, tmp = [tmp], None
    elif discard:
        print(f"clover convert: starting {dest} over: removed the interrupted run's {', '.join(discard)}",
              file=sys.stderr)
    for t in discard:
        shutil.rmtree(t, ignore_errors=True)
    report_stale(dest, force, keep=tmp)
    entries = None if tmp is None else ours[tmp]
    if tmp is None:
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.mkdir(tmp)
    journal = _Journal(tmp, header if entries is None else None)
    try:
        yield tmp, journal, entries
        journal.close()
        swap_into_place(tmp, dest, f"{tmp}-old")
        os.remove(os.path.join(dest, JOURNAL_FILE))  # after the rename: a kill in between loses nothing
    except KeyboardInterrupt:
        journal.close()
        raise
    except BaseException:
        journal.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class WeightReader:
    """Reads a native checkpoint's arrays (or one slice of their leading axis) to host numpy,
    without loading the rest: for conversion to other formats. The directory is checked first
    (`verify.verify`); an error reading it later is a one-line CheckpointError. Weights stored in an earlier
    layout (`format.legacy_leaves`) are listed in `leaves` and read in the current one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.config = load_checkpoint_config(path)  # verifies the directory before anything reads it
        stored = stored_leaves(path)
        self._legacy = legacy_leaves(self.config, stored)
        self.leaves = current_leaves(self.config, stored)
        check_leaves(self.config, self.leaves, f"checkpoint {path!r}")
        wdir = os.path.abspath(os.path.join(path, WEIGHTS_DIR))
        with open(os.path.join(wdir, "_METADATA")) as f:
            meta = json.load(f)
        use_ocdbt = meta.get("use_ocdbt", True)
        self._driver = "zarr3" if meta.get("use_zarr3") else "zarr"
        self._kv = ({"driver": "ocdbt", "base": f"file://{wdir}/"} if use_ocdbt
                    else {"driver": "file", "path": f"{wdir}/"})
        self._open: dict[str, Any] = {}

    def _store(self, name: str) -> Any:
        if name not in self._open:
            if name not in self.leaves:
                raise CheckpointError(f"no weight {name!r} in {self.path}")
            kv = dict(self._kv)
            kv["path"] = name if kv["driver"] == "ocdbt" else kv["path"] + name
            with orbax_errors(self.path, f"weight {name!r}"):
                self._open[name] = ts.open({"driver": self._driver, "kvstore": kv}, open=True).result()
        return self._open[name]

    def chunk_shape(self, name: str) -> tuple[int, ...]:
        """The storage chunk: reads aligned to it decode nothing twice."""
        return tuple(self._store(name).chunk_layout.read_chunk.shape)

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The whole array, or `array[index]` (an int or a tuple of slices) read from disk alone."""
        t = self._store(name)
        with orbax_errors(self.path, f"weight {name!r}"):
            if name in self._legacy:
                return read_migrated(self.config, name, lambda i: np.asarray(t[i].read().result()), index)
            return np.asarray((t if index is None else t[index]).read().result())
