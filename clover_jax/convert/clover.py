"""`clover`: Clover's HuggingFace family (model_type `clover_moe`), in two layouts.

The hybrid layout (Clover-35B-A3B-Preview, architecture `CloverMoeModelLM`): the `qwen3_5_moe` text
model's config fields and keys (see that module), block-causal attention in blocks of `block_size` (also
read as `block_length`, `diffusion_block_size` or `bd_block_size`: the hub's name for it is not known
here), and per Gated DeltaNet layer four more tensors, loaded by name:
  linear_attn.conv_right_weight          [C, 1, Kr] (or [C, Kr])   -> conv_right [Kr, Hk, C / Hk]
  linear_attn.bd_softmax_logit_scale     [Hv] (or [Hk], [1], [])   -> bd_logit_scale [Hv]
  linear_attn.bd_softmax_history_bias    likewise                  -> bd_history_bias [Hv]
  linear_attn.bd_softmax_history_c       likewise                  -> bd_history_c [Hv]
Kr and the scalar shapes are read from the checkpoint and written back as read; the keys may sit under
`model.`, `model.language_model.`, `language_model.model.`, `language_model.` or no prefix at all (the
hub's exact prefix is not known here). How the four tensors act is this project's reconstruction
(`bd_gdn`, docs/model.md).

The all-attention layout (this project's earlier models, architecture `CloverMoeForDiffusionLM`):
keys follow Qwen3-MoE, plus what Clover adds:
  model.layers.{i}.self_attn.gate_proj.weight     [heads * head_dim, D]  sigmoid output gate, per head
  model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight          ungated shared expert(s), fused
  model.layers.{i}.mlp.gate.expert_bias           [E]                     selection bias (when enabled)
  model.layers.{i}.mlp.{gate,up,down}_proj.weight                         dense layers (the first k)
config.json carries the Qwen-style fields plus every Clover field under its native name, so the
native config round-trips exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from clover_jax.config import LINEAR_ATTENTION, ModelConfig
from clover_jax.convert import common, mapping, qwen3_5_moe
from clover_jax.convert.qwen3_moe import ATTN
from clover_jax.errors import ConversionError

NAME = "clover"
ATTN_GATED = {**ATTN, "gate": "gate_proj"}
_MAPPED = set(common.COMMON_FIELDS) | {"name", "family", "dtype"}
HYBRID_ARCHITECTURE = "CloverMoeModelLM"
BLOCK_FIELDS = ("block_size", "block_length", "diffusion_block_size", "bd_block_size")
PREFIXES = (*qwen3_5_moe.PREFIXES, "")
# Clover's four extra tensors per Gated DeltaNet layer -> native GatedDeltaNetWeights fields.
BD_SCALARS = {"bd_softmax_logit_scale": "bd_logit_scale", "bd_softmax_history_bias": "bd_history_bias",
              "bd_softmax_history_c": "bd_history_c"}
CONV_RIGHT = "conv_right_weight"
DEFAULT_BD_GDN = "causal_prefix"  # how a clover_moe checkpoint runs when its config.json does not say (its ports)


def detect(hf: dict[str, Any]) -> bool:
    """Whether the HF config.json dict `hf` is this family's (`model_type` `clover_moe` or its architecture)."""
    archs = hf.get("architectures") or []
    return hf.get("model_type") == "clover_moe" or any(a in archs for a in ("CloverMoeForDiffusionLM",
                                                                            HYBRID_ARCHITECTURE))


def _is_hybrid(hf: dict[str, Any]) -> bool:
    return (HYBRID_ARCHITECTURE in (hf.get("architectures") or []) or LINEAR_ATTENTION in (hf.get("layer_types") or ())
            or bool(hf.get("linear_num_value_heads")))


def _hybrid_config_from_hf(hf: dict[str, Any], name: str, dtype: str, mask_token_id: int | None) -> ModelConfig:
    f = qwen3_5_moe.text_fields(hf, NAME, frozenset({*BLOCK_FIELDS, "mask_token_id", "bd_gdn", "name"}))
    sizes = {k: hf[k] for k in BLOCK_FIELDS if k in hf}
    if not sizes:
        raise ConversionError(f"config.json ({NAME}) names no block size (one of {', '.join(BLOCK_FIELDS)})")
    if len(set(sizes.values())) > 1:
        raise ConversionError(f"config.json ({NAME}) gives different block sizes: {sizes}")
    mask = common.token_id(hf.get("mask_token_id")) if mask_token_id is None else mask_token_id
    f.update(attention="block_causal", block_size=int(next(iter(sizes.values()))), dtype=dtype)
    if mask is not None:
        f["mask_token_id"] = mask
    # The block-diffusion tensors' presence and shapes come from the checkpoint (`tensor_fields`).
    return common.make_config(hf.get("name") or name, NAME, f)


def tensor_fields(hf: dict[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Config fields read from the checkpoint's tensors rather than config.json: the right conv's taps
    (`bd_conv_right_kernel`) and, with the tensors present, `bd_gdn` (config.json's, default
    "causal_prefix": Clover as its ports run it). Empty for the all-attention layout."""
    right = next((k for k in tensors if k.endswith(f".linear_attn.{CONV_RIGHT}")), None)
    if not _is_hybrid(hf) or right is None:
        return {}
    return {"bd_conv_right_kernel": int(tuple(tensors[right].shape)[-1]), "bd_gdn": hf.get("bd_gdn", DEFAULT_BD_GDN)}


def config_from_hf(hf: dict[str, Any], name: str, dtype: str, mask_token_id: int | None) -> ModelConfig:
    """The native config of HF config dict `hf`: named by its `name` field else `name`, in `dtype`,
    `mask_token_id` if given; ConversionError if the fields describe no valid model. For the hybrid layout
    the block-diffusion fields come from `tensor_fields`."""
    if _is_hybrid(hf):
        return _hybrid_config_from_hf(hf, name, dtype, mask_token_id)
    f = common.common_from_hf(hf, NAME)
    for field in dataclasses.fields(ModelConfig):
        if field.name not in _MAPPED and field.name in hf:
            f[field.name] = hf[field.name]
    f["rope_theta"] = common.rope_theta(hf, f.get("rope_theta"))
    f["dtype"] = dtype
    if mask_token_id is not None:
        f["mask_token_id"] = mask_token_id
    cfg = common.make_config(hf.get("name") or name, NAME, f)
    common.refuse_qwen3_5_features(cfg, NAME)  # hybrid configs take the hybrid layout
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dict of `cfg`. Hybrid: the Qwen3.5 text fields plus block_size and the mask token
    (and bd_gdn unless it is the default, "causal_prefix"). All-attention: the Qwen-style fields plus every
    native field, so it round-trips."""
    if cfg.is_hybrid:
        common.refuse(not cfg.is_block_causal, f"{NAME} attention is block-causal")
        out = qwen3_5_moe.text_config_to_hf(cfg, NAME)
        out.update(model_type="clover_moe", architectures=[HYBRID_ARCHITECTURE], block_size=cfg.block_size,
                   name=cfg.name)
        if cfg.has_bd_weights and cfg.bd_gdn != DEFAULT_BD_GDN:
            out["bd_gdn"] = cfg.bd_gdn
        return out
    common.refuse_qwen3_5_features(cfg, NAME)
    out = common.common_to_hf(cfg)
    out.update({k: v for k, v in cfg.to_dict().items() if k not in _MAPPED})
    out.update(model_type="clover_moe", architectures=["CloverMoeForDiffusionLM"], name=cfg.name,
               shared_expert_intermediate_size=cfg.shared_mlp_dim, first_k_dense_replace=cfg.n_dense_layers,
               intermediate_size=cfg.dense_mlp_dim)
    return out


def source_variants(keys: Iterable[str]) -> dict[str, Any]:
    """The `groups` keywords of a source checkpoint with these HF keys (a mapping of key -> tensor info with
    `.shape` also gives the block-diffusion tensors' shapes): experts' form; for the hybrid layout also the
    Gated DeltaNet projections' form, the key prefix and the shapes of the four extra tensors."""
    shapes = keys if isinstance(keys, Mapping) else None
    keys = set(keys)
    if not any(".linear_attn." in k for k in keys):
        return mapping.expert_variants(keys)
    out = qwen3_5_moe.source_variants(keys)
    out["prefix"] = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in keys), "model.")
    if shapes is not None:
        first = {}
        for k in sorted(keys):
            tail = k.rsplit(".", 1)[-1]
            if ".linear_attn." in k and (tail in BD_SCALARS or tail == CONV_RIGHT):
                first.setdefault(tail, list(tuple(shapes[k].shape)))
        out["bd_shapes"] = first
    return out


def _bd_groups(cfg: ModelConfig, prefix: str, shapes: dict[str, list[int]]) -> list[mapping.Group]:
    """The four block-diffusion tensors of every Gated DeltaNet layer, in the shapes the source had."""
    hk, hv, c, kr = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_conv_dim, cfg.bd_conv_right_kernel
    right = tuple(shapes.get(CONV_RIGHT, (c, 1, kr)))
    out = []
    for layer in range(cfg.n_layers):
        stack, i = qwen3_5_moe.stack_of(cfg, layer)
        if stack != "linear_layers":
            continue
        la = f"{qwen3_5_moe.layer_prefix(prefix, layer)}.linear_attn"
        out.append(mapping.gdn_conv(f"{la}.{CONV_RIGHT}", ("linear_layers.attn.conv_right", i), kr, cfg,
                                    squeezed=len(right) == 2))
        for hf_name, native in BD_SCALARS.items():
            shape = tuple(shapes.get(hf_name, (hv,)))
            n = int(np.prod(shape))
            if n not in (1, hk, hv):
                raise ConversionError(f"{la}.{hf_name} has shape {list(shape)}: expected one value, one per key "
                                      f"head ({hk}) or one per value head ({hv})")
            out.append(mapping.per_head(f"{la}.{hf_name}", (f"linear_layers.attn.{native}", i), shape, hv))
    return out


def groups(cfg: ModelConfig, fused_experts: bool = False, fused_linear: bool = False, prefix: str = "model.",
           bd_shapes: dict[str, list[int]] | None = None) -> list[mapping.Group]:
    """Every tensor of `cfg` in this family's keys, as `mapping.Group`s; `fused_experts`: routed experts in
    transformers 5's fused form; hybrid only: `fused_linear` (Qwen3-Next's fused projections), `prefix` (one
    of PREFIXES) and `bd_shapes` (the source's shapes of the four block-diffusion tensors, by name)."""
    if not cfg.is_hybrid:
        return mapping.qwen_style_groups(cfg, fused_experts, ATTN_GATED, shared_key="mlp.shared_expert")
    if prefix not in PREFIXES:
        raise ConversionError(f"unknown key prefix {prefix!r}; known: {PREFIXES}")
    g = qwen3_5_moe.backbone_groups(cfg, fused_experts, fused_linear, prefix)
    if cfg.has_bd_weights:
        g += _bd_groups(cfg, prefix, bd_shapes or {})
    return g
