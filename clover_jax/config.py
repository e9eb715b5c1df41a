"""Model configurations: one frozen, hashable dataclass and a table of named presets.

A config is a static argument of every jitted function, so it must be hashable and never
mutated; derive variants with `dataclasses.replace(cfg, ...)`, which re-runs validation.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from clover_jax.errors import ConfigError
from clover_jax.jsonfile import read_object

Family = Literal["clover", "llada2_moe", "llada_moe", "qwen3_moe", "qwen3_5_moe"]
AttentionMode = Literal["bidirectional", "block_causal"]
RouterKind = Literal["softmax", "sigmoid"]

FAMILIES = ("clover", "llada2_moe", "llada_moe", "qwen3_moe", "qwen3_5_moe")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "fp8")  # weight-only schemes of `model.quant`
ATTENTION_IMPLS = ("auto", "dense", "chunked", "splash")  # how attention layers compute (ModelConfig.attention_impl)
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"  # the two kinds of `layer_types`
# How Gated DeltaNet layers use Clover's block-diffusion tensors (docs/model.md): causal_prefix as Clover's ports run
# it, reconstructed (this project's earlier reading), none (ignored: the plain causal model, as llama.cpp runs it).
BD_GDN_MODES = ("none", "reconstructed", "causal_prefix")
MAX_LAYER_GROUP = 8  # the layers of one group are unrolled inside the scan over groups


@dataclass(frozen=True)
class ModelConfig:
    """A model's sizes, MoE routing, attention, special tokens and numerics; validated on construction
    (ConfigError), frozen and hashable."""

    name: str
    family: Family
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    # Mixture of experts. Layers [0, n_dense_layers) use a dense SwiGLU MLP of width dense_mlp_dim.
    n_experts: int
    n_experts_per_tok: int
    expert_mlp_dim: int
    n_shared_experts: int = 0
    shared_mlp_dim: int = 0  # total width of the shared expert(s), fused into one SwiGLU
    n_dense_layers: int = 0
    dense_mlp_dim: int = 0
    router: RouterKind = "softmax"
    norm_topk_prob: bool = True
    n_expert_groups: int = 1  # group-limited top-k (sigmoid routers)
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    use_expert_bias: bool = False  # selection bias (aux-loss-free balancing); never weights the output
    # Attention.
    attention: AttentionMode = "bidirectional"
    block_size: int = 32  # block-causal attention and the default sampler block
    qk_norm: bool = True
    attn_output_gate: bool = False  # out = attn * sigmoid(x @ w_gate), per head
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w), w zero-initialised (Qwen3.5) instead of by w
    # Hybrid backbone (Qwen3.5 / Clover): each layer's sequence mixer, "linear_attention" (Gated DeltaNet)
    # or "full_attention"; None = full attention everywhere. The kinds must repeat in groups (e.g. 3 + 1).
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x @ w_gate) (Qwen3.5)
    # Clover's block-diffusion Gated DeltaNet. `bd_conv_right_kernel` > 0: every Gated DeltaNet layer carries
    # the four extra tensors (conv_right_weight of that many taps, bd_softmax_logit_scale / _history_bias /
    # _history_c). `bd_gdn` says how they are used (docs/model.md): "causal_prefix" (as Clover's ports run it: the
    # prompt and every committed block through the plain causal Qwen3.5 path, only the block being denoised
    # bidirectional, with the right conv and a block softmax over the clean state), "reconstructed" (this
    # project's earlier reading: every block, committed or not, in block-diffusion form, block-causal attention)
    # or "none" (ignored: the plain causal Gated DeltaNet, as llama.cpp runs Clover).
    bd_gdn: str = "none"
    bd_conv_right_kernel: int = 0
    # The block expert coreset (a causal-prefix model's block being denoised): every row of the block is routed,
    # the block keeps the `moe_block_coreset` experts its rows weight most, and each row's top-k is then taken
    # among those (docs/model.md). 0: off (every row routes over every expert).
    moe_block_coreset: int = 0
    # Special tokens.
    mask_token_id: int = -1  # -1: the last id of the vocabulary
    eos_token_id: int | None = 1  # None: the model has no end-of-sequence token (generation never stops early)
    pad_token_id: int | None = 0  # None: none declared (padding columns are masked out, any id fills them)
    # Numerics: weights and activations in `dtype`; router, norms and softmax always in float32.
    dtype: str = "bfloat16"
    init_std: float = 0.02
    # Weight-only quantization of the matmul weights (`model.quant`): "none", "int8" or "fp8" (e4m3), per
    # output channel. Recorded in config.json of a quantized checkpoint; activations stay in `dtype`.
    quantization: str = "none"
    # Default MoE dispatch on one device; sharded runs pick an expert-parallel one.
    moe_dispatch: str = "tiled"
    # How attention layers compute (`model.layers.attend`): "dense" holds a window's whole float32 score matrix;
    # "chunked" walks query and key chunks of `attention_chunk` columns with an online softmax (never more than
    # one chunk pair's scores); "auto" chunks a long prompt's windows (`layers.chunks_attention`: keys longer than a
    # chunk, and queries too or all rows' scores over 8 chunk x chunk squares) and, on a TPU, runs a causal-prefix
    # model's prefill through splash attention (`model.splash`); "splash" does so on any backend (off TPU in
    # Pallas' interpret mode), other windows as "auto".
    attention_impl: str = "auto"
    attention_chunk: int = 1024
    # Prompts are written into the cache in windows of `prefill_chunk` tokens over all rows (the sampler's B rows
    # share it: prefill_chunk / B columns, at least 64; the server's one row takes them all; `sampler.step.prefill`),
    # so a prefill's activations are bounded whatever the prompt's length and the batch; exact (block-causal
    # attention-only models write one block again per window). 0: the whole prompt in one pass.
    prefill_chunk: int = 4096

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # from JSON: keep the config hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        check_field_types(self)
        if self.mask_token_id == -1:
            object.__setattr__(self, "mask_token_id", self.vocab_size - 1)
        validate(self)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def n_moe_layers(self) -> int:
        """Layers with a MoE MLP: `n_layers - n_dense_layers`."""
        return self.n_layers - self.n_dense_layers

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates: `head_dim * partial_rotary_factor`."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head: `n_heads // n_kv_heads`."""
        return self.n_heads // self.n_kv_heads

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are Gated DeltaNet (`linear_attention`) layers."""
        return self.layer_types is not None and LINEAR_ATTENTION in self.layer_types

    @property
    def n_linear_layers(self) -> int:
        """Gated DeltaNet layers (0 unless hybrid)."""
        return 0 if self.layer_types is None else self.layer_types.count(LINEAR_ATTENTION)

    @property
    def n_attention_layers(self) -> int:
        """Full-attention layers: every layer unless hybrid."""
        return self.n_layers - self.n_linear_layers

    @property
    def layer_group(self) -> tuple[str, ...]:
        """The shortest run of layer kinds that `layer_types` repeats (the body of the layer scan)."""
        kinds = self.layer_types or (FULL_ATTENTION,) * self.n_layers
        for p in range(1, len(kinds) + 1):
            if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p):
                return kinds[:p]
        return kinds

    @property
    def linear_key_dim(self) -> int:
        """Channels of the Gated DeltaNet queries (and of its keys): key heads x key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Channels of the Gated DeltaNet values: value heads x value head dim."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the Gated DeltaNet conv: queries, keys and values side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def has_bd_weights(self) -> bool:
        """Whether the Gated DeltaNet layers carry Clover's four block-diffusion tensors."""
        return self.is_hybrid and self.bd_conv_right_kernel > 0

    @property
    def is_bd_gdn(self) -> bool:
        """Whether the Gated DeltaNet layers run a block-diffusion form (`bd_gdn` "reconstructed" or
        "causal_prefix")."""
        return self.bd_gdn in ("reconstructed", "causal_prefix")

    @property
    def causal_prefix(self) -> bool:
        """Whether clean text runs as the causal model (`bd_gdn == "causal_prefix"`): causal attention and the plain
        Gated DeltaNet over the prompt and every committed block, block diffusion only over the block being
        denoised."""
        return self.bd_gdn == "causal_prefix"

    @property
    def is_block_causal(self) -> bool:
        """Whether attention is block-causal (`attention == "block_causal"`)."""
        return self.attention == "block_causal"

    @property
    def filler_id(self) -> int:
        """A token id that is not the mask: what fills padding columns and filler rows (both hidden from
        attention, so the value never matters): the pad token, else the end token, else 0 or 1."""
        for c in (self.pad_token_id, self.eos_token_id, 0, 1):
            if c is not None and c != self.mask_token_id:
                return c
        raise AssertionError("unreachable: 0 and 1 cannot both be the mask")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (`dataclasses.replace`), validated again: ConfigError if invalid."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (`dataclasses.asdict`): what config.json holds."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config of a `to_dict` dict, validated; ConfigError naming any unknown field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config fields: {', '.join(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        """`to_dict` as indented JSON with sorted keys."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _kind_of(annotation: str) -> tuple[str, bool]:
    """(kind, None allowed) of a ModelConfig field's annotation: an `_KINDS` key, or "names" for a tuple of strings."""
    optional = annotation.endswith("| None")
    base = annotation.removesuffix("| None").strip()
    if base.startswith("tuple["):
        return "names", optional
    return (base if base in _KINDS else "str"), optional  # Family, RouterKind, ...: strings of a fixed set


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _has_kind(value: Any, kind: str) -> bool:
    if kind == "names":
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if isinstance(value, bool) and kind != "bool":
        return False  # JSON's true is no size
    return isinstance(value, _TYPES[kind])


def check_field_types(cfg: ModelConfig) -> None:
    """ConfigError naming the first field whose value is not of its declared type (a config.json written by hand,
    or damaged): an integer for sizes and ids, a number for floats, true/false for flags, a string for names."""
    for f in dataclasses.fields(cfg):
        kind, optional = _kind_of(str(f.type))
        value = getattr(cfg, f.name)
        if value is None and optional:
            continue
        if not _has_kind(value, kind):
            what = "a list of strings" if kind == "names" else _KINDS[kind]
            raise ConfigError(f"config {cfg.name!r}: {f.name} must be {what}{' or null' if optional else ''}, "
                              f"got {value!r}")


def validate(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first inconsistency; runs before anything is traced."""

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"config {cfg.name!r}: {msg}")

    need(cfg.family in FAMILIES, f"family must be one of {FAMILIES}, got {cfg.family!r}")
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"):
        need(getattr(cfg, f) > 0, f"{f} must be positive, got {getattr(cfg, f)}")
    need(cfg.n_heads % cfg.n_kv_heads == 0,
         f"n_heads ({cfg.n_heads}) must be divisible by n_kv_heads ({cfg.n_kv_heads})")
    need(0 < cfg.partial_rotary_factor <= 1.0,
         f"partial_rotary_factor must be in (0, 1], got {cfg.partial_rotary_factor}")
    rot = cfg.head_dim * cfg.partial_rotary_factor
    need(rot == int(rot) and int(rot) % 2 == 0 and int(rot) > 0,
         f"rotary dims head_dim*partial_rotary_factor = {cfg.head_dim}*{cfg.partial_rotary_factor} = {rot} "
         "must be a positive even integer no larger than head_dim")
    need(cfg.rope_theta > 0, f"rope_theta must be positive, got {cfg.rope_theta}")
    need(0 <= cfg.n_dense_layers <= cfg.n_layers,
         f"n_dense_layers ({cfg.n_dense_layers}) must be in [0, n_layers={cfg.n_layers}]")
    need(cfg.n_dense_layers == 0 or cfg.dense_mlp_dim > 0, "dense layers need dense_mlp_dim > 0")
    if cfg.n_moe_layers > 0:
        need(cfg.n_experts > 0 and cfg.expert_mlp_dim > 0, "MoE layers need n_experts and expert_mlp_dim > 0")
        need(1 <= cfg.n_experts_per_tok <= cfg.n_experts,
             f"top-k n_experts_per_tok ({cfg.n_experts_per_tok}) must be in [1, n_experts={cfg.n_experts}]")
        need(cfg.router in ("softmax", "sigmoid"), f"router must be 'softmax' or 'sigmoid', got {cfg.router!r}")
        need(cfg.n_expert_groups >= 1 and cfg.n_experts % cfg.n_expert_groups == 0,
             f"n_experts ({cfg.n_experts}) must be divisible by n_expert_groups ({cfg.n_expert_groups})")
        need(1 <= cfg.topk_groups <= cfg.n_expert_groups,
             f"topk_groups ({cfg.topk_groups}) must be in [1, n_expert_groups={cfg.n_expert_groups}]")
        per_group = cfg.n_experts // cfg.n_expert_groups
        need(cfg.n_expert_groups == 1 or per_group >= 2,
             "group-limited routing scores a group by its top-2 experts: need >= 2 experts per group")
        need(cfg.topk_groups * per_group >= cfg.n_experts_per_tok,
             f"the {cfg.topk_groups} kept groups hold {cfg.topk_groups * per_group} experts, "
             f"fewer than top-k {cfg.n_experts_per_tok}")
        need(cfg.n_shared_experts == 0 or cfg.shared_mlp_dim > 0, "shared experts need shared_mlp_dim > 0")
    need(cfg.attention in ("bidirectional", "block_causal"),
         f"attention must be 'bidirectional' or 'block_causal', got {cfg.attention!r}")
    need(cfg.block_size > 0, f"block_size must be positive, got {cfg.block_size}")
    for tok in ("mask_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, tok)
        if v is None and tok != "mask_token_id":
            continue
        need(isinstance(v, int) and 0 <= v < cfg.vocab_size,
             f"{tok} ({v}) must be a token id in [0, vocab_size={cfg.vocab_size})")
    need(cfg.eos_token_id is None or cfg.eos_token_id != cfg.mask_token_id,
         f"eos_token_id and mask_token_id are both {cfg.mask_token_id}: the end token must not be the mask")
    need(cfg.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    need(cfg.init_std > 0, "init_std must be positive")
    need(cfg.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}, got {cfg.quantization!r}")
    need(cfg.attention_impl in ATTENTION_IMPLS,
         f"attention_impl must be one of {ATTENTION_IMPLS}, got {cfg.attention_impl!r}")
    need(cfg.attention_chunk >= 1, f"attention_chunk must be >= 1, got {cfg.attention_chunk}")
    need(cfg.prefill_chunk >= 0, f"prefill_chunk must be >= 0 (0: the whole prompt in one pass), got "
                                 f"{cfg.prefill_chunk}")
    need(not cfg.shared_expert_gate or cfg.n_shared_experts > 0, "shared_expert_gate needs a shared expert")
    if cfg.layer_types is not None:
        kinds = (LINEAR_ATTENTION, FULL_ATTENTION)
        need(len(cfg.layer_types) == cfg.n_layers,
             f"layer_types has {len(cfg.layer_types)} entries for n_layers={cfg.n_layers}")
        bad = sorted(set(cfg.layer_types) - set(kinds))
        need(not bad, f"layer_types may hold only {kinds}, got {bad}")
    if cfg.is_hybrid:
        for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim"):
            need(getattr(cfg, f) > 0, f"Gated DeltaNet layers need {f} > 0, got {getattr(cfg, f)}")
        need(cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0,
             f"linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
             f"({cfg.linear_num_key_heads})")
        need(cfg.n_dense_layers == 0, "hybrid layer stacks have MoE MLPs only (n_dense_layers must be 0)")
        need(not cfg.use_expert_bias, "expert-bias balancing is not implemented for hybrid layer stacks")
        need(len(cfg.layer_group) <= MAX_LAYER_GROUP,
             f"layer_types must repeat a group of at most {MAX_LAYER_GROUP} layers (the body of the layer scan); "
             f"got {list(cfg.layer_types)}")
    need(cfg.bd_gdn in BD_GDN_MODES, f"bd_gdn must be one of {BD_GDN_MODES}, got {cfg.bd_gdn!r}")
    need(cfg.moe_block_coreset == 0 or cfg.n_experts_per_tok <= cfg.moe_block_coreset <= cfg.n_experts,
         f"moe_block_coreset must be 0 (off) or in [n_experts_per_tok, n_experts] = [{cfg.n_experts_per_tok}, "
         f"{cfg.n_experts}], got {cfg.moe_block_coreset}")
    need(cfg.moe_block_coreset == 0 or cfg.causal_prefix,
         "moe_block_coreset needs bd_gdn='causal_prefix' (it restricts the routing of the block being denoised)")
    need(cfg.bd_conv_right_kernel >= 0, f"bd_conv_right_kernel must be >= 0, got {cfg.bd_conv_right_kernel}")
    need(cfg.bd_conv_right_kernel == 0 or cfg.is_hybrid,
         "bd_conv_right_kernel > 0 needs Gated DeltaNet layers (layer_types with linear_attention)")
    if cfg.is_bd_gdn:
        need(cfg.has_bd_weights, f"bd_gdn={cfg.bd_gdn!r} needs the block-diffusion tensors (bd_conv_right_kernel > 0)")
        need(cfg.is_block_causal and cfg.block_size > 1,
             f"bd_gdn={cfg.bd_gdn!r} needs block_causal attention with blocks longer than one token "
             f"(attention={cfg.attention!r}, block_size={cfg.block_size})")


# ---- presets ---------------------------------------------------------------------------------

_PRESETS: dict[str, ModelConfig] = {}


def _register(cfg: ModelConfig) -> ModelConfig:
    _PRESETS[cfg.name] = cfg
    return cfg


# Clover-35B-A3B's dimensions: the Qwen3.5/3.6-35B-A3B hybrid (10 groups of 3 Gated DeltaNet + 1 gated
# attention layer, 256 experts top-8 + a gated shared expert, untied, 128K context) with block-causal
# attention in blocks of 32. rope_theta and the token ids are guesses: a converted checkpoint carries its own.
_QWEN3_5_35B = dict(
    vocab_size=248_320, d_model=2048, n_layers=40, n_heads=16, n_kv_heads=2, head_dim=256, n_experts=256,
    n_experts_per_tok=8, expert_mlp_dim=512, n_shared_experts=1, shared_mlp_dim=512, shared_expert_gate=True,
    router="softmax", norm_topk_prob=True, qk_norm=True, attn_output_gate=True, norm_unit_offset=True,
    rope_theta=1e7, partial_rotary_factor=0.25, max_seq_len=131_072,
    layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 10, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    eos_token_id=248_044, pad_token_id=248_044, mask_token_id=248_319,
)
# Clover's right conv has linear_conv_kernel_dim - 1 = 3 taps, x_{t+1} .. x_{t+3} (cortiq's `bdp_conv`); a
# converted checkpoint takes the count from its conv_right_weight.
_register(ModelConfig(name="clover-35b-a3b", family="clover", attention="block_causal", block_size=32,
                      bd_gdn="causal_prefix", bd_conv_right_kernel=3, **_QWEN3_5_35B))

# The same backbone as transformers' qwen3_5_moe runs it: causal (blocks of one token).
_register(ModelConfig(name="qwen3.5-35b-a3b", family="qwen3_5_moe", attention="block_causal", block_size=1,
                      **_QWEN3_5_35B))

# The model this project trains and ships (checkpoints/clover-tiny): Clover's layout in miniature, one group
# of 3 block-diffusion Gated DeltaNet layers + 1 gated attention layer, a gated shared expert, blocks of 32. Run as
# Clover's ports run Clover (a causal clean prefix): it was trained under the earlier reading (`reconstructed`) and
# fine-tuned into this one, keeping its right conv of 4 taps (Clover's has 3, the conv kernel less one).
_register(ModelConfig(
    name="clover-tiny", family="clover", vocab_size=2048, d_model=192, n_layers=4, n_heads=4,
    n_kv_heads=2, head_dim=48, n_experts=8, n_experts_per_tok=2, expert_mlp_dim=128,
    n_shared_experts=1, shared_mlp_dim=128, shared_expert_gate=True, router="softmax", norm_topk_prob=True,
    attention="block_causal", block_size=32, qk_norm=True, attn_output_gate=True, norm_unit_offset=True,
    rope_theta=10000.0, partial_rotary_factor=0.5, max_seq_len=1024, eos_token_id=2, pad_token_id=0,
    mask_token_id=3, dtype="float32",
    layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=48, linear_value_head_dim=48, bd_gdn="causal_prefix", bd_conv_right_kernel=4,
))

# The first shipped model's all-attention layout at the same size (4 gated attention layers): the
# comparison of `benchmarks/sampler.py --context`.
_register(ModelConfig(
    name="clover-tiny-attention", family="clover", vocab_size=2048, d_model=192, n_layers=4, n_heads=4,
    n_kv_heads=2, head_dim=48, n_experts=8, n_experts_per_tok=2, expert_mlp_dim=128,
    n_shared_experts=1, shared_mlp_dim=128, router="softmax", norm_topk_prob=True,
    attention="block_causal", block_size=32, qk_norm=True, attn_output_gate=True,
    rope_theta=10000.0, partial_rotary_factor=0.5, max_seq_len=1024, eos_token_id=2, pad_token_id=0,
    mask_token_id=3, dtype="float32",
))

_register(ModelConfig(
    name="llada2-mini", family="llada2_moe", vocab_size=157_184, d_model=2048, n_layers=20,
    n_heads=16, n_kv_heads=4, head_dim=128, n_experts=256, n_experts_per_tok=8, expert_mlp_dim=512,
    n_shared_experts=1, shared_mlp_dim=512, n_dense_layers=1, dense_mlp_dim=5120, router="sigmoid",
    norm_topk_prob=True, n_expert_groups=8, topk_groups=4, routed_scaling_factor=2.5,
    use_expert_bias=True, attention="block_causal", block_size=32, qk_norm=True,
    rope_theta=600_000.0, partial_rotary_factor=0.5, max_seq_len=32_768, norm_eps=1e-6,
    mask_token_id=156_895, eos_token_id=156_892, pad_token_id=156_892,
))

_register(ModelConfig(
    name="llada-moe-7b-a1b", family="llada_moe", vocab_size=157_184, d_model=2048, n_layers=16,
    n_heads=16, n_kv_heads=16, head_dim=128, n_experts=64, n_experts_per_tok=8, expert_mlp_dim=1024,
    router="softmax", norm_topk_prob=False, attention="bidirectional", qk_norm=True,
    rope_theta=50_000.0, max_seq_len=8192, norm_eps=1e-5, mask_token_id=156_895,
    eos_token_id=156_892, pad_token_id=156_892,
))

# Tiny configs of each family for tests: float32, a few layers, uneven shapes on purpose.
_TEST_COMMON = dict(vocab_size=256, d_model=64, n_heads=4, head_dim=16, max_seq_len=512, dtype="float32",
                    eos_token_id=1, pad_token_id=0, mask_token_id=255)
_register(ModelConfig(
    name="test-clover", family="clover", n_layers=3, n_kv_heads=2, n_experts=8, n_experts_per_tok=2,
    expert_mlp_dim=32, n_shared_experts=1, shared_mlp_dim=32, attention="block_causal", block_size=8,
    attn_output_gate=True, partial_rotary_factor=0.5, **_TEST_COMMON,
))
_register(ModelConfig(
    name="test-llada2", family="llada2_moe", n_layers=3, n_kv_heads=2, n_experts=16, n_experts_per_tok=4,
    expert_mlp_dim=32, n_shared_experts=1, shared_mlp_dim=32, n_dense_layers=1, dense_mlp_dim=96,
    router="sigmoid", n_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, use_expert_bias=True,
    attention="block_causal", block_size=8, partial_rotary_factor=0.5, **_TEST_COMMON,
))
_register(ModelConfig(
    name="test-llada-moe", family="llada_moe", n_layers=2, n_kv_heads=4, n_experts=8, n_experts_per_tok=2,
    expert_mlp_dim=48, router="softmax", norm_topk_prob=False, attention="bidirectional", **_TEST_COMMON,
))
_register(ModelConfig(
    name="test-qwen3-5-moe", family="qwen3_5_moe", n_layers=4, n_kv_heads=2, n_experts=8, n_experts_per_tok=2,
    expert_mlp_dim=32, n_shared_experts=1, shared_mlp_dim=32, shared_expert_gate=True, attention="block_causal",
    block_size=1, attn_output_gate=True, norm_unit_offset=True, partial_rotary_factor=0.25,
    layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, **_TEST_COMMON,
))
_TEST_HYBRID = _register(ModelConfig(
    name="test-clover-hybrid", family="clover", n_layers=4, n_kv_heads=2, n_experts=8, n_experts_per_tok=2,
    expert_mlp_dim=32, n_shared_experts=1, shared_mlp_dim=32, shared_expert_gate=True, attention="block_causal",
    block_size=8, attn_output_gate=True, norm_unit_offset=True, partial_rotary_factor=0.25,
    layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, bd_gdn="reconstructed", bd_conv_right_kernel=3,
    **_TEST_COMMON,
))
_register(dataclasses.replace(_TEST_HYBRID, name="test-clover-prefix", bd_gdn="causal_prefix"))
_register(ModelConfig(
    name="test-qwen3-moe", family="qwen3_moe", n_layers=2, n_kv_heads=2, n_experts=8, n_experts_per_tok=2,
    expert_mlp_dim=32, router="softmax", norm_topk_prob=True, attention="bidirectional", **_TEST_COMMON,
))


def preset_names() -> list[str]:
    """The preset names, sorted."""
    return sorted(_PRESETS)


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """A preset by name, optionally with fields replaced (validated again)."""
    if name not in _PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    cfg = _PRESETS[name]
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def load_config(path_or_name: str) -> ModelConfig:
    """A preset name, or a path to a native config.json (a checkpoint directory also works)."""
    if path_or_name in _PRESETS:
        return _PRESETS[path_or_name]
    path = path_or_name
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ConfigError(
            f"{path_or_name!r} is neither a preset ({', '.join(preset_names())}) nor a config.json path")
    d = read_object(path, ConfigError)
    try:
        return ModelConfig.from_dict(d)
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None
