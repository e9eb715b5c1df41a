"""The native checkpoint format: a directory holding

    config.json        ModelConfig.to_dict()
    tokenizer files    whichever of tokenizer.TOKENIZER_FILES the source had
    weights/           an Orbax checkpoint of a flat {dotted weight name: array} dict

Weight names are `params.named_leaves` paths (e.g. `moe_layers.mlp.gate`), so the on-disk tree does
not depend on the dataclass layout and a mismatch can name the weight. Restore goes straight into
the caller's target shardings: every device reads only its own shard.

Writes are atomic: everything is written into `<dest>.tmp-<random>` next to the destination and
renamed into place at the end, so a failed or killed save never leaves a half-written destination.

For conversion, `save_streaming` writes a checkpoint whose weights are produced one storage chunk
at a time (`LazyLeaf`: one layer, part of one layer's experts, a block of embedding rows), and
`WeightReader` reads any slice back alone, so peak memory stays near one chunk, never the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from clover_jax import params as P
from clover_jax.config import ConfigError, ModelConfig
from clover_jax.tokenizer import TOKENIZER_FILES

CONFIG_FILE = "config.json"
WEIGHTS_DIR = "weights"


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, malformed, or disagrees with its config."""


# ---- atomic directories ---------------------------------------------------------------------------


def _sync(tag: str) -> None:
    """Barrier across processes (no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(tag)


def _shared_token() -> str:
    """A random token that every process agrees on (process 0's draw)."""
    token = uuid.uuid4().int & 0x7FFFFFFF
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
    return f"{token:08x}"


def is_primary() -> bool:
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


def copy_tokenizer_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """Copy whichever tokenizer files exist in `src_dir`; returns their names."""
    copied = []
    if src_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(src_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(dst_dir, name))
                copied.append(name)
    return copied


# ---- flat weight dicts -----------------------------------------------------------------------------


def expected_leaves(cfg: ModelConfig) -> dict[str, P.ParamSpec]:
    """Every weight the config implies, by dotted name (None leaves, e.g. a tied lm_head, absent)."""
    return dict(P.named_leaves(P.abstract(cfg)))


def flatten_weights(weights: P.Weights) -> dict[str, Any]:
    return dict(P.named_leaves(weights))


def unflatten_weights(cfg: ModelConfig, flat: Mapping[str, Any]) -> P.Weights:
    specs = P.abstract(cfg)
    names = [n for n, _ in P.named_leaves(specs)]
    treedef = jax.tree.structure(specs, is_leaf=P.is_spec)
    return jax.tree.unflatten(treedef, [flat[n] for n in names])


def check_leaves(cfg: ModelConfig, found: Mapping[str, tuple[tuple[int, ...], Any]], where: str) -> None:
    """Compare {name: (shape, dtype)} against the config; raise naming every disagreement found."""
    want = expected_leaves(cfg)
    problems = []
    missing = sorted(set(want) - set(found))
    extra = sorted(set(found) - set(want))
    if missing:
        problems.append(f"missing weights: {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected weights: {', '.join(extra)}")
    for name in sorted(set(want) & set(found)):
        shape, dtype = found[name]
        spec = want[name]
        if tuple(shape) != tuple(spec.shape):
            problems.append(f"weight {name!r} has shape {tuple(shape)} in {where} but the config "
                            f"{cfg.name!r} needs {tuple(spec.shape)}")
        elif np.dtype(dtype) != np.dtype(spec.dtype):
            problems.append(f"weight {name!r} has dtype {np.dtype(dtype)} in {where} but the config "
                            f"{cfg.name!r} needs {np.dtype(spec.dtype)}")
    if problems:
        raise CheckpointError(f"{where} does not match its config: " + "; ".join(problems))


# ---- save / load -----------------------------------------------------------------------------------


def _write_common(tmp: str, cfg: ModelConfig, tokenizer_dir: str | None,
                  extra_files: Mapping[str, str] | None) -> None:
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        f.write(cfg.to_json() + "\n")
    copy_tokenizer_files(tokenizer_dir, tmp)
    for name, text in (extra_files or {}).items():
        if os.path.basename(name) != name or name in (CONFIG_FILE, WEIGHTS_DIR):
            raise CheckpointError(f"extra file name {name!r} must be a plain file name other than "
                                  f"{CONFIG_FILE} / {WEIGHTS_DIR}")
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)


def save_model(path: str, cfg: ModelConfig, weights: P.Weights, tokenizer_dir: str | None = None,
               extra_files: Mapping[str, str] | None = None, force: bool = False) -> str:
    """Write a native checkpoint directory atomically; returns its absolute path.

    `extra_files` maps plain file names to text contents written next to config.json.
    Weights may be sharded over any mesh: each process writes its own shards.
    """
    import orbax.checkpoint as ocp

    flat = flatten_weights(weights)
    check_leaves(cfg, {n: (a.shape, a.dtype) for n, a in flat.items()}, "the weights being saved")
    with atomic_directory(path, force) as tmp:
        if is_primary():
            _write_common(tmp, cfg, tokenizer_dir, extra_files)
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(tmp, WEIGHTS_DIR), flat, save_args={n: _save_args(n, a) for n, a in flat.items()})
        ckptr.wait_until_finished()
        ckptr.close()
    return os.path.abspath(path)


CHUNK_BYTES = 64 * 1024**2


def _save_args(name: str, a: Any) -> Any:
    """Storage chunks that slice reads can use: at most one layer of a stacked weight, and about
    CHUNK_BYTES blocks of large unstacked ones (rows of embed, columns of lm_head). Without this a
    single-device save is one chunk per weight, and reading one layer would decode all of them."""
    import orbax.checkpoint as ocp

    itemsize = np.dtype(a.dtype).itemsize
    if "layers." in name and a.ndim > 1:
        return ocp.SaveArgs(chunk_byte_size=max(int(np.prod(a.shape[1:])) * itemsize, CHUNK_BYTES),
                            shard_axes=(0,))
    if a.ndim > 1 and a.size * itemsize > CHUNK_BYTES:
        return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)
    return ocp.SaveArgs()


def _check_dir(path: str) -> str:
    path = os.path.abspath(path)  # Orbax resolves relative paths against its own idea of the cwd
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise CheckpointError(f"{path!r} is not a native checkpoint: no {CONFIG_FILE}")
    wdir = os.path.join(path, WEIGHTS_DIR)
    if not os.path.isdir(wdir):
        hint = (" (it looks like a HuggingFace checkpoint: run `clover convert` first)"
                if any(f.endswith(".safetensors") for f in os.listdir(path)) else "")
        raise CheckpointError(f"{path!r} is not a native checkpoint: no {WEIGHTS_DIR}/ directory{hint}")
    return wdir


def load_checkpoint_config(path: str) -> ModelConfig:
    _check_dir(path)
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            d = json.load(f)
        return ModelConfig.from_dict(d)
    except (json.JSONDecodeError, ConfigError, TypeError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} is not a valid config: {e}") from e


def stored_leaves(path: str) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{name: (shape, dtype)} of the arrays in a native checkpoint, from metadata only."""
    import orbax.checkpoint as ocp

    wdir = _check_dir(path)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.metadata(wdir).item_metadata.tree
    except Exception as e:  # orbax raises assorted types for a damaged directory
        raise CheckpointError(f"cannot read the weights metadata in {wdir}: {e}") from e
    return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in tree.items()}


def load_model(path: str, shardings: Any = None) -> tuple[ModelConfig, P.Weights]:
    """Read a native checkpoint into `shardings` (a tree matching params.abstract(cfg), e.g. from
    sharding.weight_shardings; default: the first device). Each device reads only its own shard."""
    import orbax.checkpoint as ocp

    cfg = load_checkpoint_config(path)
    check_leaves(cfg, stored_leaves(path), f"checkpoint {path!r}")
    specs = expected_leaves(cfg)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shard_by_name = {n: one for n in specs}
    else:
        shard_by_name = dict(P.named_leaves(shardings))
        if set(shard_by_name) != set(specs):
            raise CheckpointError("the shardings tree does not match the checkpoint's weights: "
                                  f"differs in {sorted(set(shard_by_name) ^ set(specs))}")
    target = {n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shard_by_name[n]) for n, s in specs.items()}
    with ocp.StandardCheckpointer() as ckptr:
        flat = ckptr.restore(_check_dir(path), target)
    return cfg, unflatten_weights(cfg, flat)


# ---- streaming: write and read one slice of the leading axis at a time ------------------------------


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
        return int(np.prod(self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return tuple(self.shape if self.chunk is None else self.chunk)

    def blocks(self) -> Iterator[tuple[slice, ...]]:
        """Chunk indices in C order."""
        import itertools

        axes = [[slice(o, min(o + c, n)) for o in range(0, n, c)] for n, c in zip(self.shape, self.chunk_shape,
                                                                                   strict=True)]
        yield from itertools.product(*axes)


def _lazy_handler() -> Any:
    """An Orbax type handler that writes a LazyLeaf chunk by chunk into the checkpoint's tensorstore.

    Each chunk is one storage chunk, so a restore into any sharding reads only what each device needs.
    The stored array is an ordinary one: `StandardCheckpointer.restore` reads it like any other.
    """
    import tensorstore as ts
    from orbax.checkpoint import type_handlers as th
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

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
    import orbax.checkpoint as ocp
    from orbax.checkpoint import type_handlers as th

    check_leaves(cfg, {n: (a.shape, a.dtype) for n, a in leaves.items()}, "the weights being saved")
    if not _HANDLER_REGISTERED:
        th.register_type_handler(LazyLeaf, _lazy_handler(), override=True)
        _HANDLER_REGISTERED = True
    with atomic_directory(path, force) as tmp:
        _write_common(tmp, cfg, tokenizer_dir, extra_files)
        with ocp.PyTreeCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, WEIGHTS_DIR), dict(leaves))
    return os.path.abspath(path)


class WeightReader:
    """Reads a native checkpoint's arrays (or one slice of their leading axis) to host numpy,
    without loading the rest: for conversion to other formats."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.config = load_checkpoint_config(path)
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
        import tensorstore as ts

        if name not in self._open:
            if name not in self.leaves:
                raise CheckpointError(f"no weight {name!r} in {self.path}")
            kv = dict(self._kv)
            kv["path"] = name if kv["driver"] == "ocdbt" else kv["path"] + name
            self._open[name] = ts.open({"driver": self._driver, "kvstore": kv}, open=True).result()
        return self._open[name]

    def chunk_shape(self, name: str) -> tuple[int, ...]:
        """The storage chunk: reads aligned to it decode nothing twice."""
        return tuple(self._store(name).chunk_layout.read_chunk.shape)

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The whole array, or `array[index]` (an int or a tuple of slices) read from disk alone."""
        t = self._store(name)
        return np.asarray((t if index is None else t[index]).read().result())
