"""Opening a model to run it: a checkpoint directory or a preset name, its tokenizer, its sampler defaults and, with
a mesh layout, its weights placed on the mesh. What `clover generate`, `clover serve` and the benchmarks share.

    model = loading.open_model(loading.default_model(), mesh=None, say=print)
    model.cfg, model.weights, model.tokenizer, model.mesh
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from clover_jax import shipped
from clover_jax.checkpoint import load_checkpoint_config, load_model
from clover_jax.config import ModelConfig, get_config, preset_names
from clover_jax.errors import CloverError, TokenizerError, UsageError
from clover_jax.mesh.layouts import mesh_from_arg
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import params, quant
from clover_jax.sampler.generate import check_model
from clover_jax.sampler.settings import read_defaults
from clover_jax.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

_RANDOM_WEIGHTS: dict[tuple, Any] = {}


class OpenModel(NamedTuple):
    """A model ready to run."""

    cfg: ModelConfig
    weights: Any
    tokenizer: Tokenizer
    mesh: MeshRules | None  # where the weights are placed (None: one device)


def default_model() -> str:
    """The shipped clover-tiny checkpoint (package data), or the clover-tiny preset if it is missing."""
    return str(shipped.MODEL_DIR) if (shipped.MODEL_DIR / "config.json").is_file() else "clover-tiny"


def sampler_defaults(model: str) -> dict[str, Any]:
    """The sampler defaults a checkpoint directory stores (its generation_config.json, `settings.read_defaults`);
    {} for a preset or a checkpoint without one. UsageError for a file that does not parse or a mistyped value."""
    if not os.path.isdir(model):
        return {}
    return read_defaults(os.path.join(model, "generation_config.json"), UsageError)


def open_model(model: str, mesh: str | None = None, say: Callable[[str], None] | None = None) -> OpenModel:
    """A checkpoint directory (`model` with a config.json) or a preset name (random weights, the byte tokenizer),
    with its weights placed on the `mesh` layout (a name or a .toml path; None: one device). `say` gets one line
    per step worth telling (loading, and warnings: a preset's random weights, a checkpoint without a tokenizer
    model). UsageError (one line) for a model that is neither, a mesh this host cannot hold, or an unreadable
    tokenizer; the model is checked before any weight is read or made."""
    try:
        return _open(model, mesh, say or (lambda _line: None))
    except CloverError:
        raise
    except (ValueError, FileNotFoundError) as e:  # e.g. a mesh that this host's devices cannot hold
        raise UsageError(str(e)) from e


def _open(model: str, mesh_name: str | None, say: Callable[[str], None]) -> OpenModel:
    is_dir = os.path.isdir(model)
    if is_dir:
        cfg = load_checkpoint_config(model)
    elif model in preset_names():
        cfg = get_config(model)
    else:
        raise UsageError(f"--model {model!r} is neither a checkpoint directory nor a preset "
                         f"({', '.join(preset_names())})")
    check_model(cfg)  # before any weight is read or made
    mesh = mesh_from_arg(mesh_name)
    quant.check_backend(cfg.quantization, None if mesh is None else list(mesh.mesh.devices.flat))
    shardings = None if mesh is None else params.weight_shardings(cfg, mesh.mesh, mesh.rules)
    if not is_dir:
        say(f"warning: {model!r} is a preset: RANDOM weights and the byte tokenizer (pass --model <checkpoint dir> "
            "for a trained model)")
        key = (model, mesh_name)  # repeated runs in one process (notebooks, tests) reuse the init
        if key not in _RANDOM_WEIGHTS:
            _RANDOM_WEIGHTS.clear()
            _RANDOM_WEIGHTS[key] = params.init(cfg, jax.random.key(0), shardings)
        return OpenModel(cfg, _RANDOM_WEIGHTS[key], ByteTokenizer(), mesh)
    tok = load_tokenizer(model)  # a damaged tokenizer or chat template is one line before the weights are read
    if isinstance(tok, ByteTokenizer):
        missing = f"{model} has no tokenizer (tokenizer.json or tokenizer.model)"
        if os.path.exists(os.path.join(model, "hf_source.json")):  # converted: its source had one
            raise TokenizerError(f"{missing}, though it was converted from a HuggingFace checkpoint: copy the source's "
                                 "tokenizer files beside its config.json, or convert it again")
        say(f"warning: {model} has no tokenizer (tokenizer.json or tokenizer.model): using the byte tokenizer (ids "
            "are raw UTF-8 bytes, which only suits a model trained on them; copy the model's tokenizer files beside "
            "its config.json)")
    say(f"loading {model} ...")
    cfg, weights = load_model(model, shardings)
    return OpenModel(cfg, weights, tok, mesh)
