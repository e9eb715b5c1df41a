"""The forms Qwen3.5 / Qwen3.6 MoE checkpoints (and Clover's, built on them) are published in.

A published checkpoint is usually the multimodal model (`Qwen3_5MoeForConditionalGeneration`): config.json
wraps the text model's fields in `text_config` beside a `vision_config` and the image / video token ids,
and the tensors are `model.language_model.*` (the text model), `lm_head.weight`, `model.visual.*` (the
vision tower) and `mtp.*` (the multi-token-prediction layers). A text-only config.json (the fields at the
top level, `Qwen3_5MoeForCausalLM`) is the other form. `read` gives the text model's config either way.

The text model is what converts. The vision tower and the MTP layers are carried, never interpreted:
`part_of` tells them apart by key, and a native checkpoint keeps them untouched (stored, never put on a
device) so that an export gives them back. `vision_tensors` and `mtp_tensors` say what the config describes,
for `clover convert --check` and for a warning at conversion; a difference is reported, not refused (the
tensors are carried as they are). The MTP names are those vLLM's and SGLang's Qwen3.5 MTP loaders read:
`mtp.fc` [D, 2D], `mtp.pre_fc_norm_embedding` / `mtp.pre_fc_norm_hidden` / `mtp.norm` [D], and
`mtp.layers.{i}.*`, each a gated full-attention decoder layer with the MoE of the text model, its routed
experts per expert or fused; the MTP layers share the text model's embedding and LM head.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from clover_jax.config import FULL_ATTENTION, ModelConfig
from clover_jax.convert import common, qwen3_5_moe
from clover_jax.errors import ConversionError

TEXT, VISION, MTP = "text", "vision", "mtp"
PARTS = (TEXT, VISION, MTP)
VISION_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# The wrapper's own fields that decide something about the text model: the LM head's tie (transformers'
# multimodal model follows the wrapper's), and for Clover the block size and mask token, wherever it keeps them.
_TEXT_FROM_WRAPPER = ("tie_word_embeddings", "block_size", "block_length", "diffusion_block_size", "bd_block_size",
                      "mask_token_id", "bd_gdn")


@dataclass(frozen=True)
class Published:
    """A config.json read as published: `text` is the text model's config dict (what the families read);
    `wrapper` the whole multimodal config when config.json wraps `text_config` (None for a text-only one)."""

    text: dict[str, Any]
    wrapper: dict[str, Any] | None = None

    @property
    def vision_config(self) -> dict[str, Any] | None:
        """The wrapper's `vision_config` (None for a text-only config.json)."""
        vc = (self.wrapper or {}).get("vision_config")
        return vc if isinstance(vc, dict) else None

    @property
    def tokens(self) -> dict[str, Any]:
        """The image / video token ids the wrapper names."""
        return {k: self.wrapper[k] for k in TOKEN_FIELDS if self.wrapper and k in self.wrapper}

    @property
    def mtp_layers(self) -> int:
        """How many MTP layers the text config describes (`mtp_num_hidden_layers`, 0 when absent)."""
        return int(self.text.get("mtp_num_hidden_layers") or 0)


def read(hf: Mapping[str, Any]) -> Published:
    """The config.json dict `hf` as `Published`: a wrapper's `text_config` (with the wrapper's
    tie_word_embeddings, which is the one transformers' multimodal model follows, and the block size or mask
    token a Clover wrapper may keep at its top level), or `hf` itself.
    ConversionError when `text_config` is not a JSON object, or for a field of the wrong type or out of range
    (`common.check_field_types`, naming the field)."""
    common.check_field_types(dict(hf))
    if "text_config" not in hf:
        return Published(dict(hf))
    text = hf["text_config"]
    if not isinstance(text, dict):
        raise ConversionError(f"config.json's text_config is a {type(text).__name__}, not a JSON object")
    common.check_field_types(text, "config.json: text_config")
    text = dict(text)
    for key in _TEXT_FROM_WRAPPER:
        if key in hf and (key == "tie_word_embeddings" or key not in text):
            text[key] = hf[key]
    return Published(text, dict(hf))


def part_of(key: str) -> str:
    """The part of a published checkpoint the tensor `key` belongs to: VISION, MTP or TEXT (everything
    else, which the text model must then account for)."""
    if key.startswith(VISION_PREFIXES):
        return VISION
    if key.startswith(MTP_PREFIX):
        return MTP
    return TEXT


def split(keys: Iterable[str]) -> dict[str, list[str]]:
    """`keys` by part (every part present, each list in the given order)."""
    out: dict[str, list[str]] = {p: [] for p in PARTS}
    for k in keys:
        out[part_of(k)].append(k)
    return out


def _int(vc: Mapping[str, Any], *names: str, default: int | None = None) -> int:
    for n in names:
        if vc.get(n) is not None:
            v = vc[n]
            return int(v[0] if isinstance(v, list | tuple) else v)
    if default is None:
        raise ConversionError(f"vision_config lacks {names[0]!r}")
    return default


def vision_tensors(vc: Mapping[str, Any], prefix: str = "model.visual.") -> dict[str, tuple[int, ...]]:
    """The tensors (key -> shape) of the Qwen3.5 vision tower `vc` (a `vision_config` dict, transformers'
    defaults for absent fields): a Conv3d patch embedding, learned position embeddings, `depth` pre-norm
    blocks (LayerNorms, fused qkv, a two-layer MLP, all with biases) and the patch merger."""
    h = _int(vc, "hidden_size", default=1152)
    inter = _int(vc, "intermediate_size", default=4304)
    depth = _int(vc, "depth", "num_hidden_layers", default=27)
    ch, ps = _int(vc, "in_channels", default=3), _int(vc, "patch_size", default=16)
    tps, merge = _int(vc, "temporal_patch_size", default=2), _int(vc, "spatial_merge_size", default=2)
    out_h, n_pos = _int(vc, "out_hidden_size", default=3584), _int(vc, "num_position_embeddings", default=2304)
    if vc.get("deepstack_visual_indexes"):
        raise ConversionError("vision_config has deepstack_visual_indexes, which the Qwen3.5 vision tower does "
                              "not have (its tensors cannot be checked here)")
    merged = h * merge * merge
    t = {"patch_embed.proj.weight": (h, ch, tps, ps, ps), "patch_embed.proj.bias": (h,),
         "pos_embed.weight": (n_pos, h)}
    for i in range(depth):
        b = f"blocks.{i}."
        t.update({f"{b}norm1.weight": (h,), f"{b}norm1.bias": (h,), f"{b}norm2.weight": (h,), f"{b}norm2.bias": (h,),
                  f"{b}attn.qkv.weight": (3 * h, h), f"{b}attn.qkv.bias": (3 * h,),
                  f"{b}attn.proj.weight": (h, h), f"{b}attn.proj.bias": (h,),
                  f"{b}mlp.linear_fc1.weight": (inter, h), f"{b}mlp.linear_fc1.bias": (inter,),
                  f"{b}mlp.linear_fc2.weight": (h, inter), f"{b}mlp.linear_fc2.bias": (h,)})
    t.update({"merger.norm.weight": (h,), "merger.norm.bias": (h,),
              "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
              "merger.linear_fc2.weight": (out_h, merged), "merger.linear_fc2.bias": (out_h,)})
    return {prefix + k: v for k, v in t.items()}


def mtp_tensors(cfg: ModelConfig, n_layers: int, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """The tensors (key -> shape) of `n_layers` MTP layers for the hybrid text model `cfg`: the input
    projection and norms, and per layer a gated full-attention decoder layer with `cfg`'s MoE (routed
    experts per expert, or fused with `fused_experts`)."""
    if n_layers <= 0:
        return {}
    d = cfg.d_model
    one = cfg.replace(n_layers=n_layers, layer_types=(FULL_ATTENTION,) * n_layers, tie_embeddings=True,
                      bd_conv_right_kernel=0, bd_gdn="none")  # attention layers only: no Gated DeltaNet tensors
    layers = {k: s for g in qwen3_5_moe.backbone_groups(one, fused_experts, False, MTP_PREFIX)
              for k, s in zip(g.hf, g.hf_shapes, strict=True) if k.startswith(f"{MTP_PREFIX}layers.")}
    return {f"{MTP_PREFIX}fc.weight": (d, 2 * d), f"{MTP_PREFIX}pre_fc_norm_embedding.weight": (d,),
            f"{MTP_PREFIX}pre_fc_norm_hidden.weight": (d,), f"{MTP_PREFIX}norm.weight": (d,), **layers}


def expected(pub: Published, cfg: ModelConfig, keys: Iterable[str]) -> dict[str, dict[str, tuple[int, ...]]]:
    """What `pub` describes beside the text model, by part: VISION (from its vision_config; the tower's
    prefix as the checkpoint `keys` spell it) and MTP (the experts' form as the checkpoint's MTP keys have
    it). A part the config does not describe is empty."""
    keys = list(keys)
    out: dict[str, dict[str, tuple[int, ...]]] = {VISION: {}, MTP: {}}
    vc = pub.vision_config
    if vc is not None:
        prefix = next((p for p in VISION_PREFIXES if any(k.startswith(p) for k in keys)), VISION_PREFIXES[0])
        out[VISION] = vision_tensors(vc, prefix)
    if pub.mtp_layers and cfg.is_hybrid:
        fused = any(k.startswith(MTP_PREFIX) and k.endswith(".mlp.experts.gate_up_proj") for k in keys)
        out[MTP] = mtp_tensors(cfg, pub.mtp_layers, fused)
    return out


def differences(want: Mapping[str, tuple[int, ...]], found: Mapping[str, Any]) -> dict[str, list[str]]:
    """How the tensors `found` (key -> object with `.shape`) differ from `want` (key -> shape): the missing
    keys, the unexpected ones, and 'KEY is SHAPE, expected SHAPE' lines; each list sorted."""
    shapes = [f"{k} is {list(found[k].shape)}, expected {list(want[k])}"
              for k in sorted(set(want) & set(found)) if tuple(found[k].shape) != tuple(want[k])]
    return {"missing": sorted(set(want) - set(found)), "unexpected": sorted(set(found) - set(want)), "shape": shapes}
