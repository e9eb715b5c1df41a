"""`clover convert --check SRC`: what importing the HuggingFace checkpoint SRC would find, from config.json, the
safetensors index and the files' headers alone (no tensor data is read), in seconds whatever its size.

`check(src)` gives a `CheckReport`: the family and the model config.json describes; every text-model tensor that is
missing, unexpected, or of the wrong shape or dtype, judged as the conversion judges them (`tensor_problems`); the
vision tower's and MTP layers' differences from what the config describes (`published.expected`), warnings only
since the conversion carries those tensors as they are; parameters and bytes by part; the size of the native
weights after conversion (float in the source's dtype, and quantized with `quantize`). A bad checkpoint is data,
never an exception: `exit_code` is 0 when the conversion would succeed, 2 when it would fail (`error`, one line, says
why); `render()` is the one-screen report.

"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clover_jax import checkpoint
from clover_jax.config import ModelConfig
from clover_jax.convert import hf_io, pipeline, published, survey
from clover_jax.convert.quantize import check_scheme
from clover_jax.convert.tensor_check import Differences
from clover_jax.errors import CloverError, ConversionError, TokenizerError
from clover_jax.model.params import count_params
from clover_jax.tokenizer import load_tokenizer

SHOWN = 3  # items of each kind of difference the report names before "... and N more"


@dataclass(frozen=True)
class PartSize:
    """The tensors of one part of the source as their headers give them: how many, parameters, bytes, dtypes."""

    tensors: int = 0
    params: int = 0
    nbytes: int = 0
    dtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckReport:
    """What `check` found. Every field but `src` is optional: those found before a fatal problem are filled in.

    error: why the conversion would fail, one line (None: it would succeed). form: "multimodal" (config.json wraps
    text_config) or "text-only". parts: `PartSize` by `published.PARTS` part. text: the text model's differences
    (any makes the conversion fail, `error` says so). carried: the vision / MTP differences from the config
    (warnings). native_bytes: the native weights after conversion, float (the text model as
    `checkpoint.expected_leaves` has it, plus `carried_bytes` of vision / MTP tensors carried as they are);
    quantized_bytes: the same with `quantize`. seconds: how long the check took.
    """

    src: str
    error: str | None = None
    family: str | None = None
    form: str | None = None
    model: ModelConfig | None = None
    config_params: int | None = None
    files: int = 0
    parts: Mapping[str, PartSize] = field(default_factory=dict)
    text: Differences = field(default_factory=Differences)
    carried: Mapping[str, Differences] = field(default_factory=dict)
    native_bytes: int | None = None
    carried_bytes: int = 0
    quantize: str | None = None
    quantized_bytes: int | None = None
    text_only: bool = False
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """0 when the conversion would succeed, 2 when it would fail."""
        return 0 if self.error is None else 2

    @property
    def warnings(self) -> list[str]:
        """The report's warnings, one line each: the carried parts' differences."""
        return [f"{part}: {line}" for part, d in self.carried.items() for line in d.lines(SHOWN, SHOWN)]

    def render(self) -> str:
        """The report as text for a terminal: one line a fact, the verdict last (the verdict alone when config.json
        could not be read)."""
        out = []
        if self.family:
            out.append(f"family   {self.family} ({self.form} config.json)")
        cfg = self.model
        if cfg is not None:
            kinds = (f" ({cfg.n_linear_layers} Gated DeltaNet + {cfg.n_layers - cfg.n_linear_layers} attention)"
                     if cfg.is_hybrid else "")
            experts = f", {cfg.n_experts} experts ({cfg.n_experts_per_tok} per token)" if cfg.n_experts else ""
            out.append(f"model    {cfg.name}: {cfg.n_layers} layers{kinds}{experts}, d_model {cfg.d_model}, vocab "
                       f"{cfg.vocab_size:,}, {cfg.dtype}; {_count(self.config_params or 0)} parameters")
        if self.parts:
            n = sum(p.tensors for p in self.parts.values())
            out.append(f"files    {self.files} safetensors file{'s' if self.files != 1 else ''}, {n:,} tensors "
                       "(headers only)")
            out.append(f"{'part':8} {'tensors':>8} {'params':>9} {'bytes':>10}  dtype")
            for part, p in self.parts.items():
                if part == published.TEXT or p.tensors:
                    fate = ("" if part == published.TEXT else "dropped (--text-only)" if self.text_only
                            else "carried as is")
                    out.append(f"{part:8} {p.tensors:>8,} {_count(p.params):>9} {_bytes(p.nbytes):>10}  "
                               f"{', '.join(p.dtypes) or '-'}  {fate}".rstrip())
        if self.native_bytes is not None:
            line = f"native   {_bytes(self.native_bytes)} after conversion"
            if self.carried_bytes:
                line += f" ({_bytes(self.native_bytes - self.carried_bytes)} text model + " \
                        f"{_bytes(self.carried_bytes)} vision / MTP carried)"
            if self.quantized_bytes is not None:
                line += f"; with --quantize {self.quantize}: {_bytes(self.quantized_bytes)}"
            out.append(line)
        out += [f"problem  text: {line}" for line in self.text.lines(SHOWN, SHOWN)]
        out += [f"warning  {line}" for line in self.warnings]
        if self.error is None:
            n = len(self.warnings)
            said = f", {n} warning{'s' if n != 1 else ''} above" if n else ""
            out.append(f"OK       the conversion would succeed (checked in {self.seconds:.1f} s{said})")
        else:
            out.append(f"FAIL     {self.error}")
        return "\n".join(out)


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _size(tensors: Mapping[str, hf_io.TensorInfo]) -> PartSize:
    dtypes = collections.Counter(t.dtype for t in tensors.values())
    return PartSize(len(tensors), sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors.values()),
                    sum(t.nbytes for t in tensors.values()), tuple(d for d, _ in dtypes.most_common()))


def _leaf_bytes(cfg: ModelConfig) -> int:
    return sum(s.size * np.dtype(s.dtype).itemsize for s in checkpoint.expected_leaves(cfg).values())


def check(src: str, family: str | None = None, mask_token_id: int | None = None, quantize: str | None = None,
          text_only: bool = False) -> CheckReport:
    """What converting the HuggingFace checkpoint directory `src` (`pipeline.hf_to_native` with the same arguments)
    would find, from config.json, the index and the safetensors headers; no tensor data is read. Never raises for a
    bad checkpoint (the report holds the problem); ConversionError only for an unknown `quantize` scheme.

    text_only: the conversion drops the vision tower and the MTP layers, which are then not compared with the
    config nor counted in the native size."""
    scheme = check_scheme(quantize)
    start = time.perf_counter()
    facts: dict[str, Any] = {"quantize": scheme, "text_only": text_only}
    try:
        _check(src, family, mask_token_id, scheme, text_only, facts)
    except (CloverError, OSError) as e:
        facts.setdefault("error", " ".join(str(e).split()) or type(e).__name__)
    return CheckReport(src, **facts, seconds=time.perf_counter() - start)


def _check(src: str, family: str | None, mask_token_id: int | None, scheme: str | None, text_only: bool,
           facts: dict[str, Any]) -> None:
    """Fill `facts` (CheckReport's fields) as they are found; raises at the first problem that leaves nothing more
    to check, and sets facts["error"] for one that does (the first such one wins)."""
    if not os.path.isdir(src):
        raise ConversionError(f"source {src!r} is not a directory")
    if pipeline.is_native(src):
        raise ConversionError(f"{src} is a native checkpoint; --check reads HuggingFace checkpoints")
    hf = survey.read_hf_config(src)
    mod = survey.family_of(hf, family)
    facts.update(family=mod.NAME, form="multimodal" if "text_config" in hf else "text-only")
    try:
        load_tokenizer(src)  # what generation reads of the tokenizer files and the chat template
    except TokenizerError as e:
        facts.setdefault("error", str(e))
    refused = survey.quantized_source(hf, src)
    if refused:
        facts["error"] = refused
    source = hf_io.open_source(src)
    try:
        tensors = source.tensors
    finally:
        source.close()  # the headers are all it needed
    sv = survey.survey(src, hf, tensors, family, mask_token_id)
    parts = {p: sv.part(p) for p in sv.parts}
    facts.update(files=len({t.file for t in tensors.values()}), parts={p: _size(t) for p, t in parts.items()},
                 model=sv.cfg, config_params=count_params(sv.cfg).total, text=sv.text)
    if sv.failure(brief=True):
        facts.setdefault("error", sv.failure(brief=True))
    # Vision and MTP: carried as they are (dropped with text_only), so a difference from the config is a warning.
    keys = [] if text_only else sv.carried_keys
    carried = sum(tensors[k].nbytes for k in keys)
    facts.update(native_bytes=_leaf_bytes(sv.cfg) + carried, carried_bytes=carried)
    if scheme:
        facts["quantized_bytes"] = _leaf_bytes(sv.cfg.replace(quantization=scheme)) + carried
    if keys:
        facts["carried"] = sv.carried
