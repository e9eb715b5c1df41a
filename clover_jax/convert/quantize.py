"""Weight-only quantization inside a conversion stream, one storage chunk at a time (`model.quant`'s scheme).

Contract:

`quantized_leaves(specs, leaves, scheme)` takes the float weights of a model as `LazyLeaf`s, named and
described as `checkpoint.expected_leaves(float_cfg)` names them (`specs`), and returns the leaves of the
quantized model, named as `checkpoint.expected_leaves(float_cfg.replace(quantization=scheme))` names them:
every matmul weight NAME (a spec with a non-empty `contract`) becomes `NAME.qvalue` (int8 / float8_e4m3fn,
the weight's shape and chunks) and `NAME.scale` (float32, size 1 on the contracted axes); the others pass
through untouched. Each chunk of a quantized weight must hold the contracted axes whole (ConversionError
otherwise: a caller bug), so quantizing it alone (`quantize_chunk`: `quant.quantize`, per output channel,
on the CPU) gives bit for bit what quantizing the whole tensor gives (`params.quantize_weights`). A float chunk is
read once: its scales wait for the scale leaf in a cache of at most SCALE_CACHE_BYTES, and a chunk whose
scales did not fit is read and quantized again; at most one quantized chunk more is ever held.

`stream_chunk(...)` picks such chunks for a weight read from a native checkpoint: one layer of a stacked
weight, split on its leading non-contracted axes (the experts, lm_head's vocabulary) to about `max_bytes`.

`DequantizedReader(reader)` is the other direction: a `WeightReader` of a quantized checkpoint seen as
its float model (config, names, shapes, `read`), each quantized weight read as `qvalue * scale` of the
same slice, in the config's dtype, exactly as `params.dequantize_weights` computes it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.checkpoint import LazyLeaf, WeightReader, expected_leaves
from clover_jax.errors import ConversionError
from clover_jax.model import quant

SCALE_CACHE_BYTES = 256 * 1024**2  # scales computed with their qvalues, waiting for the scale leaf


def check_scheme(scheme: str | None) -> str | None:
    """`scheme` ('int8' or 'fp8'), None for None or 'none'; ConversionError naming the choices otherwise."""
    if scheme in (None, quant.NONE):
        return None
    if scheme not in quant.QTYPES:
        raise ConversionError(f"unknown quantization {scheme!r}; choose one of {', '.join(quant.QTYPES)}")
    return scheme


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    """Quantize on the host CPU (as the tests and an in-memory `params.quantize_weights` on CPU do), even
    where the default device is an accelerator: the chunk is on the host already."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: the default device then
        yield
        return
    with jax.default_device(cpu):
        yield


# One fused program per (rows, contracted size), rows rounded up to a power of two: a handful of compiles
# for a whole model, and no float32 copy and intermediates op by op.
_quantize_2d = jax.jit(quant.quantize, static_argnums=(1, 2))


def quantize_chunk(a: np.ndarray, contract: tuple[int, ...], scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """(qvalue, scale) of `quant.quantize(a, contract, scheme)`, bit for bit, computed on the CPU as a
    [channels, contracted] matrix: absmax quantization is a max over each channel's values and elementwise
    arithmetic, so neither the order of the axes nor extra padding rows (dropped) change any value."""
    channels = [i for i in range(a.ndim) if i not in contract]
    rows = int(np.prod([a.shape[i] for i in channels]))
    k = int(np.prod([a.shape[i] for i in contract]))
    x = np.transpose(a, channels + list(contract)).reshape(rows, k)
    padded = 1 << max(0, rows - 1).bit_length()
    if padded != rows:
        x = np.concatenate([x, np.ones((padded - rows, k), x.dtype)])
    with _on_cpu():
        q = _quantize_2d(x, (1,), scheme)
        qvalue, scale = np.asarray(q.qvalue)[:rows], np.asarray(q.scale, np.float32)[:rows]
    qvalue = qvalue.reshape([a.shape[i] for i in channels + list(contract)])
    return (np.ascontiguousarray(np.transpose(qvalue, np.argsort(channels + list(contract)))),
            scale.reshape(quant.scale_shape(a.shape, contract)))


def _key(idx: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in idx)


class _Quantizer:
    """Quantizes one float LazyLeaf chunk by chunk for its two quantized leaves."""

    def __init__(self, name: str, leaf: LazyLeaf, contract: tuple[int, ...], scheme: str) -> None:
        chunk = leaf.chunk_shape
        if any(chunk[a] != leaf.shape[a] for a in contract):
            raise ConversionError(f"internal: chunks {chunk} of {name} {leaf.shape} split its contracted axes "
                                  f"{contract}")
        self.name, self.leaf, self.contract, self.scheme = name, leaf, contract, scheme
        self.scales: dict[Any, np.ndarray] = {}  # by chunk: computed with the qvalue, not yet asked for
        self.cached = 0  # bytes in `scales`
        self.qvalues: collections.OrderedDict[Any, np.ndarray] = collections.OrderedDict()  # scale asked first

    def _compute(self, idx: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
        return quantize_chunk(self.leaf.read(idx), self.contract, self.scheme)

    def qvalue(self, idx: tuple[slice, ...]) -> np.ndarray:
        key = _key(idx)
        if key in self.qvalues:
            return self.qvalues.pop(key)
        q, s = self._compute(idx)
        if key not in self.scales and self.cached + s.nbytes <= SCALE_CACHE_BYTES:
            self.scales[key] = s
            self.cached += s.nbytes
        return q

    def scale(self, sidx: tuple[slice, ...]) -> np.ndarray:
        idx = tuple(slice(0, self.leaf.shape[a]) if a in self.contract else s for a, s in enumerate(sidx))
        key = _key(idx)
        if key in self.scales:
            s = self.scales.pop(key)
            self.cached -= s.nbytes
            return s
        q, s = self._compute(idx)
        self.qvalues[key] = q
        while len(self.qvalues) > 1:  # bounded: one chunk, for a writer that asks for the scales first
            self.qvalues.popitem(last=False)
        return s


def quantized_leaves(specs: Mapping[str, Any], leaves: Mapping[str, LazyLeaf], scheme: str) -> dict[str, LazyLeaf]:
    """The leaves of the quantized model from the float model's (see the module docstring)."""
    if scheme not in quant.QTYPES:
        raise ConversionError(f"cannot quantize to {scheme!r}; choose one of {', '.join(quant.QTYPES)}")
    out: dict[str, LazyLeaf] = {}
    for name, leaf in leaves.items():
        contract = tuple(specs[name].contract)
        if not contract:
            out[name] = leaf
            continue
        qz = _Quantizer(name, leaf, contract, scheme)
        out[f"{name}.qvalue"] = LazyLeaf(leaf.shape, np.dtype(quant.QTYPES[scheme]), qz.qvalue, leaf.chunk_shape)
        out[f"{name}.scale"] = LazyLeaf(quant.scale_shape(leaf.shape, contract), np.dtype(np.float32), qz.scale,
                                        quant.scale_shape(leaf.chunk_shape, contract))
    return out


def stream_chunk(shape: tuple[int, ...], itemsize: int, contract: tuple[int, ...], stacked: bool,
                 max_bytes: int) -> tuple[int, ...]:
    """A chunk of a weight for streaming it: one layer when `stacked`, then the leading axes not in
    `contract` cut down until the chunk is about `max_bytes` (the contracted axes always whole)."""
    chunk = list(shape)
    if stacked and chunk:
        chunk[0] = 1
    for axis in range(1 if stacked else 0, len(shape)):
        size = int(np.prod(chunk)) * itemsize
        if size <= max_bytes:
            break
        if axis in contract:
            continue
        per = size // chunk[axis]  # bytes of one index on this axis
        chunk[axis] = max(1, min(shape[axis], max_bytes // max(per, 1)))
    return tuple(chunk)


def _scale_index(index: Any, scale_shape: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """The scale's part of `index` into the weight: the same on the per-channel axes, whole (or 0 for an
    int) on the size-1 contracted ones, so that both drop the same axes and the scale broadcasts."""
    if index is None:
        return None
    idx = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in idx):
        raise ConversionError("internal: an Ellipsis index into a quantized weight")
    return tuple((0 if isinstance(i, (int, np.integer)) else slice(None)) if scale_shape[k] == 1 != shape[k] else i
                 for k, i in enumerate(idx))


class DequantizedReader:
    """A `WeightReader` of a quantized checkpoint as its float model: `config` is the float config
    (quantization "none"), `leaves` and `chunk_shape` name the float weights, and `read(NAME, index)` of a
    quantized one reads `NAME.qvalue[index]` and the matching slice of `NAME.scale` alone and returns
    `qvalue * scale` (float32) in the config's dtype, as `quant.dequantize` does."""

    def __init__(self, reader: WeightReader) -> None:
        self.reader, self.path = reader, reader.path
        self.scheme = reader.config.quantization
        self.config = reader.config.replace(quantization=quant.NONE)
        self.dtype = np.dtype(jnp.dtype(self.config.dtype))
        self.quantized = {n for n, s in expected_leaves(self.config).items() if s.contract}
        self.leaves: dict[str, tuple[tuple[int, ...], Any]] = {}
        for name in expected_leaves(self.config):
            if name in self.quantized:
                self.leaves[name] = (tuple(reader.leaves[f"{name}.qvalue"][0]), self.dtype)
            else:
                self.leaves[name] = reader.leaves[name]

    def chunk_shape(self, name: str) -> tuple[int, ...]:
        """The storage chunk of the weight (of its qvalue, for a quantized one)."""
        return self.reader.chunk_shape(f"{name}.qvalue" if name in self.quantized else name)

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The whole float weight, or `weight[index]` (an int or a tuple of ints and slices)."""
        if name not in self.quantized:
            return self.reader.read(name, index)
        shape = self.reader.leaves[f"{name}.qvalue"][0]
        sshape = self.reader.leaves[f"{name}.scale"][0]
        q = self.reader.read(f"{name}.qvalue", index)
        s = self.reader.read(f"{name}.scale", _scale_index(index, tuple(sshape), tuple(shape)))
        return (q.astype(np.float32) * s.astype(np.float32)).astype(self.dtype)
