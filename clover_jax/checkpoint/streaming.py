"""Streaming checkpoints for conversion: `save_streaming` writes a native checkpoint whose weights
are produced one storage chunk at a time (`LazyLeaf`: one layer, part of one layer's experts, a
block of embedding rows), and `WeightReader` reads any slice back alone, so peak memory stays near
one chunk, never the model.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging as absl_logging
from orbax.checkpoint import type_handlers as th
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from clover_jax.checkpoint.atomic import atomic_directory
from clover_jax.checkpoint.format import (
    WEIGHTS_DIR,
    check_leaves,
    load_checkpoint_config,
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


def _lazy_handler() -> Any:
    """An Orbax type handler that writes a LazyLeaf chunk by chunk into the checkpoint's tensorstore.

    Each chunk is one storage chunk, so a restore into any sharding reads only what each device needs.
    The stored array is an ordinary one: `StandardCheckpointer.restore` reads it like any other.
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
                    shape = tuple(s.stop - s.start for s in idx)
                    await t[idx].write(_checked(value, value.read(idx), shape),
                                       can_reference_source_data_indefinitely=True)

    return LazyLeafHandler()


def _checked(leaf: LazyLeaf, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(leaf.dtype):
        raise CheckpointError(f"internal: a slice of shape {a.shape} {a.dtype}, expected {shape} {leaf.dtype}")
    return a


_HANDLER_REGISTERED = False


def save_streaming(path: str, cfg: ModelConfig, leaves: Mapping[str, LazyLeaf], tokenizer_dir: str | None = None,
                   extra_files: Mapping[str, str] | None = None, force: bool = False) -> str:
    """Like save_model, but each weight is a LazyLeaf produced one chunk at a time (conversion)."""
    global _HANDLER_REGISTERED
    check_leaves(cfg, {n: (a.shape, a.dtype) for n, a in leaves.items()}, "the weights being saved")
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
    with atomic_directory(path, force) as tmp:
        write_metadata_files(tmp, cfg, tokenizer_dir, extra_files)
        with ocp.PyTreeCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, WEIGHTS_DIR), dict(leaves))
        write_manifest(os.path.join(tmp, WEIGHTS_DIR))
    return os.path.abspath(path)


class WeightReader:
    """Reads a native checkpoint's arrays (or one slice of their leading axis) to host numpy,
    without loading the rest: for conversion to other formats. The directory is checked first
    (`verify.verify`); an error reading it later is a one-line CheckpointError."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.config = load_checkpoint_config(path)  # verifies the directory before anything reads it
        self.leaves = stored_leaves(path)
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
            return np.asarray((t if index is None else t[index]).read().result())
