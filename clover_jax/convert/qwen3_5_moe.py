"""`qwen3_5_moe`: transformers' Qwen3.5 / Qwen3.6 MoE text model (Qwen3_5MoeForCausalLM), the hybrid
backbone Clover is built on: groups of Gated DeltaNet layers and gated full-attention layers, each
followed by a MoE with a gated shared expert. It runs causally here (block-causal attention with
blocks of one token), exactly as transformers runs it.

Keys, per layer i (`model.layers.{i}.`):
  linear_attn.in_proj_qkv.weight [2*Hk*dk + Hv*dv, D]   in_proj_z [Hv*dv, D]   in_proj_b / in_proj_a [Hv, D]
  linear_attn.conv1d.weight [C, 1, K]   A_log [Hv]   dt_bias [Hv]   norm.weight [dv]   out_proj [D, Hv*dv]
  self_attn.q_proj.weight [H * 2 * hd, D] (per head: query rows, then output-gate rows), k/v/o_proj,
  q_norm / k_norm [hd]; mlp.gate [E, D], mlp.experts.* (per-expert or fused), mlp.shared_expert.*,
  mlp.shared_expert_gate [1, D]; input_layernorm / post_attention_layernorm [D]
RMSNorms scale by (1 + w) (zero-initialised), except the Gated DeltaNet output norm (plain w). Every
config.json field is either honoured, known not to matter here (metadata), or refused by name.

Also read: the keys under `model.language_model.`, `language_model.model.` or `language_model.` instead of
`model.` (lm_head then `language_model.lm_head` for the last two), and Qwen3-Next's fused projections
`linear_attn.in_proj_qkvz` / `in_proj_ba`. An export writes the keys the import read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from clover_jax.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from clover_jax.convert import common, mapping
from clover_jax.errors import ConversionError

NAME = "qwen3_5_moe"
MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
ARCHITECTURES = ("Qwen3_5MoeForCausalLM",)
WRAPPER_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration",)  # the multimodal model (`published`)
# Fields of transformers' PretrainedConfig and of Qwen3_5MoeTextConfig that do not change the model's
# function here: bookkeeping, generation or training switches.
METADATA = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "name_or_path",
    "output_hidden_states", "output_attentions", "return_dict", "use_cache", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "output_router_logits",
    "router_aux_loss_coef", "bos_token_id", "initializer_range", "mask_token_id",
    # The MTP layers' settings: their tensors are carried, not run (`published`).
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
    # The dtype transformers keeps the Gated DeltaNet state in; it is float32 here whatever the weights' dtype.
    "mamba_ssm_dtype",
}
HONOURED = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta",
    "partial_rotary_factor", "rope_scaling", "attention_bias", "attention_dropout", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts",
    "layer_types", "full_attention_interval", "eos_token_id", "pad_token_id", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "attn_output_gate",
}
PREFIXES = ("model.", "model.language_model.", "language_model.model.", "language_model.")
GATED_ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}


def detect(hf: dict[str, Any]) -> bool:
    """Whether the HF config.json dict `hf` is this family's (`model_type` `qwen3_5_moe_text` or the multimodal
    wrapper's `qwen3_5_moe`, or either model's architecture)."""
    archs = hf.get("architectures") or []
    return hf.get("model_type") in MODEL_TYPES or any(a in ARCHITECTURES + WRAPPER_ARCHITECTURES for a in archs)


def _layer_types(hf: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = int(hf.get("full_attention_interval") or 4)
        kinds = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
    return tuple(kinds)


def text_fields(hf: dict[str, Any], family: str, honoured: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The native config fields of a Qwen3.5 text config.json `hf` (everything but attention mode, block size,
    name and dtype); `honoured`: further fields the calling family reads itself. ConversionError naming any
    field not understood or not honoured."""
    if "text_config" in hf:  # `published.read` unwraps it first
        raise ConversionError("internal: a multimodal config.json reached the text model's fields unread")
    unknown = sorted(set(hf) - HONOURED - METADATA - honoured)
    if unknown:
        raise ConversionError(f"config.json ({family}) has fields this converter does not understand: "
                              f"{', '.join(unknown)}")
    f = common.common_from_hf(hf, family)
    for key in ("n_experts", "n_experts_per_tok", "expert_mlp_dim"):
        if key not in f:
            common.need(hf, common.COMMON_FIELDS[key], family)
    rp = hf.get("rope_parameters") or {}
    common.refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
    common.refuse(bool(hf.get("attention_bias")), "attention_bias=true")
    common.refuse(float(hf.get("attention_dropout") or 0.0) != 0.0, "attention_dropout > 0")
    common.refuse(hf.get("decoder_sparse_step", 1) != 1, "decoder_sparse_step != 1")
    common.refuse(bool(hf.get("mlp_only_layers")), "mlp_only_layers (dense layers in the hybrid stack)")
    common.refuse(not hf.get("norm_topk_prob", True), "norm_topk_prob=false (Qwen3.5 renormalises top-k)")
    common.refuse(hf.get("attn_output_gate", True) is False, "attn_output_gate=false (Qwen3.5 gates attention)")
    unknown_rope = sorted(set(rp) - {"rope_theta", "rope_type", "partial_rotary_factor", "mrope_section",
                                     "mrope_interleaved"})
    common.refuse(bool(unknown_rope), f"rope_parameters fields {unknown_rope}")
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    f.update(
        layer_types=_layer_types(hf, f["n_layers"]),
        linear_num_key_heads=common.need(hf, "linear_num_key_heads", family),
        linear_num_value_heads=common.need(hf, "linear_num_value_heads", family),
        linear_key_head_dim=common.need(hf, "linear_key_head_dim", family),
        linear_value_head_dim=common.need(hf, "linear_value_head_dim", family),
        linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
        n_shared_experts=1 if shared else 0, shared_mlp_dim=shared, shared_expert_gate=bool(shared),
        router="softmax", norm_topk_prob=True, qk_norm=True,
        attn_output_gate=True, norm_unit_offset=True, rope_theta=common.rope_theta(hf),
        partial_rotary_factor=float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
    )
    f.setdefault("norm_eps", 1e-6)
    return f


def config_from_hf(hf: dict[str, Any], name: str, dtype: str, mask_token_id: int | None) -> ModelConfig:
    """The native config of the HF text config `hf`, in `dtype`, with `mask_token_id` (default the last id);
    ConversionError naming any field this converter does not understand or cannot honour."""
    f = text_fields(hf, NAME)
    f.update(attention="block_causal", block_size=1, dtype=dtype)
    if mask_token_id is not None:
        f["mask_token_id"] = mask_token_id
    return common.make_config(name, NAME, f)


def text_config_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The Qwen3.5 text fields of `cfg` (no model_type / architectures); ConversionError if `cfg` uses what
    the Qwen3.5 backbone cannot express."""
    common.refuse(not cfg.norm_unit_offset, f"{family} norms scale by (1 + w)")
    common.refuse(not cfg.attn_output_gate, f"{family} attention has an output gate")
    common.refuse(cfg.n_shared_experts > 0 and not cfg.shared_expert_gate, f"{family} gates its shared expert")
    common.refuse(cfg.router != "softmax" or cfg.use_expert_bias or not cfg.norm_topk_prob,
                  f"{family} routes with a renormalised softmax top-k")
    common.refuse(cfg.n_dense_layers > 0, f"{family} has no dense layers")
    out = common.common_to_hf(cfg)
    out.pop("rope_theta")
    out.update(
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default",
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        layer_types=list(cfg.layer_types or (FULL_ATTENTION,) * cfg.n_layers),
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, shared_expert_intermediate_size=cfg.shared_mlp_dim,
        norm_topk_prob=True, attention_dropout=0.0,
    )
    return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF text config.json dict of `cfg`; ConversionError if `cfg` uses what Qwen3.5 cannot express."""
    common.refuse(not (cfg.is_block_causal and cfg.block_size == 1), "qwen3_5_moe attention is causal")
    common.refuse(cfg.has_bd_weights, "qwen3_5_moe has no block-diffusion Gated DeltaNet tensors (export as clover)")
    out = text_config_to_hf(cfg, NAME)
    out.update(model_type="qwen3_5_moe_text", architectures=list(ARCHITECTURES))
    return out


def stack_of(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """(native stack, index in it) of decoder layer `layer`: Gated DeltaNet layers in `linear_layers`, the
    attention layers in `moe_layers`."""
    kinds = cfg.layer_types or (FULL_ATTENTION,) * cfg.n_layers
    kind = kinds[layer]
    return ("linear_layers" if kind == LINEAR_ATTENTION else "moe_layers"), kinds[:layer].count(kind)


def source_variants(keys: Iterable[str]) -> dict[str, Any]:
    """The `groups` keywords that describe a source checkpoint with these HF keys: fused experts, Qwen3-Next's
    fused Gated DeltaNet projections, and the prefix of the model's keys."""
    keys = set(keys)
    prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in keys), PREFIXES[0])
    return {"fused_experts": mapping.has_fused_experts(keys),
            "fused_linear": any(k.endswith(".linear_attn.in_proj_qkvz.weight") for k in keys), "prefix": prefix}


def groups(cfg: ModelConfig, fused_experts: bool = False, fused_linear: bool = False,
           prefix: str = "model.") -> list[mapping.Group]:
    """Every tensor of `cfg` in this family's keys, as `mapping.Group`s; `fused_experts`: routed experts in
    transformers 5's fused form; `fused_linear`: Qwen3-Next's in_proj_qkvz / in_proj_ba; `prefix`: one of
    PREFIXES for the model's keys."""
    if prefix not in PREFIXES:
        raise ConversionError(f"unknown key prefix {prefix!r}; known: {PREFIXES}")
    return backbone_groups(cfg, fused_experts, fused_linear, prefix)


def layer_prefix(prefix: str, layer: int) -> str:
    """The key prefix of decoder layer `layer` under the model prefix `prefix`."""
    return f"{prefix}layers.{layer}"


def backbone_groups(cfg: ModelConfig, fused_experts: bool, fused_linear: bool, prefix: str) -> list[mapping.Group]:
    """`groups` for any model prefix (the lm_head sits at the top level unless the prefix starts with
    `language_model.`)."""
    d, h, hd = cfg.d_model, cfg.n_heads, cfg.head_dim
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    head = "language_model.lm_head.weight" if prefix.startswith("language_model.") else "lm_head.weight"
    g = mapping.ends(cfg, f"{prefix}embed_tokens.weight", f"{prefix}norm.weight", head)
    for layer in range(cfg.n_layers):
        stack, i = stack_of(cfg, layer)
        p = layer_prefix(prefix, layer)
        g += [mapping.copy(f"{p}.input_layernorm.weight", (f"{stack}.attn_norm", i), (d,)),
              mapping.copy(f"{p}.post_attention_layernorm.weight", (f"{stack}.mlp_norm", i), (d,))]
        if stack == "linear_layers":
            a, la = f"{stack}.attn", f"{p}.linear_attn"
            if fused_linear:
                g += [mapping.fused_qkvz(f"{la}.in_proj_qkvz.weight", ((f"{a}.qkv", i), (f"{a}.z", i)), d, hk, dk,
                                         hv, dv),
                      mapping.fused_ba(f"{la}.in_proj_ba.weight", ((f"{a}.b", i), (f"{a}.a", i)), d, hk, hv)]
            else:
                g += [mapping.gdn_qkv(f"{la}.in_proj_qkv.weight", (f"{a}.qkv", i), cfg),
                      mapping.linear(f"{la}.in_proj_z.weight", (f"{a}.z", i), (d, hv, dv), 1),
                      mapping.linear(f"{la}.in_proj_b.weight", (f"{a}.b", i), (d, hv), 1),
                      mapping.linear(f"{la}.in_proj_a.weight", (f"{a}.a", i), (d, hv), 1)]
            g += [mapping.gdn_conv(f"{la}.conv1d.weight", (f"{a}.conv", i), cfg.linear_conv_kernel_dim, cfg),
                  mapping.copy(f"{la}.A_log", (f"{a}.a_log", i), (hv,)),
                  mapping.copy(f"{la}.dt_bias", (f"{a}.dt_bias", i), (hv,)),
                  mapping.copy(f"{la}.norm.weight", (f"{a}.norm", i), (dv,)),
                  mapping.linear(f"{la}.out_proj.weight", (f"{a}.out", i), (hv, dv, d), 2)]
        else:
            a, sa = f"{stack}.attn", f"{p}.self_attn"
            g.append(mapping.gated_query(f"{sa}.q_proj.weight", ((f"{a}.q", i), (f"{a}.gate", i)), d, h, hd))
            g += [gr for gr in mapping.attention_groups(sa, stack, i, cfg.replace(attn_output_gate=False),
                                                        GATED_ATTENTION) if gr.native[0][0] != f"{a}.q"]
        m = f"{stack}.mlp"
        g.append(mapping.linear(f"{p}.mlp.gate.weight", (f"{m}.router", i), (d, cfg.n_experts), 1, kind="float32"))
        g += mapping.expert_groups(f"{p}.mlp.experts", i, cfg, fused_experts, stack)
        if cfg.n_shared_experts:
            g += mapping.mlp_groups(f"{p}.mlp.shared_expert", stack, i, "mlp.shared", d, cfg.shared_mlp_dim)
            g.append(mapping.linear(f"{p}.mlp.shared_expert_gate.weight", (f"{m}.shared_gate", i), (d, 1), 1))
    return g
