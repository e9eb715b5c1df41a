"""`llada2_moe`: LLaDA2.0-mini / -flash (LLaDA2MoeModelLM), keys as in the public checkpoints.

Fused `attention.query_key_value` (rows [q heads | k heads | v heads]), `attention.dense` output,
`query_layernorm` / `key_layernorm`, sigmoid router `mlp.gate.weight` + `mlp.gate.expert_bias`,
routed experts `mlp.experts.{e}.*`, one fused shared expert `mlp.shared_experts.*`, and the first
`first_k_dense_replace` layers dense (`mlp.{gate,up,down}_proj`). Block-causal, blocks of 32.

Fields config.json lacks take the defaults of the family's own code (`DEFAULTS`: LLaDA2MoeConfig, and
`generate`'s eos_id / mask_id); the chosen weights are renormalised only with more than one expert
per token (the LLaDA2 gate's rule: a top-1 weight is sigmoid(logit) * routed_scaling_factor).
"""

from __future__ import annotations

from typing import Any

from clover_jax.config import ModelConfig
from clover_jax.convert import common, mapping
from clover_jax.errors import ConversionError

NAME = "llada2_moe"
MASK_TOKEN_ID = 156_895  # LLaDA2MoeModelLM.generate's mask_id default
EOS_TOKEN_ID = 156_892  # and its eos_id default
# LLaDA2MoeConfig's defaults (HF names) for the fields this converter reads.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "max_position_embeddings": 16384, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "num_shared_experts": 0, "first_k_dense_replace": 0, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5, "pad_token_id": 126081,
    "eos_token_id": EOS_TOKEN_ID, "mask_token_id": MASK_TOKEN_ID,
}


def detect(hf: dict[str, Any]) -> bool:
    """Whether the HF config.json dict `hf` is this family's (`model_type` `llada2_moe*` or its architecture)."""
    return (str(hf.get("model_type", "")).startswith("llada2_moe")
            or "LLaDA2MoeModelLM" in (hf.get("architectures") or []))


def config_from_hf(hf: dict[str, Any], name: str, dtype: str, mask_token_id: int | None) -> ModelConfig:
    """The native config `name` of HF config dict `hf`, in `dtype`, with `mask_token_id` (default: config.json's,
    else `MASK_TOKEN_ID`); ConversionError for a missing field or an unsupported feature."""
    hf = common.with_defaults(hf, DEFAULTS)
    f = common.common_from_hf(hf, NAME)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        common.need(hf, key, NAME)
    common.refuse(bool(hf.get("use_bias")) or bool(hf.get("use_qkv_bias")), "use_bias / use_qkv_bias")
    common.refuse(hf.get("score_function", "sigmoid") != "sigmoid", f"score_function {hf.get('score_function')!r}")
    n_dense = int(hf["first_k_dense_replace"] or 0)
    n_shared = int(hf["num_shared_experts"] or 0)
    partial = hf["partial_rotary_factor"]
    if hf.get("rotary_dim"):
        partial = hf["rotary_dim"] / f["head_dim"]
    mask = hf["mask_token_id"] if mask_token_id is None else mask_token_id
    if mask is None:
        raise ConversionError(f"config.json has no mask_token_id and LLaDA2's {MASK_TOKEN_ID} is not in the "
                              f"vocabulary of {f['vocab_size']}; pass --mask-token-id")
    f.update(n_dense_layers=n_dense, dense_mlp_dim=int(hf.get("intermediate_size") or 0) if n_dense else 0,
             n_shared_experts=n_shared, shared_mlp_dim=n_shared * f["expert_mlp_dim"], router="sigmoid",
             norm_topk_prob=int(hf["num_experts_per_tok"]) > 1, n_expert_groups=int(hf["n_group"]),
             topk_groups=int(hf["topk_group"]), routed_scaling_factor=float(hf["routed_scaling_factor"]),
             use_expert_bias=bool(hf.get("moe_router_enable_expert_bias", True)), attention="block_causal",
             block_size=int(hf.get("block_size") or 32), qk_norm=True, rope_theta=common.rope_theta(hf),
             partial_rotary_factor=float(partial), dtype=dtype, mask_token_id=int(mask))
    return common.make_config(name, NAME, f)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dict of `cfg`; ConversionError if `cfg` uses what this family cannot express."""
    common.refuse_qwen3_5_features(cfg, NAME)
    common.refuse(cfg.attn_output_gate, "llada2_moe has no attention output gate")
    common.refuse(cfg.router != "sigmoid", "llada2_moe routes with a sigmoid")
    common.refuse(not cfg.qk_norm, "llada2_moe always uses QK-norm")
    common.refuse(cfg.norm_topk_prob != (cfg.n_experts_per_tok > 1),
                  "llada2_moe renormalises the chosen weights exactly when more than one expert is chosen")
    out = common.common_to_hf(cfg)
    out.update(model_type="llada2_moe", architectures=["LLaDA2MoeModelLM"], first_k_dense_replace=cfg.n_dense_layers,
               intermediate_size=cfg.dense_mlp_dim or None, num_shared_experts=cfg.n_shared_experts,
               n_group=cfg.n_expert_groups, topk_group=cfg.topk_groups,
               routed_scaling_factor=cfg.routed_scaling_factor, score_function="sigmoid",
               norm_topk_prob=cfg.norm_topk_prob,
               moe_router_enable_expert_bias=cfg.use_expert_bias, partial_rotary_factor=cfg.partial_rotary_factor,
               rotary_dim=cfg.rotary_dim, use_bias=False, use_qkv_bias=False, use_qk_norm=True,
               router_dtype="fp32", block_size=cfg.block_size)
    return out


source_variants = mapping.expert_variants


def groups(cfg: ModelConfig, fused_experts: bool = False) -> list[mapping.Group]:
    """Every tensor of `cfg` in this family's keys, as `mapping.Group`s; `fused_experts`: routed experts in
    transformers 5's fused form."""
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = mapping.ends(cfg, "model.word_embeddings.weight")
    for layer in range(cfg.n_layers):
        stack, i, moe = mapping.layer_stack(cfg, layer)
        p = f"model.layers.{layer}"
        a = f"{stack}.attn"
        g += [mapping.copy(f"{p}.input_layernorm.weight", (f"{stack}.attn_norm", i), (d,)),
              mapping.copy(f"{p}.post_attention_layernorm.weight", (f"{stack}.mlp_norm", i), (d,)),
              mapping.fused_qkv(f"{p}.attention.query_key_value.weight", ((f"{a}.q", i), (f"{a}.k", i), (f"{a}.v", i)),
                          d, h, kv, hd),
              mapping.linear(f"{p}.attention.dense.weight", (f"{a}.o", i), (h, hd, d), 2),
              mapping.copy(f"{p}.attention.query_layernorm.weight", (f"{a}.q_norm", i), (hd,)),
              mapping.copy(f"{p}.attention.key_layernorm.weight", (f"{a}.k_norm", i), (hd,))]
        if moe:
            g.append(mapping.linear(f"{p}.mlp.gate.weight", ("moe_layers.mlp.router", i), (d, cfg.n_experts), 1,
                              kind="float32"))
            if cfg.use_expert_bias:
                g.append(mapping.copy(f"{p}.mlp.gate.expert_bias", ("moe_layers.mlp.expert_bias", i), (cfg.n_experts,)))
            g += mapping.expert_groups(f"{p}.mlp.experts", i, cfg, fused_experts)
            if cfg.n_shared_experts:
                g += mapping.mlp_groups(f"{p}.mlp.shared_experts", stack, i, "mlp.shared", d, cfg.shared_mlp_dim)
        else:
            g += mapping.mlp_groups(f"{p}.mlp", stack, i, "mlp", d, cfg.dense_mlp_dim)
    return g
