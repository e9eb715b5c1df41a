"""Driving the official reference samplers with transformers' Qwen3-MoE, shared by the fixtures and the benchmark.

Nothing from the reference repositories is copied here: `import_llada` / `import_fastdllm` IMPORT their
generate.py from the checkout the caller names (ML-GSAI/LLaDA, NVlabs/Fast-dLLM), and the adapters below
make transformers' `Qwen3MoeForCausalLM` look like the mask predictors those functions call:

    LLaDAPredictor      model(x, attention_mask=None).logits, bidirectional (full 4-D boolean mask)
    FastDllmPredictor   Fast-dLLM's calls with its legacy-tuple prefix and dual caches (via TupleCache)

Used by tests/fixtures/reference/make_fixtures.py (the regression fixtures) and benchmarks/vs_reference.py
(speed against the references). Needs torch and transformers 5.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn


class ReferenceNotFound(Exception):
    """A reference checkout is missing or lacks the file imported from it (a one-line message)."""


# ---- importing the references ------------------------------------------------------------------------


def _load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ReferenceNotFound(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def llada_file(repo: Path) -> Path:
    """ML-GSAI/LLaDA's generate.py in `repo`."""
    path = repo / "generate.py"
    if not path.is_file():
        raise ReferenceNotFound(f"--llada-repo {repo}: no generate.py (expected a checkout of ML-GSAI/LLaDA)")
    return path


def fastdllm_file(repo: Path) -> Path:
    """NVlabs/Fast-dLLM's llada/generate.py in `repo` (or generate.py, when `repo` is its llada/ folder)."""
    path = repo / "llada" / "generate.py" if (repo / "llada" / "generate.py").is_file() else repo / "generate.py"
    if not path.is_file():
        raise ReferenceNotFound(f"--fastdllm-repo {repo}: no llada/generate.py or generate.py "
                                "(expected NVlabs/Fast-dLLM)")
    return path


def import_llada(repo: Path) -> types.ModuleType:
    """ML-GSAI/LLaDA's generate.py (`generate`: low-confidence remasking, no cache)."""
    return _load_module("ref_llada_generate", llada_file(repo))


def import_fastdllm(repo: Path) -> types.ModuleType:
    """NVlabs/Fast-dLLM's llada/generate.py (`generate`, `generate_with_prefix_cache`, `generate_with_dual_cache`)."""
    path = fastdllm_file(repo)
    # Its generate.py imports model.modeling_llada.LLaDAModelLM (needs einops) only for its own main();
    # the functions used here take the model as an argument, so a stand-in module is enough.
    stub_pkg = types.ModuleType("model")
    stub_pkg.__path__ = []
    stub = types.ModuleType("model.modeling_llada")
    stub.LLaDAModelLM = None
    saved = {k: sys.modules.get(k) for k in ("model", "model.modeling_llada")}
    sys.modules.update({"model": stub_pkg, "model.modeling_llada": stub})
    try:
        return _load_module("ref_fastdllm_generate", path)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


# ---- adapters: the HF Qwen3-MoE as the bidirectional mask predictor the references call -------------


def _cache_kw(hf: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


class LLaDAPredictor(nn.Module):
    """`model(x, attention_mask=None).logits` for LLaDA's generate: every query row sees every valid key
    (4-D boolean mask), positions count only valid columns so left padding does not shift a row.
    `n_calls` counts forward passes; `calls` keeps a copy of every pass's logits when `keep_logits`."""

    def __init__(self, hf: nn.Module, keep_logits: bool = True) -> None:
        super().__init__()
        self.hf = hf
        self.keep_logits = keep_logits
        self.calls: list[torch.Tensor] = []
        self.n_calls = 0

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        b, t = input_ids.shape
        valid = torch.ones(b, t, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        mask = valid[:, None, None, :].expand(b, 1, t, t).contiguous()
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        logits = self.hf(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        self.n_calls += 1
        if self.keep_logits:
            self.calls.append(logits.detach().clone())
        return types.SimpleNamespace(logits=logits)


class TupleCache(transformers.cache_utils.Cache):
    """A transformers Cache fed from Fast-dLLM's legacy tuples ((k, v) per layer, [B, H, T, D]) on every
    call. update() returns the keys the window attends to: its own alone (no past), the past followed by
    the window (prefix cache), or the past with the window written over `replace` columns (dual cache).
    The tuples passed in are never mutated; `present` holds what the call returns as past_key_values."""

    def __init__(self, n_layers: int, past: tuple | None, replace: torch.Tensor | None) -> None:
        super().__init__(layers=[transformers.cache_utils.DynamicLayer() for _ in range(n_layers)])
        self.past, self.replace = past, replace
        self.present: list[tuple[torch.Tensor, torch.Tensor]] = [None] * n_layers  # type: ignore[list-item]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.past is None:
            k, v = key_states, value_states
        elif self.replace is None:
            k = torch.cat([self.past[layer_idx][0], key_states], dim=-2)
            v = torch.cat([self.past[layer_idx][1], value_states], dim=-2)
        else:
            k, v = self.past[layer_idx][0].clone(), self.past[layer_idx][1].clone()
            k[:, :, self.replace] = key_states
            v[:, :, self.replace] = value_states
        self.present[layer_idx] = (k, v)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.past is None else int(self.past[0][0].shape[-2])


class FastDllmPredictor(nn.Module):
    """What Fast-dLLM's generate functions call (its LLaDAModelLM: no causal mask, RoPE by absolute
    column): model(x, use_cache=True); model(x_suffix, past_key_values=tuples, use_cache=True), the window
    at positions after the cached prefix, seeing the prefix and itself; model(x_block, past_key_values=
    tuples, use_cache=True, replace_position=bool [B, T]), the block's fresh K/V replacing the cached ones
    at its columns and the block seeing the whole cached sequence. Fast-dLLM caches keys before RoPE and
    rotates all of them per call; these cache them rotated at the same absolute positions."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.n_layers = hf.config.num_hidden_layers
        self.kw = _cache_kw(hf)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def forward(self, input_ids: torch.Tensor, past_key_values: tuple | list | None = None, use_cache: bool = False,
                replace_position: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> Any:
        if attention_mask is not None:
            raise ValueError("Fast-dLLM's batch-1 functions pass no attention mask")
        b, w = input_ids.shape
        replace = None
        if past_key_values is None:
            pos, total = torch.arange(w), w
        elif replace_position is None:
            start = int(past_key_values[0][0].shape[-2])
            pos, total = torch.arange(start, start + w), start + w
        else:
            replace = replace_position[0].nonzero().squeeze(-1)
            if replace.numel() != w or not bool((replace_position == replace_position[:1]).all()):
                raise ValueError("replace_position must mark the window's columns, the same in every row")
            pos, total = replace, int(past_key_values[0][0].shape[-2])
        cache = TupleCache(self.n_layers, None if past_key_values is None else tuple(past_key_values), replace)
        mask = torch.ones(b, 1, w, total, dtype=torch.bool)
        out = self.hf(input_ids=input_ids, attention_mask=mask, position_ids=pos[None].expand(b, w),
                      use_cache=True, **{self.kw: cache})
        return types.SimpleNamespace(logits=out.logits, past_key_values=tuple(cache.present))
