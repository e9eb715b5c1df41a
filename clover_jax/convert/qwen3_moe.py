"""`qwen3_moe`: transformers' Qwen3-MoE (Qwen3MoeForCausalLM), run with a full bidirectional mask.

On disk `save_pretrained` writes per-expert keys `mlp.experts.{e}.{gate,up,down}_proj.weight`;
transformers 5 holds them fused in memory (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj`
[E, D, F]) and some tools save that form, so both are read. Writing uses the per-expert form.
The HF config has no mask token: it comes from `--mask-token-id` (default: the last id).
"""

from __future__ import annotations

from typing import Any

from clover_jax.config import ModelConfig
from clover_jax.convert import common, mapping

NAME = "qwen3_moe"
# transformers' Qwen3MoeConfig defaults (HF names) for the fields this converter reads; no EOS, no pad.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "norm_topk_prob": False, "eos_token_id": None, "pad_token_id": None,
}
ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}


def detect(hf: dict[str, Any]) -> bool:
    """Whether the HF config.json dict `hf` is this family's (`model_type` `qwen3_moe` or its architecture)."""
    return hf.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (hf.get("architectures") or [])


def config_from_hf(hf: dict[str, Any], name: str, dtype: str, mask_token_id: int | None) -> ModelConfig:
    """The native config `name` of HF config dict `hf`, in `dtype`, with `mask_token_id` (default: the
    last id); ConversionError for a missing field or an unsupported feature."""
    hf = common.with_defaults(hf, DEFAULTS)
    f = common.common_from_hf(hf, NAME)
    for key in ("n_experts", "n_experts_per_tok", "expert_mlp_dim"):
        if key not in f:
            common.need(hf, common.COMMON_FIELDS[key], NAME)
    common.refuse(bool(hf.get("attention_bias")), "attention_bias=true")
    common.refuse(hf.get("decoder_sparse_step", 1) != 1, "decoder_sparse_step != 1")
    dense = list(hf.get("mlp_only_layers") or [])
    common.refuse(dense != list(range(len(dense))), f"mlp_only_layers {dense} is not a prefix of the layers")
    common.refuse(bool(hf.get("use_sliding_window")), "sliding-window attention")
    f.update(n_dense_layers=len(dense), dense_mlp_dim=int(hf.get("intermediate_size") or 0) if dense else 0,
             router="softmax", norm_topk_prob=bool(hf["norm_topk_prob"]), attention="bidirectional",
             qk_norm=True, rope_theta=common.rope_theta(hf), dtype=dtype)
    if mask_token_id is not None:
        f["mask_token_id"] = mask_token_id
    return common.make_config(name, NAME, f)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dict of `cfg`; ConversionError if `cfg` uses what this family cannot express."""
    common.refuse_qwen3_5_features(cfg, NAME)
    common.refuse(cfg.n_shared_experts > 0, "qwen3_moe has no shared experts")
    common.refuse(cfg.attn_output_gate, "qwen3_moe has no attention output gate")
    common.refuse(cfg.router != "softmax" or cfg.use_expert_bias, "qwen3_moe routes with a plain softmax")
    common.refuse(cfg.partial_rotary_factor != 1.0, "qwen3_moe rotates the full head")
    out = common.common_to_hf(cfg)
    out.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=cfg.norm_topk_prob,
               decoder_sparse_step=1, mlp_only_layers=list(range(cfg.n_dense_layers)),
               intermediate_size=cfg.dense_mlp_dim or cfg.expert_mlp_dim, use_sliding_window=False,
               num_local_experts=cfg.n_experts)
    return out


source_variants = mapping.expert_variants


def groups(cfg: ModelConfig, fused_experts: bool = False) -> list[mapping.Group]:
    """Every tensor of `cfg` in this family's keys, as `mapping.Group`s; `fused_experts`: routed experts in
    transformers 5's fused form."""
    return mapping.qwen_style_groups(cfg, fused_experts, ATTN, shared_key=None)
