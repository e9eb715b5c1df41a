"""The arithmetic of a plan: chip figures, pass shapes, weight / cache bytes per chip and analytic
FLOPs and HBM traffic (XLA's cost analysis counts a `lax.scan` body once rather than once per layer,
and ragged / collective ops approximately, so the roofline uses these counts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.mesh.layouts import Layout
from clover_jax.mesh.rules import as_tuple
from clover_jax.model import params


@dataclass(frozen=True)
class Chip:
    """One accelerator's published figures."""

    name: str
    hbm_bytes: float  # per chip
    peak_flops: float  # dense bf16 FLOP/s per chip
    hbm_bw: float  # bytes/s per chip
    source: str = ""
    fp8: bool = False  # fp8 matrix units (fp8 weights run here)


GIB = 2**30

# Published per-chip figures (dense bf16; no sparsity). Vendor spec sheets, 2024-25. Cloud TPU states HBM per chip
# in GiB, as what a program can allocate (v5p: 96 GiB physical, 95 GiB listed); the TPU compiler counts the same way.
CHIPS: dict[str, Chip] = {
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, 819e9, "cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2765e9, "cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("TPU v6e (Trillium)", 32 * GIB, 918e12, 1640e9, "cloud.google.com/tpu/docs/v6e"),
    "h100": Chip("NVIDIA H100 SXM", 80e9, 989e12, 3.35e12, "nvidia.com H100 datasheet", fp8=True),
    "h200": Chip("NVIDIA H200 SXM", 141e9, 989e12, 4.8e12, "nvidia.com H200 datasheet", fp8=True),
}

# On GPUs JAX preallocates 75% of device memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
GPU_USABLE_FRACTION = 0.75


# ---- shapes of the two passes -----------------------------------------------------------------


@dataclass(frozen=True)
class PassShape:
    """One of the two forward passes a plan compiles or counts."""

    name: str
    batch: int
    window: int  # query tokens W
    kv_len: int  # key columns S attended to (the cache length, or W without a cache)
    logits_len: int  # positions the LM head runs on
    cached: bool


def passes(cfg: ModelConfig, batch: int, seq_len: int, block: int) -> list[PassShape]:
    """The sampler's two passes: a cached block step and a cache-free full-canvas step."""
    return [
        PassShape("cached block", batch, block, seq_len, block, True),
        PassShape("full canvas", batch, seq_len, seq_len, block, False),
    ]


# ---- arithmetic -------------------------------------------------------------------------------


def mesh_factor(spec: Any, mesh_shape: dict[str, int]) -> int:
    """How many ways a PartitionSpec splits an array on a mesh of this shape."""
    n = 1
    for part in spec:
        for ax in as_tuple(part):
            n *= mesh_shape[ax]
    return n


def weight_bytes_per_chip(cfg: ModelConfig, shardings: Any, mesh_shape: dict[str, int]) -> tuple[int, int]:
    """(bytes of all weights, bytes one chip holds) from the abstract weights and their shardings."""
    total = per_chip = 0
    pairs = zip(params.named_leaves(params.abstract(cfg)), params.named_leaves(shardings), strict=True)
    for (_, spec), (_, sh) in pairs:
        nbytes = spec.size * np.dtype(spec.dtype).itemsize
        total += nbytes
        per_chip += nbytes // mesh_factor(sh.spec, mesh_shape)
    return total, per_chip


def weight_bytes_by_kind(cfg: ModelConfig, shardings: Any, mesh_shape: dict[str, int]) -> dict[str, int]:
    """Bytes one chip holds, by kind: `experts` (routed expert weights and their scales: a pass reads
    those of the experts its tokens route to), `embedding` (the untied input table: a pass gathers one
    row per token) and `other` (read whole by every pass). The three sum to `weight_bytes_per_chip`'s
    second figure."""
    out = {"experts": 0, "embedding": 0, "other": 0}
    pairs = zip(params.named_leaves(params.abstract(cfg)), params.named_leaves(shardings), strict=True)
    for (name, spec), (_, sh) in pairs:
        nbytes = spec.size * np.dtype(spec.dtype).itemsize // mesh_factor(sh.spec, mesh_shape)
        kind = ("experts" if "experts" in spec.axes
                else "embedding" if name.split(".")[0] == "embed" and not cfg.tie_embeddings else "other")
        out[kind] += nbytes
    return out


def weights_touched_per_chip(cfg: ModelConfig, by_kind: dict[str, int], tokens: int, block_rows: int = 0,
                             blocks: int = 0) -> float:
    """Expected weight bytes a pass over `tokens` tokens (all rows) reads on one chip: everything in
    `other`, each local expert with the probability that some token routes to it (`experts_touched`,
    uniform routing; with `cfg.moe_block_coreset`, `block_rows` of the tokens are `blocks` blocks being denoised,
    each within its coreset), and `tokens` rows of the input embedding (at most the whole local table)."""
    emb_rows = min(1.0, tokens / cfg.vocab_size)
    coreset = bool(cfg.moe_block_coreset)
    reach = experts_touched(cfg, tokens - block_rows if coreset else tokens, blocks if coreset else 0)
    return float(by_kind["other"] + by_kind["experts"] * reach + by_kind["embedding"] * emb_rows)


def cache_bytes_per_chip(cfg: ModelConfig, layout: Layout, rows: int, columns: int) -> int:
    """Bytes of a cache of `rows` x `columns` one chip holds: the attention K/V split as its logical axes
    ([layers, batch, seq, kv_heads, head_dim]) map onto the layout, the Gated DeltaNet state split by batch and
    by heads (as `serving.program.state_shardings` places it)."""
    kv = cache_bytes(cfg, rows, columns) - rows * linear_state_bytes(cfg)
    kv_split = shards(layout, "layers", "batch", "seq", "kv_heads", "head_dim")
    return kv // kv_split + rows * linear_state_bytes(cfg) // shards(layout, "batch", "linear_heads")


def linear_state_bytes(cfg: ModelConfig) -> int:
    """Bytes one sequence's Gated DeltaNet layers hold, whatever its length: per layer the float32
    delta-rule state [Hv, dk, dv] and the conv tail [K-1, conv channels]."""
    per_layer = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                 + (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * np.dtype(cfg.dtype).itemsize)
    return cfg.n_linear_layers * per_layer


def cache_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """Bytes of the cache for `batch` rows of `seq_len` columns: K/V of every attention layer, plus the
    fixed-size state of every Gated DeltaNet layer."""
    kv = 2 * cfg.n_attention_layers * batch * seq_len * cfg.n_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
    return kv + batch * linear_state_bytes(cfg)


def linear_layer_flops(cfg: ModelConfig) -> float:
    """Matmul FLOPs per token of one Gated DeltaNet mixer: projections, conv, and the delta rule's state
    reads and writes (about 6 dk dv per value head, the recurrent form's count); in block-diffusion mode
    also the right conv and the in-block softmax."""
    d, c, vd, hv = cfg.d_model, cfg.linear_conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    proj = 2 * d * (c + vd + 2 * hv) + 2 * vd * d
    rule = 6 * hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    flops = proj + 2 * cfg.linear_conv_kernel_dim * c + rule
    if cfg.is_bd_gdn:  # the right conv and the in-block softmax over a block (scores and values)
        flops += 2 * cfg.bd_conv_right_kernel * c + 2 * hv * cfg.block_size * (cfg.linear_key_head_dim
                                                                                 + cfg.linear_value_head_dim)
    return float(flops)


def analytic_flops(cfg: ModelConfig, p: PassShape) -> float:
    """Matmul FLOPs (2 per multiply-add) the forward pass executes, over all chips.

    Attention is dense over all S key columns (the mask hides, it does not skip), so that is counted.
    """
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    proj = 2 * d * hd * (2 * h + 2 * kv + (h if cfg.attn_output_gate else 0))
    attn = 2 * 2 * h * hd * p.kv_len
    moe_layer = 2 * d * cfg.n_experts + cfg.n_experts_per_tok * 6 * d * cfg.expert_mlp_dim + 6 * d * cfg.shared_mlp_dim
    dense_layer = 6 * d * cfg.dense_mlp_dim
    per_token = (cfg.n_attention_layers * (proj + attn) + cfg.n_linear_layers * linear_layer_flops(cfg)
                 + cfg.n_moe_layers * moe_layer + cfg.n_dense_layers * dense_layer)
    return float(p.batch * p.window * per_token + p.batch * p.logits_len * 2 * d * cfg.vocab_size)


def analytic_bytes_per_chip(cfg: ModelConfig, p: PassShape, weights_per_chip: int, cache_shards: int) -> float:
    """HBM traffic per chip, an upper bound: every local weight read once, the cache read once."""
    kv = cache_bytes(cfg, p.batch, p.kv_len) / cache_shards if p.cached else 0.0
    logits = p.batch * p.logits_len * cfg.vocab_size * 4
    return float(weights_per_chip + kv + logits)


def experts_touched(cfg: ModelConfig, tokens: int, coreset_blocks: int = 0) -> float:
    """Expected fraction of experts a pass of `tokens` routes to (uniform top-k routing). `coreset_blocks`: that
    many blocks of them are being denoised with the block expert coreset (`cfg.moe_block_coreset` experts each,
    a block of a few dozen rows reaching all of its coreset); the other tokens route freely."""
    if not cfg.n_experts:
        return 0.0
    e, k, m = cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_block_coreset
    return 1.0 - (1.0 - k / e) ** tokens * (1.0 - m / e) ** (coreset_blocks if m else 0)


def shards(layout: Layout, *logical: str) -> int:
    """Shards a tensor gets when its dims carry these logical axes (each mesh axis counted once)."""
    axes = {a for name in logical for a in layout.rules.mesh_axes(name)}
    return int(math.prod(n for n, a in zip(layout.shape, layout.axes, strict=True) if a in axes))


def analytic_flops_per_chip(cfg: ModelConfig, p: PassShape, layout: Layout, scan_once: bool = False) -> float:
    """The busiest chip's share: work a rule does not shard is repeated on every chip of that axis
    (e.g. attention with heads unsharded runs whole on every expert shard).

    scan_once: count each layer stack's body once, as XLA's cost analysis does for a `lax.scan`
    (to cross-check the compiler's figure, not to estimate time)."""
    if scan_once and cfg.is_hybrid:  # the scan body is one group of layers
        cfg = cfg.replace(n_layers=len(cfg.layer_group), layer_types=cfg.layer_group)
    elif scan_once:
        cfg = cfg.replace(n_layers=int(cfg.n_dense_layers > 0) + int(cfg.n_moe_layers > 0),
                          n_dense_layers=int(cfg.n_dense_layers > 0))
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    tokens, logit_tokens = p.batch * p.window, p.batch * p.logits_len
    proj = 2 * d * hd * (2 * h + 2 * kv + (h if cfg.attn_output_gate else 0))
    attn = cfg.n_attention_layers * (proj + 2 * 2 * h * hd * p.kv_len) * tokens / shards(layout, "batch", "q_heads")
    linear = cfg.n_linear_layers * linear_layer_flops(cfg) * tokens / shards(layout, "batch", "linear_heads")
    experts = cfg.n_moe_layers * (cfg.n_experts_per_tok * 6 * d * cfg.expert_mlp_dim) * tokens / shards(
        layout, "batch", "experts", "expert_mlp")
    router = cfg.n_moe_layers * 2 * d * cfg.n_experts * tokens / shards(layout, "batch")
    mlp = (cfg.n_moe_layers * 6 * d * cfg.shared_mlp_dim + cfg.n_dense_layers * 6 * d * cfg.dense_mlp_dim) * tokens \
        / shards(layout, "batch", "mlp")
    head = 2 * d * cfg.vocab_size * logit_tokens / shards(layout, "batch", "vocab")
    return float(attn + linear + experts + router + mlp + head)
