"""`clover`: this project's own HuggingFace family (model_type `clover_moe`).

Keys follow Qwen3-MoE, plus what Clover adds:
  model.layers.{i}.self_attn.gate_proj.weight     [heads * head_dim, D]  sigmoid output gate, per head
  model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight          ungated shared expert(s), fused
  model.layers.{i}.mlp.gate.expert_bias           [E]                     selection bias (when enabled)
  model.layers.{i}.mlp.{gate,up,down}_proj.weight                         dense layers (the first k)
config.json carries the Qwen-style fields plus every Clover field under its native name, so the
native config round-trips exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from clover_jax.config import ModelConfig
from clover_jax.convert import common, mapping
from clover_jax.convert.qwen3_moe import ATTN

NAME = "clover"
ATTN_GATED = {**ATTN, "gate": "gate_proj"}
_MAPPED = set(common.COMMON_FIELDS) | {"name", "family", "dtype"}


def detect(hf: dict[str, Any]) -> bool:
    """Whether the HF config.json dict `hf` is this family's (`model_type` `clover_moe` or its architecture)."""
    return hf.get("model_type") == "clover_moe" or "CloverMoeForDiffusionLM" in (hf.get("architectures") or [])


def config_from_hf(hf: dict[str, Any], name: str, dtype: str, mask_token_id: int | None) -> ModelConfig:
    """The native config of HF config dict `hf`: named by its `name` field else `name`, in `dtype`,
    `mask_token_id` if given; ConversionError if the fields describe no valid model."""
    f = common.common_from_hf(hf, NAME)
    for field in dataclasses.fields(ModelConfig):
        if field.name not in _MAPPED and field.name in hf:
            f[field.name] = hf[field.name]
    f["rope_theta"] = common.rope_theta(hf, f.get("rope_theta"))
    f["dtype"] = dtype
    if mask_token_id is not None:
        f["mask_token_id"] = mask_token_id
    cfg = common.make_config(hf.get("name") or name, NAME, f)
    common.refuse_qwen3_5_features(cfg, NAME)  # the clover_moe layout of the hybrid model is not written yet
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dict of `cfg`: the Qwen-style fields plus every native field, so it round-trips."""
    common.refuse_qwen3_5_features(cfg, NAME)
    out = common.common_to_hf(cfg)
    out.update({k: v for k, v in cfg.to_dict().items() if k not in _MAPPED})
    out.update(model_type="clover_moe", architectures=["CloverMoeForDiffusionLM"], name=cfg.name,
               shared_expert_intermediate_size=cfg.shared_mlp_dim, first_k_dense_replace=cfg.n_dense_layers,
               intermediate_size=cfg.dense_mlp_dim)
    return out


source_variants = mapping.expert_variants


def groups(cfg: ModelConfig, fused_experts: bool = False) -> list[mapping.Group]:
    """Every tensor of `cfg` in this family's keys, as `mapping.Group`s; `fused_experts`: routed experts in
    transformers 5's fused form."""
    return mapping.qwen_style_groups(cfg, fused_experts, ATTN_GATED, shared_key="mlp.shared_expert")
