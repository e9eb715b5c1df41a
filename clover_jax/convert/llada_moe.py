"""`llada_moe`: LLaDA-MoE-7B-A1B (LLaDAMoEModelLM), OLMoE/Qwen-style keys.

Its public config.json says `model_type: "llada"`; it is recognised by that, by `lladamoe`, or by
the architecture name. Routing is a softmax without renormalisation (hard-coded in its modeling
code, whatever `norm_topk_prob` says); a shared expert, if any, sits on the decoder layer as
`shared_expert.*`. Dense layers (`moe_layer_freq` 0) must come first.
"""

from __future__ import annotations

from typing import Any

from clover_jax.config import ModelConfig
from clover_jax.convert import common, mapping
from clover_jax.convert.qwen3_moe import ATTN

NAME = "llada_moe"
MASK_TOKEN_ID = 156_895
# LLaDAMoEConfig's defaults (HF names) for the fields this converter reads (its rope_theta and
# partial_rotary_factor defaults are -1: config.json must give them).
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 50279,
    "pad_token_id": 1,
}


def detect(hf: dict[str, Any]) -> bool:
    """Whether the HF config.json dict `hf` is this family's (`model_type` `llada`/`lladamoe`/`llada_moe` or
    its architecture)."""
    return (hf.get("model_type") in ("llada", "lladamoe", "llada_moe")
            or "LLaDAMoEModelLM" in (hf.get("architectures") or []))


def config_from_hf(hf: dict[str, Any], name: str, dtype: str, mask_token_id: int | None) -> ModelConfig:
    """The native config `name` of HF config dict `hf`, in `dtype`, with `mask_token_id` (default
    `MASK_TOKEN_ID`); ConversionError for a missing field or an unsupported feature."""
    hf = common.with_defaults(hf, DEFAULTS)
    common.need(hf, "partial_rotary_factor", NAME)
    f = common.common_from_hf(hf, NAME)
    f["expert_mlp_dim"] = int(common.need(hf, "expert_intermediate_size", NAME))
    common.need(hf, "num_experts", NAME)
    common.refuse(bool(hf.get("attention_bias")), "attention_bias=true")
    common.refuse(hf.get("clip_qkv") is not None, "clip_qkv")
    common.refuse(bool(hf.get("moe_router_enable_expert_bias")),
             "LLaDA-MoE expert bias (added to the routing probabilities; not implemented)")
    freq = hf.get("moe_layer_freq")
    n_layers = f["n_layers"]
    kinds = [1] * n_layers if freq in (None, 1) else list(freq) if isinstance(freq, list) else None
    common.refuse(kinds is None or len(kinds) != n_layers, f"moe_layer_freq {freq!r}")
    n_dense = kinds.index(1) if 1 in kinds else n_layers
    common.refuse(any(k == 0 for k in kinds[n_dense:]), f"moe_layer_freq {freq}: dense layers must come first")
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    f.update(n_dense_layers=n_dense, dense_mlp_dim=int(hf.get("dense_intermediate_size") or 0) if n_dense else 0,
             n_shared_experts=1 if shared else 0, shared_mlp_dim=shared, router="softmax", norm_topk_prob=False,
             attention="bidirectional", qk_norm=bool(hf.get("qk_layernorm", True)), rope_theta=common.rope_theta(hf),
             partial_rotary_factor=float(hf["partial_rotary_factor"]), dtype=dtype,
             mask_token_id=MASK_TOKEN_ID if mask_token_id is None else mask_token_id)
    f.pop("n_experts_per_tok", None)
    f["n_experts_per_tok"] = int(common.need(hf, "num_experts_per_tok", NAME))
    return common.make_config(name, NAME, f)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dict of `cfg`; ConversionError if `cfg` uses what this family cannot express."""
    common.refuse_qwen3_5_features(cfg, NAME)
    common.refuse(cfg.attn_output_gate, "llada_moe has no attention output gate")
    common.refuse(cfg.router != "softmax" or cfg.use_expert_bias or cfg.norm_topk_prob,
             "llada_moe routes with a softmax and no renormalisation")
    out = common.common_to_hf(cfg)
    out.pop("moe_intermediate_size")
    out.update(model_type="llada", architectures=["LLaDAMoEModelLM"], expert_intermediate_size=cfg.expert_mlp_dim,
               dense_intermediate_size=cfg.dense_mlp_dim or None,
               shared_expert_intermediate_size=cfg.shared_mlp_dim if cfg.n_shared_experts else None,
               moe_layer_freq=[0] * cfg.n_dense_layers + [1] * cfg.n_moe_layers, qk_layernorm=cfg.qk_norm,
               partial_rotary_factor=cfg.partial_rotary_factor, norm_topk_prob=False, clip_qkv=None,
               moe_router_enable_expert_bias=False)
    return out


source_variants = mapping.expert_variants


def groups(cfg: ModelConfig, fused_experts: bool = False) -> list[mapping.Group]:
    """Every tensor of `cfg` in this family's keys, as `mapping.Group`s; `fused_experts`: routed experts in
    transformers 5's fused form."""
    return mapping.qwen_style_groups(cfg, fused_experts, ATTN, shared_key="shared_expert")
