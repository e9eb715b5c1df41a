"""What a HuggingFace source is, from its config.json and its tensors' headers alone.

`survey(src, hf, tensors)` finds the family (`family_of`), unwraps a published multimodal config
(`published.read`), splits the tensors by part, builds the native config the text model describes (in the
embedding's dtype) and its key map, and judges the text model's tensors (`tensor_check`) and the vision / MTP
tensors against what the config describes. No tensor data is read. The conversion (`pipeline.hf_to_native`)
refuses a source whose survey has problems before it writes anything; `clover convert --check` reports them all.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clover_jax.config import ModelConfig
from clover_jax.convert import clover, hf_io, llada2_moe, llada_moe, mapping, published, qwen3_5_moe, qwen3_moe
from clover_jax.convert.tensor_check import FLOAT_DTYPES, Differences, tensor_problems
from clover_jax.errors import ConversionError
from clover_jax.model import quant

# The HF families by name (a native config's `family`, or what `--family` names).
FAMILIES = {m.NAME: m for m in (clover, llada2_moe, llada_moe, qwen3_moe, qwen3_5_moe)}


def read_hf_config(src: str) -> dict[str, Any]:
    """config.json of the HF directory `src`; ConversionError when it is missing, not JSON or not an object."""
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{src} has no config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return hf


def family_of(hf: dict[str, Any], family: str | None) -> Any:
    """The family module named by `family`, else the first whose `detect` knows `hf`; ConversionError otherwise."""
    if family:
        if family not in FAMILIES:
            raise ConversionError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
        return FAMILIES[family]
    for mod in FAMILIES.values():
        if mod.detect(hf):
            return mod
    raise ConversionError(
        f"cannot tell the family from config.json (model_type {hf.get('model_type')!r}, architectures "
        f"{hf.get('architectures')}); known families: {', '.join(FAMILIES)} (or pass --family)")


def quantized_source(hf: dict[str, Any], src: str, scheme: str | None = None) -> str | None:
    """Why a HF checkpoint with a `quantization_config` cannot be imported (None when it has none): its tensors
    (fp8, int4 packs, scales) are not the float weights a conversion reads. Said before the files are opened,
    since their dtypes may be ones safetensors' numpy side cannot name."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    return (f"{src} is a quantized HuggingFace checkpoint (quantization_config, quant_method {method!r}); import "
            "its float (bfloat16) release instead" + (f" and quantize that with --quantize {scheme}" if scheme else ""))


@dataclass(frozen=True)
class Survey:
    """A source as its config.json and headers describe it.

    family: the family module. parts: the keys by `published.PARTS` part. cfg: the text model's native config, float,
    in the embedding's dtype (when the embedding cannot tell: the commonest float dtype of the text tensors).
    variants / tensor_fields: the keywords of `family.groups` and the config fields read from the tensors. groups:
    the text model's key map. text: how its tensors differ from `groups` (any difference is a problem); dtypes: the
    source dtypes by key pattern, for an exact export. carried: how the vision / MTP tensors differ from what the
    config describes (warnings: they are carried as they are). problems: what else makes the conversion fail, in
    the order found (`failure` is the first of all).
    """

    src: str
    hf: dict[str, Any]
    pub: published.Published
    family: Any
    tensors: Mapping[str, hf_io.TensorInfo]
    parts: dict[str, list[str]]
    tensor_fields: dict[str, Any]
    variants: dict[str, Any]
    cfg: ModelConfig
    groups: list[mapping.Group]
    text: Differences
    dtypes: dict[str, str]
    carried: dict[str, Differences]
    problems: tuple[str, ...]

    def part(self, name: str) -> dict[str, hf_io.TensorInfo]:
        """The tensors of one part, by key."""
        return {k: self.tensors[k] for k in self.parts[name]}

    def failure(self, brief: bool = False) -> str | None:
        """Why the conversion would fail, one line (None: it would not): the first problem, else the text tensors'
        differences, listed (`brief`: counted)."""
        if self.problems:
            return self.problems[0]
        if not self.text:
            return None
        said = f"{self.text.counts()} (listed above)" if brief else "; ".join(self.text.lines())
        return (f"the tensors in {self.src} do not match a {self.cfg.family} model as its config.json describes "
                f"it: {said}")

    @property
    def carried_keys(self) -> list[str]:
        """The vision and MTP keys, which a conversion carries (unless text-only)."""
        return self.parts[published.VISION] + self.parts[published.MTP]


def survey(src: str, hf: dict[str, Any], tensors: Mapping[str, hf_io.TensorInfo], family: str | None = None,
           mask_token_id: int | None = None, scheme: str | None = None) -> Survey:
    """The `Survey` of the HF directory `src` with config.json `hf` and tensors `tensors` (key -> TensorInfo, from
    the headers). ConversionError for what leaves nothing to survey (an unknown family, a config.json that describes
    no model); everything else is a problem in the result. `scheme`: the conversion's --quantize, for its words."""
    mod = family_of(hf, family)
    pub = published.read(hf)
    problems = [p for p in [quantized_source(hf, src, scheme)] if p]
    parts = published.split(tensors)
    text = {k: tensors[k] for k in parts[published.TEXT]}
    name = os.path.basename(os.path.normpath(src))
    # Families whose config also depends on the tensors (clover: the block-diffusion tensors' shapes).
    extra = mod.tensor_fields(pub.text, text) if hasattr(mod, "tensor_fields") else {}
    variants = mod.source_variants(text)
    probe = mod.config_from_hf(pub.text, name, "float32", mask_token_id).replace(**extra)
    embed_key = next(g.hf[0] for g in mod.groups(probe, **variants) if g.native == (("embed", None),))
    dtype = text[embed_key].dtype if embed_key in text else None
    if dtype is None:
        problems.append(f"the tensors in {src} lack the embedding {embed_key!r} (is this really a {mod.NAME} "
                        "checkpoint?)")
    elif dtype not in FLOAT_DTYPES:
        problems.append(f"the embedding {embed_key} has dtype {dtype}; expected a float type")
    if dtype not in FLOAT_DTYPES:  # judge the rest in the commonest float dtype
        floats = [t.dtype for t in text.values() if t.dtype in FLOAT_DTYPES]
        dtype = collections.Counter(floats).most_common(1)[0][0] if floats else "bfloat16"
    cfg = mod.config_from_hf(pub.text, name, dtype, mask_token_id).replace(**extra)
    if cfg.quantization != quant.NONE:  # a clover config.json naming the native field
        problems.append(f"{src}/config.json says quantization {cfg.quantization!r}, but a HuggingFace checkpoint "
                        "holds float weights; remove the field (or set it to \"none\")")
        cfg = cfg.replace(quantization=quant.NONE)
    groups = mod.groups(cfg, **variants)
    diff, dtypes = tensor_problems(cfg, groups, text)
    carried: dict[str, Differences] = {}
    keys = parts[published.VISION] + parts[published.MTP]
    if keys:
        want = published.expected(pub, cfg, keys)
        for p in (published.VISION, published.MTP):
            if want[p] or p == published.MTP:  # vision only where the config describes a tower
                d = published.differences(want[p], {k: tensors[k] for k in parts[p]})
                carried[p] = Differences(tuple(d["missing"]), tuple(d["unexpected"]), tuple(d["shape"]))
    return Survey(src, hf, pub, mod, tensors, parts, extra, variants, cfg, groups, diff, dtypes, carried,
                  tuple(problems))
