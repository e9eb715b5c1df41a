"""Model weights: a pytree of small dataclasses whose leaves declare logical axes.

`abstract(cfg)` returns the same tree with `ParamSpec` leaves (shape, dtype, logical axes,
initialiser) and no memory behind them. Everything else derives from it: `init` creates the
arrays straight into their shardings, the checkpoint code restores into the same shapes and
shardings, `count_params` reports sizes, and the planner AOT-compiles against it.

Layers are stacked on a leading `layers` axis and run under `lax.scan`; the first-k dense layers
are their own stack.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from clover_jax.config import ModelConfig
from clover_jax.errors import ConfigError, ShardingError
from clover_jax.mesh.rules import DEFAULT_RULES, ShardingRules, as_tuple, logical_to_spec
from clover_jax.model import quant

Array = jax.Array


@dataclass(frozen=True)
class ParamSpec:
    """What one weight will be: a pytree leaf (a plain class, not registered as a node)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]  # one logical axis name per dimension
    init: str = "normal"  # normal | ones | zeros | constant
    std: float = 0.02
    value: float = 0.0  # the fill of init="constant"
    contract: tuple[int, ...] = ()  # a matmul weight: the axes its matmuls contract (what quantization keys on)

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)

    @property
    def size(self) -> int:
        """Number of elements: the product of `shape`."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def stacked(self, n: int) -> ParamSpec:
        """The same weight with a leading `layers` axis of size `n`."""
        return ParamSpec((n, *self.shape), self.dtype, ("layers", *self.axes), self.init, self.std, self.value,
                         tuple(a + 1 for a in self.contract))

    def quantized(self, scheme: str) -> quant.QArray:
        """This matmul weight as a quantized one (`quant`): a QArray of a qvalue spec (same shape and axes, the
        scheme's storage type) and a float32 scale spec (size 1 and no logical axis on the contracted axes)."""
        assert self.contract, "only matmul weights (ParamSpec.contract) are quantized"
        qstd = quant.QSTD[scheme]
        qvalue = ParamSpec(self.shape, quant.QTYPES[scheme], self.axes, "normal", qstd)
        scale = ParamSpec(quant.scale_shape(self.shape, self.contract), jnp.float32,
                          tuple(None if i in self.contract else a for i, a in enumerate(self.axes)),
                          "constant", value=self.std / qstd)
        return quant.QArray(qvalue=qvalue, scale=scale, qtype=quant.QTYPES[scheme])

    def struct(self, sharding: Any = None) -> jax.ShapeDtypeStruct:
        """A `jax.ShapeDtypeStruct` of this shape and dtype, with `sharding` if given."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)


def is_spec(x: Any) -> bool:
    """Whether `x` is a ParamSpec (the `is_leaf` of tree walks over a spec tree)."""
    return isinstance(x, ParamSpec)


@struct.dataclass
class MLPWeights:
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    gate: Any  # [embed, mlp]
    up: Any  # [embed, mlp]
    down: Any  # [mlp, embed]


@struct.dataclass
class MoEWeights:
    """A MoE MLP: router, routed experts stacked on `experts`, optional shared expert."""

    router: Any  # [embed, experts], float32
    expert_bias: Any  # [experts] float32 selection bias, or None
    gate: Any  # [experts, embed, expert_mlp]
    up: Any  # [experts, embed, expert_mlp]
    down: Any  # [experts, expert_mlp, embed]
    shared: Any  # MLPWeights or None
    shared_gate: Any = None  # [embed, 1]: the shared expert scaled by sigmoid(x @ shared_gate), or None


@struct.dataclass
class AttentionWeights:
    """Grouped-query attention projections, optional output gate and QK-norm scales."""

    q: Any  # [embed, q_heads, head_dim]
    k: Any  # [embed, kv_heads, head_dim]
    v: Any  # [embed, kv_heads, head_dim]
    o: Any  # [q_heads, head_dim, embed]
    gate: Any  # [embed, q_heads, head_dim] output gate, or None
    q_norm: Any  # [head_dim] or None
    k_norm: Any  # [head_dim] or None


@struct.dataclass
class GatedDeltaNetWeights:
    """A Gated DeltaNet (linear attention) mixer.

    Its C conv channels are grouped by key head (`group_channels`): group g is [the queries of key head g (dk) |
    its keys (dk) | the values of the r = Hv / Hk value heads that read it (r dv)], `linear_group_dim(cfg)`
    channels. So one split of the key heads (`linear_key_heads`) in contiguous blocks splits q, k, v, both
    convs and the conv tail by heads, and a split of the value heads (`linear_heads`) over the same mesh axis
    gives every device the value heads of its own key heads (z, a, b, out, the per-head vectors, the state).
    The convs keep the key heads as an axis of their own; the projection `qkv` keeps them flattened into C
    (heads major), the 2-D matmul of the fused layout, which the TPU compiler runs on the stored weight without
    first copying it into another layout (it copies a stacked [embed, heads, ...] projection whole).
    """

    qkv: Any  # [embed, linear_key_heads] projection to the conv's C channels (Hk groups of linear_group_dim)
    conv: Any  # [conv_kernel, linear_key_heads, linear_conv] depthwise causal conv
    z: Any  # [embed, linear_heads, head_dim] output-gate projection
    b: Any  # [embed, linear_heads] -> beta = sigmoid(b)
    a: Any  # [embed, linear_heads] -> g = -exp(a_log) * softplus(a + dt_bias)
    a_log: Any  # [linear_heads] float32
    dt_bias: Any  # [linear_heads] float32
    norm: Any  # [head_dim] float32 scale of the gated RMSNorm
    out: Any  # [linear_heads, head_dim, embed]
    # Clover's block-diffusion tensors (None unless cfg.has_bd_weights); see gated_deltanet.mixer.
    conv_right: Any = None  # [bd_conv_right_kernel, linear_key_heads, linear_conv] right-looking depthwise conv
    # inside a block
    bd_logit_scale: Any = None  # [linear_heads] float32 scale of the in-block softmax logits
    bd_history_bias: Any = None  # [linear_heads] float32 logit of the history slot
    bd_history_c: Any = None  # [linear_heads] float32 coefficient of the history read-out


@struct.dataclass
class LayerWeights:
    """One decoder layer: attention (or a Gated DeltaNet) and MLP, each after its RMSNorm."""

    attn_norm: Any  # [embed]
    attn: Any  # AttentionWeights, or GatedDeltaNetWeights in `linear_layers`
    mlp_norm: Any  # [embed]
    mlp: Any  # MLPWeights (dense layers) or MoEWeights


@struct.dataclass
class Weights:
    """The whole model: embedding, dense and MoE layer stacks, final norm, LM head."""

    embed: Any  # [vocab, embed]
    dense_layers: Any  # LayerWeights stacked on `layers`, or None
    moe_layers: Any  # LayerWeights stacked on `layers`, or None (hybrid: the full-attention layers)
    final_norm: Any  # [embed]
    lm_head: Any  # [embed, vocab], or None when tied to embed
    linear_layers: Any = None  # hybrid: the Gated DeltaNet layers, stacked on `layers`, or None


def _mlp(d: int, f: int, dtype: Any, std: float, mlp_axis: str = "mlp") -> MLPWeights:
    return MLPWeights(
        gate=ParamSpec((d, f), dtype, ("embed", mlp_axis), std=std, contract=(0,)),
        up=ParamSpec((d, f), dtype, ("embed", mlp_axis), std=std, contract=(0,)),
        down=ParamSpec((f, d), dtype, (mlp_axis, "embed"), std=std, contract=(0,)),
    )


def _norm(n: int, cfg: ModelConfig, axis: str = "norm") -> ParamSpec:
    """An RMSNorm scale: ones, or zeros for the (1 + w) form."""
    return ParamSpec((n,), jnp.float32, (axis,), init="zeros" if cfg.norm_unit_offset else "ones")


def _attention(cfg: ModelConfig) -> AttentionWeights:
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    dt, std = jnp.dtype(cfg.dtype), cfg.init_std
    return AttentionWeights(
        q=ParamSpec((d, h, hd), dt, ("embed", "q_heads", "head_dim"), std=std, contract=(0,)),
        k=ParamSpec((d, kv, hd), dt, ("embed", "kv_heads", "head_dim"), std=std, contract=(0,)),
        v=ParamSpec((d, kv, hd), dt, ("embed", "kv_heads", "head_dim"), std=std, contract=(0,)),
        o=ParamSpec((h, hd, d), dt, ("q_heads", "head_dim", "embed"), std=std, contract=(0, 1)),
        gate=ParamSpec((d, h, hd), dt, ("embed", "q_heads", "head_dim"), std=std, contract=(0,))
        if cfg.attn_output_gate else None,
        q_norm=_norm(hd, cfg, "head_dim") if cfg.qk_norm else None,
        k_norm=_norm(hd, cfg, "head_dim") if cfg.qk_norm else None,
    )


def linear_group_dim(cfg: ModelConfig) -> int:
    """Conv channels per key-head group of a Gated DeltaNet: 2 dk + (Hv / Hk) dv (`GatedDeltaNetWeights`)."""
    return (2 * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads // cfg.linear_num_key_heads * cfg.linear_value_head_dim)


def _channel_parts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(Hk, dk, r dv): the key heads and the per-group widths of queries / keys and of values."""
    hk = cfg.linear_num_key_heads
    return hk, cfg.linear_key_head_dim, cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim


def group_channels(x: Any, cfg: ModelConfig) -> Any:
    """Gated DeltaNet conv channels from the fused order to the native one: x [..., C] with C = [queries (Hk dk) |
    keys (Hk dk) | values (Hv dv)] (HF's `in_proj_qkv` rows and conv channels, and native checkpoints written
    before the grouping) -> [..., Hk, linear_group_dim(cfg)], group g = [q_g | k_g | the values of value heads
    g r .. g r + r - 1]. A pure permutation (bit-exact); numpy in, numpy out, a jax array in, a jax array out."""
    hk, dk, vd = _channel_parts(cfg)
    if x.shape[-1] != hk * (2 * dk + vd):
        raise ValueError(f"{x.shape[-1]} channels, expected {hk * (2 * dk + vd)} ([q | k | v] of {cfg.name!r})")
    xp = jnp if isinstance(x, jax.Array) else np
    lead = x.shape[:-1]
    q, k, v = x[..., :hk * dk], x[..., hk * dk:2 * hk * dk], x[..., 2 * hk * dk:]
    return xp.concatenate([q.reshape(*lead, hk, dk), k.reshape(*lead, hk, dk), v.reshape(*lead, hk, vd)], axis=-1)


def ungroup_channels(x: Any, cfg: ModelConfig) -> Any:
    """The inverse of `group_channels`: [..., Hk, linear_group_dim(cfg)] -> [..., C] in [q | k | v] order."""
    hk, dk, vd = _channel_parts(cfg)
    if tuple(x.shape[-2:]) != (hk, 2 * dk + vd):
        raise ValueError(f"channels {tuple(x.shape[-2:])}, expected {(hk, 2 * dk + vd)} (groups of {cfg.name!r})")
    xp = jnp if isinstance(x, jax.Array) else np
    lead = x.shape[:-2]
    parts = (x[..., :dk], x[..., dk:2 * dk], x[..., 2 * dk:])
    return xp.concatenate([a.reshape(*lead, -1) for a in parts], axis=-1)


def _gated_deltanet(cfg: ModelConfig) -> GatedDeltaNetWeights:
    d, hv, dv = cfg.d_model, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    hk, p = cfg.linear_num_key_heads, linear_group_dim(cfg)
    dt, std = jnp.dtype(cfg.dtype), cfg.init_std
    f32 = jnp.float32
    return GatedDeltaNetWeights(
        qkv=ParamSpec((d, hk * p), dt, ("embed", "linear_key_heads"), std=std, contract=(0,)),
        conv=ParamSpec((cfg.linear_conv_kernel_dim, hk, p), dt, (None, "linear_key_heads", "linear_conv"), std=0.5),
        z=ParamSpec((d, hv, dv), dt, ("embed", "linear_heads", "head_dim"), std=std, contract=(0,)),
        b=ParamSpec((d, hv), dt, ("embed", "linear_heads"), std=std, contract=(0,)),
        a=ParamSpec((d, hv), dt, ("embed", "linear_heads"), std=std, contract=(0,)),
        a_log=ParamSpec((hv,), f32, ("linear_heads",), init="zeros"),  # A = 1: a moderate decay
        dt_bias=ParamSpec((hv,), f32, ("linear_heads",), init="ones"),
        norm=ParamSpec((dv,), f32, ("head_dim",), init="ones"),
        out=ParamSpec((hv, dv, d), dt, ("linear_heads", "head_dim", "embed"), std=std, contract=(0, 1)),
        **(_block_diffusion(cfg) if cfg.has_bd_weights else {}),
    )


def _block_diffusion(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Clover's four extra Gated DeltaNet tensors, initialised so that a fresh layer starts close to the causal
    one plus a moderately sharp in-block softmax: no right conv, logit scale sqrt(dk), history slot at par."""
    hv, f32 = cfg.linear_num_value_heads, jnp.float32
    return dict(
        conv_right=ParamSpec((cfg.bd_conv_right_kernel, cfg.linear_num_key_heads, linear_group_dim(cfg)),
                             jnp.dtype(cfg.dtype), (None, "linear_key_heads", "linear_conv"), init="zeros"),
        bd_logit_scale=ParamSpec((hv,), f32, ("linear_heads",), init="constant",
                                 value=float(cfg.linear_key_head_dim) ** 0.5),
        bd_history_bias=ParamSpec((hv,), f32, ("linear_heads",), init="zeros"),
        bd_history_c=ParamSpec((hv,), f32, ("linear_heads",), init="ones"),
    )


def _layer(cfg: ModelConfig, moe: bool, linear: bool = False) -> LayerWeights:
    d = cfg.d_model
    dt, std = jnp.dtype(cfg.dtype), cfg.init_std
    attn = _gated_deltanet(cfg) if linear else _attention(cfg)
    if moe:
        e, f = cfg.n_experts, cfg.expert_mlp_dim
        mlp: Any = MoEWeights(
            router=ParamSpec((d, e), jnp.float32, ("embed", "experts_replicated"), std=std),
            expert_bias=ParamSpec((e,), jnp.float32, ("experts_replicated",), init="zeros")
            if cfg.use_expert_bias else None,
            gate=ParamSpec((e, d, f), dt, ("experts", "embed", "expert_mlp"), std=std, contract=(1,)),
            up=ParamSpec((e, d, f), dt, ("experts", "embed", "expert_mlp"), std=std, contract=(1,)),
            down=ParamSpec((e, f, d), dt, ("experts", "expert_mlp", "embed"), std=std, contract=(1,)),
            shared=_mlp(d, cfg.shared_mlp_dim, dt, std) if cfg.n_shared_experts else None,
            shared_gate=ParamSpec((d, 1), dt, ("embed", None), std=std) if cfg.shared_expert_gate else None,
        )
    else:
        mlp = _mlp(d, cfg.dense_mlp_dim, dt, std)
    return LayerWeights(attn_norm=_norm(d, cfg), attn=attn, mlp_norm=_norm(d, cfg), mlp=mlp)


def _stack(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda s: s.stacked(n), tree, is_leaf=is_spec)


def abstract(cfg: ModelConfig) -> Weights:
    """The weight tree with ParamSpec leaves: shapes, dtypes, logical axes; no memory.

    Hybrid configs: `moe_layers` holds the full-attention layers, `linear_layers` the Gated DeltaNet ones.
    Quantized configs (`cfg.quantization`): every matmul weight is a `quant.QArray` of a qvalue and a scale spec.
    """
    dt, std = jnp.dtype(cfg.dtype), cfg.init_std
    n_attn_moe = cfg.n_moe_layers - cfg.n_linear_layers
    tree = Weights(
        embed=ParamSpec((cfg.vocab_size, cfg.d_model), dt, ("vocab", "embed"), std=std),
        dense_layers=_stack(_layer(cfg, moe=False), cfg.n_dense_layers) if cfg.n_dense_layers else None,
        moe_layers=_stack(_layer(cfg, moe=True), n_attn_moe) if n_attn_moe else None,
        final_norm=_norm(cfg.d_model, cfg),
        lm_head=None if cfg.tie_embeddings
        else ParamSpec((cfg.d_model, cfg.vocab_size), dt, ("embed", "vocab"), std=std, contract=(0,)),
        linear_layers=_stack(_layer(cfg, moe=True, linear=True), cfg.n_linear_layers) if cfg.is_hybrid else None,
    )
    if cfg.quantization == quant.NONE:
        return tree
    return jax.tree.map(lambda s: s.quantized(cfg.quantization) if s.contract else s, tree, is_leaf=is_spec)


def shape_structs(cfg: ModelConfig, shardings: Any = None) -> Any:
    """jax.ShapeDtypeStruct leaves (optionally with shardings): for AOT lowering and restore."""
    specs = abstract(cfg)
    if shardings is None:
        return jax.tree.map(lambda s: s.struct(), specs, is_leaf=is_spec)
    return jax.tree.map(lambda s, sh: s.struct(sh), specs, shardings, is_leaf=is_spec)


def _mix32(h: Array) -> Array:
    """A bijective 32-bit integer mixer (xorshift-multiply, the "lowbias32" constants)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x21F0AAAD)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x735A2D97)
    return h ^ (h >> 15)


def standard_normal(key: Array, shape: tuple[int, ...]) -> Array:
    """float32 N(0, 1) draws of `shape`, each a function of the key and of its own coordinates only.

    A counter-based hash (the key's bits, then each coordinate in turn, through `_mix32`) gives 24 uniform bits
    per element, turned into a normal by the inverse CDF (sqrt(2) erfinv(u), as `jax.random.normal` does).
    Why not `jax.random.normal`: XLA:CPU spends 1-3 s compiling each threefry draw, one per weight of a distinct
    shape (a minute for a small model's initialiser); this is a few integer ops per element, compiles in
    well under a second, and (being elementwise over coordinates) gives the same values whatever the sharding.
    Not for sampling: statistical quality is that of a good hash, ample for initial weights.
    """
    bits = jax.random.key_data(key).astype(jnp.uint32).reshape(-1)
    h = jnp.broadcast_to(_mix32(bits[0] ^ _mix32(bits[-1] + jnp.uint32(0x9E3779B9))), shape)
    for axis in range(len(shape)):
        h = _mix32(h + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(0x9E3779B9))
    u = (h >> 8).astype(jnp.float32) * (2.0 / 2**24) - (1.0 - 2.0**-24)  # in (-1, 1), symmetric
    return jnp.sqrt(jnp.float32(2.0)) * jax.lax.erf_inv(u)


def _init_leaf(spec: ParamSpec, key: Array) -> Array:
    if spec.init == "ones":
        return jnp.ones(spec.shape, spec.dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, spec.dtype)
    if spec.init == "constant":
        return jnp.full(spec.shape, spec.value, spec.dtype)
    x = spec.std * standard_normal(key, spec.shape)
    if jnp.issubdtype(spec.dtype, jnp.integer):  # an int8 qvalue: rounded into range
        x = jnp.clip(jnp.round(x), -127, 127)
    elif jnp.dtype(spec.dtype).itemsize == 1:  # an fp8 qvalue: e4m3 has no infinity, past its max is NaN
        top = float(jnp.finfo(spec.dtype).max)
        x = jnp.clip(x, -top, top)
    return x.astype(spec.dtype)


def init(cfg: ModelConfig, key: Array, shardings: Any = None) -> Weights:
    """Random weights, created by one jitted program directly in their shardings.

    With `shardings` (a tree matching `abstract(cfg)`, e.g. from `weight_shardings`) no
    host ever holds a whole weight: each device generates its own shard.
    """
    if shardings is None:
        return _init_program(cfg)(key)
    return jax.jit(functools.partial(_make, cfg), out_shardings=shardings)(key)


def _make(cfg: ModelConfig, key: Array) -> Weights:
    leaves, treedef = jax.tree.flatten(abstract(cfg), is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [_init_leaf(s, k) for s, k in zip(leaves, keys, strict=True)])


@functools.lru_cache(maxsize=8)
def _init_program(cfg: ModelConfig) -> Callable[[Array], Weights]:
    """One compiled initialiser per config (tests and notebooks initialise the same config many times)."""
    return jax.jit(functools.partial(_make, cfg))


def map_specs(fn: Callable[[ParamSpec], Any], cfg_or_specs: Any) -> Any:
    """`fn` on every ParamSpec leaf of `abstract(cfg)` (or of a spec tree given instead), in the same tree."""
    specs = abstract(cfg_or_specs) if isinstance(cfg_or_specs, ModelConfig) else cfg_or_specs
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """(dotted path, leaf) pairs: stable names for errors, checkpoints and conversion."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)[0]:
        out.append((jax.tree_util.keystr(path, simple=True, separator="."), leaf))
    return out


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a config (`count_params`): all, active per token, routed experts, embed + lm_head."""

    total: int
    active: int  # per token: everything except the routed experts a token does not visit
    routed_experts: int
    embedding: int


def count_params(cfg: ModelConfig) -> ParamCount:
    """Parameter counts from the abstract tree (of the float model: a scale is not a parameter); allocates
    nothing."""
    total = routed = embedding = 0
    for name, spec in named_leaves(abstract(cfg.replace(quantization=quant.NONE))):
        total += spec.size
        if "experts" in spec.axes:
            routed += spec.size
        if name in ("embed", "lm_head"):
            embedding += spec.size
    active = total - routed + (routed * cfg.n_experts_per_tok // cfg.n_experts if cfg.n_experts else 0)
    return ParamCount(total=total, active=active, routed_experts=routed, embedding=embedding)


def _check_divides(name: str, spec: ParamSpec, pspec: PartitionSpec, mesh: Mesh) -> None:
    for dim, (size, ax_name, part) in enumerate(zip(spec.shape, spec.axes, pspec, strict=True)):
        if part is None:
            continue
        n = int(np.prod([mesh.shape[a] for a in as_tuple(part)]))
        if size % n:
            raise ShardingError(
                f"weight {name!r} dim {dim} (logical axis {ax_name!r}, size {size}) is not divisible by "
                f"mesh axis {part!r} of size {n}; change the mesh or the rule for {ax_name!r}")


def weight_shardings(cfg_or_specs: ModelConfig | Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """NamedSharding per weight (a tree matching `abstract(cfg)`); raises ShardingError naming the
    weight, axis and sizes of the first rule that does not divide its dimension.

    A quantized weight's scale takes its qvalue's PartitionSpec with the size-1 (contracted) axes unsplit, so
    the two are always split alike (resolving the scale's own logical axes could give a mesh axis that the
    qvalue spends on a contracted dimension to a later one).
    """
    specs = abstract(cfg_or_specs) if isinstance(cfg_or_specs, ModelConfig) else cfg_or_specs
    for name, spec in named_leaves(specs):
        if not name.endswith(".scale"):
            _check_divides(name, spec, logical_to_spec(spec.axes, rules, mesh), mesh)

    def shard(s: Any) -> Any:
        if not quant.is_quantized(s):
            return NamedSharding(mesh, logical_to_spec(s.axes, rules, mesh))
        ps = logical_to_spec(s.qvalue.axes, rules, mesh)
        scale = NamedSharding(mesh, quant.scale_spec(ps, s.scale.shape))
        return quant.QArray(qvalue=NamedSharding(mesh, ps), scale=scale, qtype=s.qtype)

    return jax.tree.map(shard, specs, is_leaf=lambda x: is_spec(x) or quant.is_quantized(x))


def quantize_weights(cfg: ModelConfig, weights: Weights, scheme: str) -> tuple[ModelConfig, Weights]:
    """(the config with `quantization=scheme`, the float `weights` of `cfg` quantized per output channel:
    every matmul weight a `quant.QArray`, the rest as it was). ConfigError if `cfg` is already quantized."""
    quant.check_scheme(scheme)
    if cfg.quantization != quant.NONE:
        raise ConfigError(f"config {cfg.name!r} is already quantized ({cfg.quantization}); quantize its float "
                          "weights instead")
    if scheme == quant.NONE:
        return cfg, weights
    specs = abstract(cfg)
    out = jax.tree.map(lambda s, w: quant.quantize(w, s.contract, scheme) if s.contract else w, specs, weights,
                       is_leaf=is_spec)
    return cfg.replace(quantization=scheme), out


def dequantize_weights(cfg: ModelConfig, weights: Weights) -> tuple[ModelConfig, Weights]:
    """(the float config, `weights` with every quantized weight turned back into `cfg.dtype`): the inverse of
    `quantize_weights` up to its rounding."""
    dt = jnp.dtype(cfg.dtype)
    out = jax.tree.map(lambda w: quant.dequantize(w, dt), weights, is_leaf=quant.is_quantized)
    return cfg.replace(quantization=quant.NONE), out
