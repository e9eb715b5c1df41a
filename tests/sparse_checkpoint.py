"""Full-size HuggingFace checkpoints that take kilobytes of disk: real safetensors headers, the data region left
as a hole (`truncate`), for what reads headers only (`clover convert --check`).

`write_sparse(path, tensors, config)` writes any key -> (shape, dtype) set; `clover_35b_published(path)` writes
Clover-35B-A3B as it is published: the multimodal config.json (text_config with one MTP layer, transformers'
Qwen3.5-MoE vision_config), `model.language_model.*` with fused experts, `lm_head.weight`, `model.visual.*`, `mtp.*`,
bfloat16, in ~40 shards with an index.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from clover_jax.config import ModelConfig, get_config
from clover_jax.convert import FAMILIES, clover, hf_io, published

Tensors = dict[str, tuple[tuple[int, ...], str]]  # key -> (shape, numpy dtype name)
# transformers' Qwen3_5MoeVisionConfig defaults, projecting into Clover-35B's d_model.
VISION_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_moe_vision", "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "out_hidden_size": 2048, "num_position_embeddings": 2304, "initializer_range": 0.02,
}


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one tensor."""
    return int(np.prod(shape, dtype=np.int64)) * hf_io.np_dtype(dtype).itemsize


def write_sparse(path: str, tensors: Tensors, config: dict[str, Any], n_shards: int = 40) -> list[str]:
    """config.json and `tensors` in about `n_shards` safetensors files of near-equal size (keys sorted) plus
    `model.safetensors.index.json`; each file is its header and a hole as long as its data. Returns the file names."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    keys = sorted(tensors)
    budget = sum(nbytes(*tensors[k]) for k in keys) / n_shards
    shards: list[list[str]] = [[]]
    size = 0
    for k in keys:
        if shards[-1] and size + nbytes(*tensors[k]) > budget * 1.0001 and len(shards) < n_shards:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes(*tensors[k])
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for k in shard:
            shape, dtype = tensors[k]
            header[k] = {"dtype": hf_io.NP_TO_ST[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes(
                shape, dtype)]}
            off += nbytes(shape, dtype)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(path, name), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)  # the data: a hole
    index = {"metadata": {"total_size": sum(nbytes(*tensors[k]) for k in keys)},
             "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in shard}}
    with open(os.path.join(path, hf_io.INDEX_FILE), "w") as f:
        json.dump(index, f, indent=1)
    return names


def published_tensors(cfg: ModelConfig, vision_config: dict[str, Any] | None, mtp_layers: int,
                      dtype: str = "bfloat16") -> dict[str, Tensors]:
    """The tensors of the published multimodal form of the hybrid model `cfg`, by part (`published.PARTS`): the
    text model under `model.language_model.` with fused experts (and `lm_head.weight`), the vision tower of
    `vision_config` (none if None), `mtp_layers` MTP layers with fused experts; every tensor in `dtype`."""
    groups = FAMILIES[cfg.family].groups(cfg, fused_experts=True, prefix="model.language_model.")
    text = {k: (tuple(s), dtype) for g in groups for k, s in zip(g.hf, g.hf_shapes, strict=True)}
    vision = published.vision_tensors(vision_config) if vision_config is not None else {}
    mtp = published.mtp_tensors(cfg, mtp_layers, fused_experts=True)
    return {published.TEXT: text, published.VISION: {k: (s, dtype) for k, s in vision.items()},
            published.MTP: {k: (s, dtype) for k, s in mtp.items()}}


def published_config(cfg: ModelConfig, vision_config: dict[str, Any] | None, mtp_layers: int) -> dict[str, Any]:
    """The multimodal config.json of the hybrid model `cfg` (clover or qwen3_5_moe): its HF text config as
    text_config (with `mtp_num_hidden_layers`), `vision_config`, the image / video token ids."""
    text = {**FAMILIES[cfg.family].config_to_hf(cfg), "mtp_num_hidden_layers": mtp_layers}
    wrapper: dict[str, Any] = {"text_config": text, "tie_word_embeddings": cfg.tie_embeddings,
                               "image_token_id": 248_056, "video_token_id": 248_057,
                               "vision_start_token_id": 248_053, "vision_end_token_id": 248_054}
    if cfg.family == "clover":
        wrapper.update(model_type="clover_moe", architectures=[clover.HYBRID_ARCHITECTURE])
    else:
        wrapper.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"])
    if vision_config is not None:
        wrapper["vision_config"] = vision_config
    return wrapper


def clover_35b_published(path: str, n_shards: int = 40) -> tuple[ModelConfig, dict[str, Tensors]]:
    """Clover-35B-A3B as published (see the module docstring), sparse, at `path`; returns its config (bfloat16)
    and the tensors written, by part."""
    cfg = get_config("clover-35b-a3b", dtype="bfloat16")
    parts = published_tensors(cfg, VISION_CONFIG, 1)
    write_sparse(path, {k: v for p in parts.values() for k, v in p.items()}, published_config(cfg, VISION_CONFIG, 1),
                 n_shards)
    return cfg, parts
