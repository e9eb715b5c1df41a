"""Pieces every HF family shares: config.json field translation."""

from __future__ import annotations

from typing import Any

from clover_jax.config import ModelConfig
from clover_jax.errors import ConfigError, ConversionError

# native field -> HF field, in the Qwen/Llama naming most HF configs share
COMMON_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "n_experts": "num_experts",
    "n_experts_per_tok": "num_experts_per_tok",
    "expert_mlp_dim": "moe_intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}

# The kinds of the config.json fields the families read (HF names): a damaged value is refused by name before any
# arithmetic meets it. Fields not listed are checked where a family reads them (or refused as not understood).
_INT_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
    "shared_expert_intermediate_size", "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval",
    "decoder_sparse_step", "mask_token_id", "block_size", "block_length", "n_group", "topk_group",
    "first_k_dense_replace", "num_shared_experts", "moe_block_coreset",
})
_POSITIVE_FIELDS = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                              "max_position_embeddings", "block_size", "block_length"})
_FLOAT_FIELDS = frozenset({"rope_theta", "rms_norm_eps", "partial_rotary_factor", "attention_dropout",
                           "router_aux_loss_coef", "initializer_range", "routed_scaling_factor"})
_BOOL_FIELDS = frozenset({"tie_word_embeddings", "norm_topk_prob", "attention_bias", "attn_output_gate", "use_cache",
                          "use_qk_norm"})
_TOKEN_FIELDS = frozenset({"eos_token_id", "pad_token_id", "bos_token_id"})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field_problem(key: str, value: Any) -> str | None:
    """Why `value` cannot be config.json's `key` (None: it can, or the field is not one of the typed ones)."""
    if value is None:
        return None  # absent and null are each family's to default or refuse (`need`)
    if key in _INT_FIELDS:
        if not _is_int(value):
            return f"expected an integer, got {value!r}"
        low = 1 if key in _POSITIVE_FIELDS else 0
        return None if value >= low else f"expected an integer >= {low}, got {value}"
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {value!r}"
        return None if value >= 0 else f"expected a number >= 0, got {value}"
    if key in _BOOL_FIELDS and not isinstance(value, bool):
        return f"expected true or false, got {value!r}"
    if key in _TOKEN_FIELDS and not (_is_int(value) or (isinstance(value, list) and all(map(_is_int, value)))):
        return f"expected a token id or a list of them, got {value!r}"
    if key == "layer_types" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return f"expected a list of layer kinds, got {value!r}"
    if key in ("rope_parameters", "rope_scaling") and not isinstance(value, dict):
        return f"expected a JSON object, got {value!r}"
    return None


def check_field_types(hf: dict[str, Any], where: str = "config.json") -> None:
    """ConversionError naming the file and field (`where`.field) of the first typed field of `hf` whose value is of
    the wrong type or out of range; the nested rope_parameters / rope_scaling objects included."""
    for key, value in hf.items():
        problem = _field_problem(key, value)
        if problem:
            raise ConversionError(f"{where}: {key}: {problem}")
    for nested in ("rope_parameters", "rope_scaling"):
        if isinstance(hf.get(nested), dict):
            check_field_types(hf[nested], f"{where}: {nested}")


TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def need(hf: dict[str, Any], field: str, family: str) -> Any:
    """`hf[field]`; ConversionError naming `family` when the field is missing or None."""
    if field not in hf or hf[field] is None:
        raise ConversionError(f"config.json ({family}) lacks the field {field!r}")
    return hf[field]


def refuse(cond: bool, msg: str) -> None:
    """Raise ConversionError("not supported: `msg`") when `cond` holds."""
    if cond:
        raise ConversionError(f"not supported: {msg}")


def rope_theta(hf: dict[str, Any], default: float | None = None) -> float:
    """transformers 5 keeps it in `rope_parameters`; older configs at top level."""
    rp = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    refuse(kind != "default", f"rope type {kind!r} (only the default RoPE is implemented)")
    theta = rp.get("rope_theta", hf.get("rope_theta", default))
    if theta is None:
        raise ConversionError("config.json has no rope_theta (top level or in rope_parameters)")
    return float(theta)


def token_id(value: Any) -> int | None:
    """eos_token_id may be a list in HF configs: take the first."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def with_defaults(hf: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`hf` with each field of `defaults` (the family's own config class defaults, in HF names) filled in
    where config.json lacks it. A field present as null stays null ("no EOS" stays no EOS); a default
    token id outside the vocabulary is no token (None)."""
    out = dict(hf)
    vocab = hf.get("vocab_size")
    for key, value in defaults.items():
        if key not in out:
            if key.endswith("token_id") and value is not None and vocab is not None and value >= vocab:
                value = None
            out[key] = value
    return out


def common_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Native values of the `COMMON_FIELDS` present in `hf` (token ids as ints, `num_local_experts` read as
    `num_experts`), with n_kv_heads and head_dim defaulted; ConversionError if a core size is missing.

    The end and pad tokens are always set: None where config.json has none (null or absent; fill absent
    ones from the family's defaults first, `with_defaults`). A pad id outside the vocabulary (LLaDA2's
    class default 126081 in a small model) is no pad token: padding is masked out, its id never matters."""
    out: dict[str, Any] = {}
    if hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
        hf = {**hf, "num_experts": hf["num_local_experts"]}  # what transformers 5 writes for Qwen3-MoE
    for native, field in COMMON_FIELDS.items():
        if field in hf and hf[field] is not None:
            out[native] = token_id(hf[field]) if native.endswith("token_id") else hf[field]
    for f in ("vocab_size", "d_model", "n_layers", "n_heads"):
        if f not in out:
            need(hf, COMMON_FIELDS[f], family)
    if not out.get("n_kv_heads"):  # absent, or LLaDA2's class default 0: one KV head per query head
        out["n_kv_heads"] = out["n_heads"]
    out.setdefault("head_dim", out["d_model"] // out["n_heads"])
    for tok in ("eos_token_id", "pad_token_id"):
        out.setdefault(tok, None)
    if out["pad_token_id"] is not None and not 0 <= out["pad_token_id"] < out["vocab_size"]:
        out["pad_token_id"] = None
    return out


def refuse_qwen3_5_features(cfg: ModelConfig, family: str) -> None:
    """ConversionError when `cfg` has what only the qwen3_5_moe family expresses (Gated DeltaNet layers,
    (1 + w) norms, a gated shared expert), so that no family drops them silently."""
    refuse(cfg.is_hybrid, f"{family} has no Gated DeltaNet layers (export the hybrid model as qwen3_5_moe)")
    refuse(cfg.norm_unit_offset, f"{family} norms scale by w, not (1 + w)")
    refuse(cfg.shared_expert_gate, f"{family} has no shared-expert gate")


def common_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF fields every family shares for `cfg`: `COMMON_FIELDS`, RoPE, dtype, activation, mask token id."""
    d = cfg.to_dict()
    out = {hf: d[native] for native, hf in COMMON_FIELDS.items()}
    out["rope_theta"] = cfg.rope_theta
    out["rope_parameters"] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    out["torch_dtype"] = out["dtype"] = TORCH_DTYPES[cfg.dtype]
    out["hidden_act"] = "silu"
    out["attention_bias"] = False
    out["mask_token_id"] = cfg.mask_token_id
    return out


def make_config(name: str, family: str, fields: dict[str, Any]) -> ModelConfig:
    """`ModelConfig(name=name, family=family, **fields)`; a ConfigError or TypeError becomes ConversionError."""
    try:
        return ModelConfig(name=name, family=family, **fields)  # type: ignore[arg-type]
    except (ConfigError, TypeError) as e:
        raise ConversionError(f"config.json describes no valid {family} model: {e}") from e
