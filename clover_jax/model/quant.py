"""Weight-only quantization: per-channel int8 or fp8 (e4m3) weights as Qwix `QArray`s in the weight pytree.

A quantized weight is `qwix.QArray(qvalue, scale)`: `qvalue` has the weight's shape in int8 or float8_e4m3fn,
`scale` (float32) has the same rank with size 1 on the axes the matmul contracts and one value per output
channel elsewhere, so `weight ~= qvalue * scale` (Qwix's absmax calibration: the largest |w| of a channel maps to
127.5, rounded into int8's range, or to 448 for e4m3). Both leaves carry logical axes (the scale's contracted
axes are None), so the sharding rules of the float model apply unchanged.

Which weights: the matmul weights, whose `ParamSpec.contract` names the contracted axes: attention and
Gated DeltaNet projections, dense / shared / routed expert MLPs and the LM head. Embeddings, norms, the
router, convs and the small per-head vectors stay as they are.

The matmuls (`einsum`, `matmul`, `ragged_dot`) take a float array or a QArray on the right. For a QArray
they go through Qwix's ops, which dequantize the weight into the activations' dtype next to the dot (XLA
fuses the convert and the scale into the matmul on GPU and TPU); no float copy of all weights is ever made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from clover_jax.config import QUANTIZATIONS
from clover_jax.errors import ConfigError

Array = jax.Array
QArray = qwix.QArray

NONE = "none"
SCHEMES = QUANTIZATIONS
# The storage type of each scheme (the QArray's static `qtype` is this very object, so trees compare equal).
QTYPES: dict[str, Any] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
assert (NONE, *QTYPES) == SCHEMES
# Random init of a quantized weight (tests, benchmarks, the planner): qvalue ~ N(0, QSTD^2) rounded into
# range, scale = std / QSTD, so the weight is ~N(0, std^2) as in the float model.
QSTD = {"int8": 32.0, "fp8": 64.0}


def is_quantized(w: Any) -> bool:
    """Whether `w` is a quantized weight (a QArray), of arrays or of specs."""
    return isinstance(w, QArray)


def check_scheme(scheme: str) -> str:
    """`scheme` if it names a quantization ('none', 'int8', 'fp8'), else ConfigError listing them."""
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown quantization {scheme!r}; known: {', '.join(SCHEMES)}")
    return scheme


def scale_shape(shape: tuple[int, ...], contract: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape: 1 on the contracted axes, the weight's size elsewhere."""
    return tuple(1 if i in contract else n for i, n in enumerate(shape))


def quantize(w: Array, contract: tuple[int, ...], scheme: str) -> QArray:
    """Per-channel absmax quantization of a float weight (Qwix): one scale per index of the axes not in
    `contract`. Runs in float32 whatever w's dtype; scale float32."""
    if scheme not in QTYPES:
        raise ConfigError(f"cannot quantize to {scheme!r}; choose one of {', '.join(QTYPES)}")
    channels = tuple(i for i in range(w.ndim) if i not in contract)
    q = qwix.quantize(jnp.asarray(w, jnp.float32), QTYPES[scheme], channelwise_axes=channels)
    return QArray(qvalue=q.qvalue, scale=q.scale.astype(jnp.float32), qtype=QTYPES[scheme])


def dequantize(w: Any, dtype: Any = jnp.float32) -> Any:
    """The float weight `qvalue * scale` in `dtype` for a QArray; anything else is returned as is."""
    if not is_quantized(w):
        return w
    return (w.qvalue.astype(jnp.float32) * w.scale.astype(jnp.float32)).astype(dtype)


def _rhs(x: Array, w: QArray) -> QArray:
    """The weight dequantized into x's dtype (the QArray's scale dtype decides it)."""
    return dataclasses.replace(w, scale=w.scale.astype(x.dtype))


def einsum(eq: str, x: Array, w: Any, preferred_element_type: Any = None) -> Array:
    """`jnp.einsum(eq, x, w, preferred_element_type=...)` for a float or quantized weight `w`."""
    if not is_quantized(w):
        return jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type)
    out = preferred_element_type
    if out is None or jnp.dtype(out) == x.dtype:
        return qwix.einsum(eq, x, _rhs(x, w), preferred_element_type=out)
    mixed = lambda x, w: qwix.einsum(eq, x, _rhs(x, w), preferred_element_type=out)
    # XLA:CPU has no bf16 x bf16 -> f32 dot for a dequantized operand: there both sides go to the output dtype.
    wide = lambda x, w: qwix.einsum(eq, x.astype(out), dataclasses.replace(w, scale=w.scale.astype(out)),
                                    preferred_element_type=out)
    return jax.lax.platform_dependent(x, w, cpu=wide, default=mixed)


def matmul(x: Array, w: Any) -> Array:
    """`x @ w` (x [..., D], w [D, F]) for a float or quantized weight."""
    if is_quantized(w):
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return qwix.dot_general(x, _rhs(x, w), dims)
    return x @ w


def ragged_dot(x: Array, w: Any, group_sizes: Array) -> Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` (w [E, D, F]) for a float or quantized weight."""
    if is_quantized(w):
        return qwix.ragged_dot(x, _rhs(x, w), group_sizes)
    return jax.lax.ragged_dot(x, w, group_sizes)


def index(w: Any, i: Any) -> Any:
    """w[i] on the leading axis, for an array or a QArray (its scale keeps that axis)."""
    return jax.tree.map(lambda a: a[i], w)


def scale_spec(pspec: Any, scale_shape: tuple[int, ...]) -> jax.sharding.PartitionSpec:
    """The PartitionSpec of a scale from its qvalue's: split alike, its size-1 (contracted) axes unsplit."""
    parts = tuple(pspec) + (None,) * (len(scale_shape) - len(pspec))
    return jax.sharding.PartitionSpec(*(None if n == 1 else p for n, p in zip(scale_shape, parts, strict=True)))


def leaf_spec(pspec: Any, w: Any) -> Any:
    """A shard_map spec for `w` from the weight's PartitionSpec: for a QArray, one for qvalue and scale."""
    if not is_quantized(w):
        return pspec
    return QArray(qvalue=pspec, scale=scale_spec(pspec, w.scale.shape), qtype=w.qtype)


# ---- backends ---------------------------------------------------------------------------------------

# GPUs with fp8 tensor cores (compute capability 8.9+) and TPUs with fp8 matrix units.
_FP8_TPU_KINDS = ("tpu7", "tpu v7", "ironwood")


def fp8_support(device: Any) -> tuple[bool, str]:
    """(whether `device` runs fp8 weights, what it is). CPU: yes, emulated (tests and tools). GPU: compute
    capability 8.9 or later (L4, H100, H200, B200). TPU: v7; v5e, v5p and v6e have no fp8 matrix units."""
    name = str(getattr(device, "device_kind", device))
    kind = name.lower()
    platform = getattr(device, "platform", "tpu" if "tpu" in kind else "gpu")
    if platform == "cpu":
        return True, "cpu"
    if platform == "gpu" or platform == "cuda":
        cc = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(p) for p in str(cc).split(".")[:2])
        except ValueError:
            return False, f"GPU {name} (compute capability {cc})"
        return (major, minor) >= (8, 9), f"GPU {name} (compute capability {cc})"
    return any(k in kind for k in _FP8_TPU_KINDS), name if name.upper().startswith("TPU") else f"TPU {name}"


def check_backend(scheme: str, devices: Any = None) -> None:
    """ConfigError unless `scheme` weights are offered on every device: int8 anywhere; fp8 on chips with fp8
    matrix units and on CPU. A policy, not a limit of the code: the matmuls dequantize fp8 into the activations'
    dtype on every backend (weight-only), so fp8 buys no fp8 compute today, and where the chip has no fp8 units
    int8 is the same size and measured closer to bf16 (docs/quantization.md)."""
    if scheme != "fp8":
        return
    for d in devices if devices is not None else jax.devices():
        ok, what = fp8_support(d)
        if not ok:
            raise ConfigError(f"fp8 weights are for chips with fp8 matrix units (GPU compute capability 8.9+, "
                              f"TPU v7); this is a {what}: use int8 weights, the same size and closer to bf16 "
                              "(clover convert --quantize int8)")
