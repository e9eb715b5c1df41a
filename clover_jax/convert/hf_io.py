"""Reading and writing HuggingFace weight files, one tensor at a time.

Reading: `open_source(dir)` indexes every tensor of a directory (safetensors with or without
`model.safetensors.index.json`, validated with safetensors' `safe_open`; PyTorch `.bin` pickles only
when explicitly allowed, loaded with `torch.load(weights_only=True, mmap=True)`) from headers only,
and `get(key)` reads one tensor (a positional read into a fresh array, no memory map).

Writing: `ShardedWriter` is given the full list of (key, shape, dtype) up front, plans shards of
bounded size, and writes each safetensors file header-first, then tensors in order as they come,
so no shard is ever assembled in memory. It finishes with `model.safetensors.index.json`.
`LayoutWriter` writes the files of a recorded layout instead (`read_layout`: each source file's header
bytes and the index's text): every tensor at its recorded offset, in any order, so a checkpoint written
back with unchanged tensors is byte for byte the one read. `copy_tensors` copies tensors of a source
into a new safetensors directory unchanged, a block of rows at a time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from clover_jax.errors import ConversionError

INDEX_FILE = "model.safetensors.index.json"
PICKLE_INDEX_FILE = "pytorch_model.bin.index.json"

# safetensors dtype names <-> numpy (bfloat16 via ml_dtypes, as jax uses)
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
NP_TO_ST = {v: k for k, v in ST_DTYPES.items()}


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a numpy dtype name, bfloat16 included."""
    return np.dtype(name) if name != "bfloat16" else np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class TensorInfo:
    """One indexed HF tensor: the file holding it, its shape and numpy dtype name."""

    file: str
    shape: tuple[int, ...]
    dtype: str  # numpy name

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return int(np.prod(self.shape)) * np_dtype(self.dtype).itemsize


class SafetensorsSource:
    """Every tensor of a HF directory, indexed from file headers; `get` reads one."""

    def __init__(self, directory: str, files: Sequence[str]) -> None:
        self.directory = directory
        self.tensors: dict[str, TensorInfo] = {}
        self._handles: dict[str, Any] = {}
        self._fds: dict[str, int] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        for name in files:
            path = os.path.join(directory, name)
            data_start, header = _check_safetensors_file(path)
            self._offsets.update({k: (data_start + v["data_offsets"][0], data_start + v["data_offsets"][1])
                                  for k, v in header.items() if k != "__metadata__"})
            self._fds[name] = os.open(path, os.O_RDONLY)
            try:
                h = safe_open(path, framework="numpy")
                h.__enter__()
            except Exception as e:
                raise ConversionError(f"cannot open {path}: {e}") from e
            self._handles[name] = h
            for key in h.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                if key in self.tensors:
                    raise ConversionError(f"tensor {key!r} appears in both {self.tensors[key].file} and {name}")
                sl = h.get_slice(key)
                dt = ST_DTYPES.get(sl.get_dtype())
                if dt is None:
                    raise ConversionError(f"tensor {key!r} in {name} has unsupported dtype {sl.get_dtype()}")
                self.tensors[key] = TensorInfo(name, tuple(sl.get_shape()), dt)

    def get(self, key: str) -> np.ndarray:
        """One tensor, read with a plain positional read: safe_open's memory map would leave every page
        it touched resident (and counted in RSS) for as long as the file stays open."""
        return self.get_rows(key, 0, self.tensors[key].shape[0] if self.tensors[key].shape else 1)

    def get_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (all of it for a scalar): contiguous bytes on disk."""
        info = self.tensors[key]
        begin, end = self._offsets[key]
        itemsize = np_dtype(info.dtype).itemsize
        row = int(np.prod(info.shape[1:])) * itemsize if info.shape else itemsize
        n_all = int(np.prod(info.shape)) * itemsize
        if n_all != end - begin:
            raise ConversionError(f"tensor {key!r} in {info.file}: header size {end - begin} bytes, "
                                  f"shape {info.shape} {info.dtype} needs {n_all}")
        shape = (stop - start, *info.shape[1:]) if info.shape else ()
        out = np.empty(shape, np_dtype(info.dtype))
        buf = out.reshape(-1).view(np.uint8)
        begin += start * row
        fd = self._fds[info.file]
        done = 0
        while done < buf.nbytes:
            n = os.preadv(fd, [buf[done:]], begin + done)
            if n <= 0:
                raise ConversionError(f"{info.file} ended while reading {key!r}: the file is truncated")
            done += n
        return out

    def close(self) -> None:
        """Close every safe_open handle and file descriptor."""
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _check_safetensors_file(path: str) -> tuple[int, dict[str, Any]]:
    """(data start, header); a clear error for a truncated or corrupt file, before safetensors' terse one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path} is truncated or not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ConversionError(f"{path} is truncated: its header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path} has a corrupt safetensors header: {e}") from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConversionError(f"{path} is truncated: its tensors need {8 + n + end} bytes, the file has {size}")
    return 8 + n, header


class PickleSource:
    """PyTorch `.bin` files, only with --allow-pickle: torch.load(weights_only=True, mmap=True)."""

    def __init__(self, directory: str, files: Sequence[str]) -> None:
        import torch  # optional heavy dependency (the `torch` extra), only for --allow-pickle

        self.directory = directory
        self.tensors: dict[str, TensorInfo] = {}
        self._state: dict[str, Any] = {}
        for name in files:
            path = os.path.join(directory, name)
            try:
                try:
                    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:  # a legacy (non-zip) pickle cannot be memory-mapped: read it whole
                    if "mmap" not in str(e):
                        raise
                    sd = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConversionError(f"{path}: refused by torch.load(weights_only=True), which loads only tensors "
                                      f"and plain containers (this file holds something else, or is no PyTorch "
                                      f"checkpoint): {first}") from None
            for key, t in sd.items():
                if not isinstance(t, torch.Tensor):
                    raise ConversionError(f"{path}: entry {key!r} is not a tensor")
                self._state[key] = t
                self.tensors[key] = TensorInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))

    def get(self, key: str) -> np.ndarray:
        """One tensor as a fresh numpy array."""
        return self.get_rows(key, 0, self.tensors[key].shape[0] if self.tensors[key].shape else 1)

    def get_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (all of it for a scalar) as a fresh numpy array."""
        import torch  # optional heavy dependency (see __init__)

        t = self._state[key]
        t = (t[start:stop] if t.ndim else t).contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np_dtype("bfloat16")).copy()
        return t.numpy().copy()

    def close(self) -> None:
        """Drop the loaded tensors."""
        self._state.clear()


def open_source(directory: str, allow_pickle: bool = False) -> SafetensorsSource | PickleSource:
    """The tensors of HF directory `directory`: safetensors (by `INDEX_FILE`, checked against the files, or
    every *.safetensors), else .bin/.pt/.pth pickles with `allow_pickle`; ConversionError otherwise."""
    names = sorted(os.listdir(directory))
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
        if missing:
            raise ConversionError(f"{INDEX_FILE} names files that do not exist: {', '.join(missing)}")
        src = SafetensorsSource(directory, files)
        bad = sorted(k for k, f in weight_map.items() if k not in src.tensors or src.tensors[k].file != f)
        if bad:
            src.close()
            raise ConversionError(f"{INDEX_FILE} disagrees with the files for: {', '.join(bad[:5])}"
                                  + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
        return src
    st = [n for n in names if n.endswith(".safetensors")]
    if st:
        return SafetensorsSource(directory, st)
    bins = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
    if bins:
        if not allow_pickle:
            raise ConversionError(
                f"{directory} holds only pickled PyTorch weights ({', '.join(bins)}); unpickling can run arbitrary "
                "code, so it is refused. Pass --allow-pickle to load them with torch.load(weights_only=True)")
        return PickleSource(directory, bins)
    raise ConversionError(f"{directory} holds no weights (*.safetensors, or *.bin with --allow-pickle)")


# ---- writing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor a ShardedWriter is to write: key, shape and numpy dtype name."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return int(np.prod(self.shape)) * np_dtype(self.dtype).itemsize


class ShardedWriter:
    """Writes planned tensors, in plan order, into `model-0000i-of-0000n.safetensors` files."""

    def __init__(self, directory: str, plan: Sequence[PlannedTensor], max_shard_bytes: int) -> None:
        self.directory = directory
        self.plan = list(plan)
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in self.plan:
            if shards[-1] and size + t.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
        n = len(shards)
        self.files = (["model.safetensors"] if n == 1
                      else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.shards = shards
        self._pos = 0  # index into plan of the next tensor
        self._shard = -1
        self._in_shard = 0
        self._f: Any = None

    def _open_next(self) -> None:
        if self._f is not None:
            self._f.close()
        self._shard += 1
        self._in_shard = 0
        tensors = self.shards[self._shard]
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for t in tensors:
            header[t.key] = {"dtype": NP_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
            off += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(os.path.join(self.directory, self.files[self._shard]), "wb")  # noqa: SIM115
        self._f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, key: str, array: np.ndarray) -> None:
        """The next planned tensor, whole (`write_rows` with one block); ConversionError if it is not."""
        self.write_rows(key, [array])

    def write_rows(self, key: str, blocks: Iterable[np.ndarray]) -> None:
        """The next planned tensor, given as consecutive row blocks (so it need not exist whole)."""
        t = self.plan[self._pos]
        if self._f is None or self._in_shard == len(self.shards[self._shard]):
            self._open_next()
        rows = 0
        for a in blocks:
            if key != t.key or tuple(a.shape[1:]) != t.shape[1:] or a.dtype != np_dtype(t.dtype):
                raise ConversionError(f"internal: wrote {key} {a.shape} {a.dtype}, planned {t}")
            self._f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # no copy; little-endian hosts
            rows += a.shape[0] if a.ndim else 1
        if rows != (t.shape[0] if t.shape else 1):
            raise ConversionError(f"internal: wrote {rows} rows of {key}, planned {t}")
        self._in_shard += 1
        self._pos += 1

    def finish(self) -> None:
        """Close the last file and, with several shards, write `INDEX_FILE`; ConversionError if a planned
        tensor was not written."""
        if self._pos != len(self.plan):
            raise ConversionError(f"internal: wrote {self._pos} of {len(self.plan)} planned tensors")
        if self._f is not None:
            self._f.close()
            self._f = None
        if len(self.files) > 1:
            weight_map = {t.key: self.files[s] for s, shard in enumerate(self.shards) for t in shard}
            index = {"metadata": {"total_size": sum(t.nbytes for t in self.plan)}, "weight_map": weight_map}
            with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)


# ---- a recorded layout -----------------------------------------------------------------------------


def raw_header(path: str) -> str:
    """The header of the safetensors file `path` as stored (its JSON text, padding included)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8")


def read_layout(directory: str) -> dict[str, Any] | None:
    """The file layout of the safetensors directory `directory`: {"files": {name: header text}, "index":
    the index file's text or None}; None when it holds no safetensors files."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        return None
    index = os.path.join(directory, INDEX_FILE)
    text = None
    if os.path.isfile(index):
        with open(index, encoding="utf-8", newline="") as f:
            text = f.read()
        names = sorted(set(json.loads(text)["weight_map"].values()))
    return {"files": {n: raw_header(os.path.join(directory, n)) for n in names}, "index": text}


def layout_tensors(layout: dict[str, Any]) -> dict[str, PlannedTensor]:
    """Every tensor a recorded layout holds, by key."""
    out = {}
    for header in layout["files"].values():
        for key, v in json.loads(header).items():
            if key != "__metadata__":
                out[key] = PlannedTensor(key, tuple(v["shape"]), ST_DTYPES.get(v["dtype"], v["dtype"]))
    return out


class LayoutWriter:
    """Writes the files of a recorded layout (`read_layout`) into `directory`: each file is created at its
    full size with its recorded header, and every tensor is written at its recorded offset, so tensors may
    come in any order. Same interface as ShardedWriter; `finish` writes the recorded index text and raises
    ConversionError unless every tensor was written whole."""

    def __init__(self, directory: str, layout: dict[str, Any]) -> None:
        self.directory, self.layout = directory, layout
        self._where: dict[str, tuple[str, int, int]] = {}  # key -> (file, start, end)
        self._fds: dict[str, int] = {}
        self._written: dict[str, int] = {}
        self._dtypes = layout_tensors(layout)
        for name, header in layout["files"].items():
            raw = header.encode("utf-8")
            start = 8 + len(raw)
            end = start
            for key, v in json.loads(header).items():
                if key != "__metadata__":
                    a, b = v["data_offsets"]
                    self._where[key] = (name, start + a, start + b)
                    end = max(end, start + b)
            fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[name] = fd
            os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(fd, end)

    def write(self, key: str, array: np.ndarray) -> None:
        """One whole tensor."""
        self.write_rows(key, [array])

    def write_rows(self, key: str, blocks: Iterable[np.ndarray]) -> None:
        """One tensor as consecutive row blocks, at its recorded offset."""
        if key not in self._where:
            raise ConversionError(f"internal: {key} is not in the recorded layout")
        name, start, end = self._where[key]
        t = self._dtypes[key]
        pos = start
        for a in blocks:
            if tuple(a.shape[1:]) != t.shape[1:] or a.dtype != np_dtype(t.dtype):
                raise ConversionError(f"internal: wrote {key} {a.shape} {a.dtype}, the layout has {t}")
            buf = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            done = 0
            while done < buf.nbytes:
                done += os.pwrite(self._fds[name], buf[done:], pos + done)
            pos += buf.nbytes
        if pos != end:
            raise ConversionError(f"internal: wrote {pos - start} bytes of {key}, the layout has {end - start}")
        self._written[key] = pos - start

    def finish(self) -> None:
        """Close the files and write the recorded index; ConversionError if a tensor was not written."""
        missing = sorted(set(self._where) - set(self._written))
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if missing:
            raise ConversionError(f"internal: {len(missing)} tensors of the layout were not written: {missing[:3]}")
        if self.layout.get("index") is not None:
            with open(os.path.join(self.directory, INDEX_FILE), "w", encoding="utf-8", newline="") as f:
                f.write(self.layout["index"])


def row_blocks(source: SafetensorsSource | PickleSource, key: str, block_bytes: int) -> Iterable[np.ndarray]:
    """Tensor `key` of `source` as consecutive blocks of rows of about `block_bytes` each."""
    info = source.tensors[key]
    if not info.shape:
        yield source.get(key)
        return
    row = max(1, int(np.prod(info.shape[1:])) * np_dtype(info.dtype).itemsize)
    step = max(1, block_bytes // row)
    for r in range(0, info.shape[0], step):
        yield source.get_rows(key, r, min(info.shape[0], r + step))


def copy_tensors(source: SafetensorsSource | PickleSource, keys: Sequence[str], directory: str,
                 max_shard_bytes: int, block_bytes: int = 64 * 1024**2, on_bytes: Any = None) -> list[str]:
    """Write tensors `keys` of `source`, unchanged (dtype, shape, bytes), into the new safetensors directory
    `directory` (shards of at most `max_shard_bytes`, with an index when there are several), a block of
    rows at a time; `on_bytes(n)` after each block. Returns the files written."""
    os.makedirs(directory, exist_ok=True)
    plan = [PlannedTensor(k, source.tensors[k].shape, source.tensors[k].dtype) for k in keys]
    writer = ShardedWriter(directory, plan, max_shard_bytes)
    for t in plan:
        def counted(key: str = t.key) -> Iterable[np.ndarray]:
            for a in row_blocks(source, key, block_bytes):
                if on_bytes is not None:
                    on_bytes(a.nbytes)
                yield a
        writer.write_rows(t.key, counted())
    writer.finish()
    return writer.files
