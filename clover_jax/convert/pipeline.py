"""Streaming conversion between native checkpoints and HuggingFace safetensors directories.

`convert(src, dst)` picks the direction from `src`: a native checkpoint (config.json with a
`family` and a `weights/` directory) is exported to HF, anything else is read as HF. Every check
(family, config, key set, shapes, dtypes, file integrity) runs before the first byte is written;
the destination appears only when complete (temp directory renamed into place).

Memory: tensors are read and written one key-map group at a time (one projection of one layer's
experts at most), never the whole model.

Quantization (`quantize`): `quantize="int8" | "fp8"` makes the destination a quantized native checkpoint,
from a HF source (`hf_to_native`) or from a native float one (`quantize_native`), each matmul weight quantized
a chunk at a time as it streams through; its config.json records the scheme. A quantized native checkpoint
exports to HF only with `dequantize=True`, as float weights in its config's dtype (HF checkpoints hold float
weights). Quantizing a quantized checkpoint is refused before anything is written.

Published checkpoints (`published`): a config.json that wraps the text model's in `text_config` converts
as that text model. Their vision (`model.visual.*`) and MTP (`mtp.*`) tensors are carried untouched in
the native checkpoint's `extras/` (safetensors; never loaded for generation), the source's other small
files in `hf_files/`, and its config.json text and safetensors headers in `hf_layout.json`, so that an
export of an unchanged checkpoint writes the same files byte for byte. `text_only=True` leaves vision and
MTP out (on import or on export); the export is then the text model alone.

Families: one module each (clover, llada2_moe, llada_moe, qwen3_moe, qwen3_5_moe) with `detect`,
`config_from_hf`, `config_to_hf` and `groups` (the HF keys of each weight, `mapping`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from clover_jax import checkpoint
from clover_jax.checkpoint import LazyLeaf, WeightReader
from clover_jax.checkpoint.format import summary
from clover_jax.convert import hf_io, mapping, published, survey, tensor_check
from clover_jax.convert.hf_extras import write_hf_extras
from clover_jax.convert.quantize import DequantizedReader, check_scheme, quantized_leaves, stream_chunk
from clover_jax.convert.survey import FAMILIES
from clover_jax.errors import ConversionError
from clover_jax.model import quant
from clover_jax.progress import progress_bar
from clover_jax.tokenizer import TOKENIZER_FILES, load_tokenizer

SOURCE_FILE = "hf_source.json"  # native side: the HF config and dtypes an import came from
LAYOUT_FILE = "hf_layout.json"  # native side: the source's config.json text and safetensors headers
EXTRAS_DIR = "extras"  # native side: the vision and MTP tensors of a published checkpoint, as safetensors
HF_FILES_DIR = "hf_files"  # native side: the source's other small files (preprocessor configs, vocab, ...)
SIDE_FILE_MAX_BYTES = 64 * 1024**2
# Files of a HF directory that are the weights or their config (never carried as side files).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
VISION_ONLY_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
DEFAULT_SHARD_BYTES = 2 * 1024**3

def is_native(path: str) -> bool:
    """Whether `path` is a native checkpoint (config.json with a `family`, and weights/)."""
    cfg = os.path.join(path, checkpoint.CONFIG_FILE)
    if not (os.path.isdir(os.path.join(path, checkpoint.WEIGHTS_DIR)) and os.path.isfile(cfg)):
        return False
    try:
        with open(cfg) as f:
            return "family" in json.load(f)
    except (OSError, json.JSONDecodeError):
        return False


def convert(src: str, dst: str, quantize: str | None = None, dequantize: bool = False, **kw: Any) -> str:
    """Convert `src` into `dst`; returns `dst`'s path. A native `src` is exported to HF (a quantized one only
    with `dequantize`), or with `quantize` written as a quantized native checkpoint; anything else is
    imported from HF (quantized with `quantize`: "int8" or "fp8").

    Keyword arguments are those of `native_to_hf` / `hf_to_native`; the other direction's are ignored.
    """
    scheme = _quantize_scheme(quantize, dequantize)
    if not os.path.isdir(src):
        raise ConversionError(f"source {src!r} is not a directory")
    checkpoint.check_destination(dst, bool(kw.get("force")), sources=(src,))
    if is_native(src):
        if scheme:
            return quantize_native(src, dst, scheme, force=bool(kw.get("force")), progress=kw.get("progress", True))
        kw.pop("allow_pickle", None)
        kw.pop("mask_token_id", None)
        kw.pop("resume", None)
        return native_to_hf(src, dst, dequantize=dequantize, **kw)
    kw.pop("max_shard_bytes", None)
    return hf_to_native(src, dst, quantize=scheme, **kw)


def _quantize_scheme(quantize: str | None, dequantize: bool) -> str | None:
    scheme = check_scheme(quantize)
    if scheme and dequantize:
        raise ConversionError("--quantize and --dequantize contradict each other: pass one of them")
    return scheme


def _progress(total: int, desc: str, enabled: bool) -> Any:
    return progress_bar(total, desc, "clover convert", enabled=enabled, mininterval=0.5)


class _Lazy(Sequence):
    """The tensors of one group, each read from disk when indexed (and not kept)."""

    def __init__(self, source: Any, keys: tuple[str, ...]) -> None:
        self.source, self.keys = source, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: Any) -> Any:
        return self.source.get(self.keys[i])

    def rows(self, i: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor `i`, read from disk alone."""
        return self.source.get_rows(self.keys[i], start, stop)


ROW_BLOCK_BYTES = 64 * 1024**2


def _rows_per_block(shape: tuple[int, ...], dtype: Any) -> int:
    row = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
    return max(1, min(shape[0], ROW_BLOCK_BYTES // max(row, 1)))


def _count_nonfinite(counts: dict[str, int], name: str, a: np.ndarray) -> None:
    if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16":
        n = int(a.size - np.count_nonzero(np.isfinite(a.astype(np.float32, copy=False))))
        if n:
            counts[name] = counts.get(name, 0) + n


def _rows_leaf(source: Any, key: str, spec: Any, transpose: bool, bar: Any, bad: dict[str, int]) -> LazyLeaf:
    """embed [V, D] (HF rows = native rows) or lm_head (HF [V, D] rows = native [D, V] columns)."""
    hf_shape = source.tensors[key].shape
    rows = _rows_per_block(hf_shape, spec.dtype)

    def read(idx: tuple[slice, ...]) -> np.ndarray:
        sl = idx[1] if transpose else idx[0]
        a = source.get_rows(key, sl.start, sl.stop).astype(spec.dtype, copy=False)
        _count_nonfinite(bad, key, a)
        bar.update(a.nbytes)
        return np.ascontiguousarray(a.T) if transpose else a

    chunk = (spec.shape[0], rows) if transpose else (rows, spec.shape[1])
    return LazyLeaf(spec.shape, np.dtype(spec.dtype), read, chunk)


def _side_file_names(src: str, text_only: bool) -> list[str]:
    """The small regular files of the HF directory `src` that are neither weights, their index, config.json
    nor tokenizer files (copied on their own): preprocessor configs, vocab files, a README, ... (the vision
    preprocessor configs left out when `text_only`)."""
    skip = {"config.json", hf_io.INDEX_FILE, hf_io.PICKLE_INDEX_FILE, *TOKENIZER_FILES}
    if text_only:
        skip.update(VISION_ONLY_FILES)
    return [n for n in sorted(os.listdir(src))
            if n not in skip and not n.startswith(".") and not n.endswith(WEIGHT_SUFFIXES)
            and os.path.isfile(os.path.join(src, n)) and os.path.getsize(os.path.join(src, n)) <= SIDE_FILE_MAX_BYTES]


def _copy_files(src: str, names: Sequence[str], dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for n in names:
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))


def _carried_parts(sv: survey.Survey, text_only: bool, dst: str) -> list[str]:
    """The vision and MTP keys to carry (none with `text_only`), after one line saying what happens to them
    and a warning when they differ from what config.json describes."""
    keys = sv.carried_keys
    if not keys:
        return []
    size = sum(sv.tensors[k].nbytes for k in keys)
    what = (f"{len(sv.parts[published.VISION])} vision and {len(sv.parts[published.MTP])} MTP tensors "
            f"({size / 1e9:.2f} GB)")
    if text_only:
        print(f"clover convert: --text-only: leaving out {what}; an export of {dst} will be the text model alone",
              file=sys.stderr)
        return []
    print(f"clover convert: carrying {what} untouched in {EXTRAS_DIR}/ (never loaded for generation; an export "
          "writes them back; --text-only leaves them out)", file=sys.stderr)
    for part, diff in sv.carried.items():
        if diff:
            print(f"clover convert: warning: the {part} tensors differ from what config.json describes ("
                  + "; ".join(diff.lines(3, 3)) + "); carried as they are", file=sys.stderr)
    return keys


def _fingerprint(src: str, options: dict[str, Any]) -> str:
    """What identifies an import, for resuming it (`checkpoint.save_streaming`): the source directory's absolute
    path, each weight file's (and index's) name, size and mtime_ns, config.json's text and the `options`."""
    src = os.path.abspath(src)
    files = [(n, st.st_size, st.st_mtime_ns) for n in sorted(os.listdir(src))
             if n.endswith((*WEIGHT_SUFFIXES, ".index.json")) for st in [os.stat(os.path.join(src, n))]]
    with open(os.path.join(src, "config.json"), encoding="utf-8", errors="surrogateescape") as f:
        config = f.read()
    return json.dumps({"source": src, "files": files, "config": config, "options": options}, sort_keys=True)


def hf_to_native(src: str, dst: str, family: str | None = None, mask_token_id: int | None = None,
                 allow_pickle: bool = False, force: bool = False, progress: bool = True,
                 quantize: str | None = None, text_only: bool = False, resume: bool = True) -> str:
    """Import a HuggingFace checkpoint directory as a native one at `dst`; returns its path.

    family: the HF family when config.json does not tell. mask_token_id: for families whose config has
    none. allow_pickle: accept PyTorch .bin files (read with weights_only=True). quantize: "int8" or "fp8"
    to write the matmul weights quantized (`convert.quantize`), each as it streams through. A published
    multimodal checkpoint converts as its text model; its vision and MTP tensors are carried in `extras/`
    unless `text_only` (see the module docstring). A tensor that is neither the text model's, vision nor
    MTP is a ConversionError naming it, before anything is written. resume: a killed import of the same source
    with the same options continues where it stopped (`checkpoint.save_streaming`); False starts it over.
    """
    scheme = check_scheme(quantize)
    hf = survey.read_hf_config(src)
    refused = survey.quantized_source(hf, src, scheme)
    if refused:
        raise ConversionError(refused)
    survey.family_of(hf, family)  # an unknown family before the files are opened
    load_tokenizer(src)  # a tokenizer or chat template generation could not read, before anything is written
    source = hf_io.open_source(src, allow_pickle)
    try:
        sv = survey.survey(src, hf, source.tensors, family, mask_token_id, scheme)
        if sv.failure():
            raise ConversionError(sv.failure())
        mod, cfg, groups, variants, extra = sv.family, sv.cfg, sv.groups, sv.variants, sv.tensor_fields
        carried = _carried_parts(sv, text_only, dst)
        side = _side_file_names(src, text_only)

        specs = checkpoint.expected_leaves(cfg)
        slot_of: dict[mapping.Slot, tuple[mapping.Group, int]] = {}
        for g in groups:
            for pos, slot in enumerate(g.native):
                slot_of[slot] = (g, pos)
        missing = [f"{n}[{i}]" for n, s in specs.items()
                   for i in ([None] if "layers." not in n else range(s.shape[0])) if (n, i) not in slot_of]
        if missing:  # a family module bug, not bad input
            raise ConversionError(f"internal: family {mod.NAME} does not produce {summary(missing)}")

        carried_bytes = sum(source.tensors[k].nbytes for k in carried)
        bar = _progress(sum(s.size * np.dtype(s.dtype).itemsize for s in specs.values()) + carried_bytes, "import",
                        progress)
        bad: dict[str, int] = {}  # native weight -> NaN / Inf values seen while streaming it

        def lazy(name: str, spec: Any) -> LazyLeaf:
            stacked = "layers." in name
            if name in ("embed", "lm_head"):  # the largest tensors: in row blocks, never whole
                return _rows_leaf(source, slot_of[(name, None)][0].hf[0], spec, transpose=name == "lm_head", bar=bar,
                                  bad=bad)

            g0 = slot_of[(name, 0 if stacked else None)][0]
            chunk = None
            if stacked:  # one layer per chunk; routed experts in parts of about ROW_BLOCK_BYTES
                per_expert = int(np.prod(spec.shape[2:])) * np.dtype(spec.dtype).itemsize
                n_e = max(1, ROW_BLOCK_BYTES // per_expert) if g0.part else spec.shape[1]
                chunk = (1, min(n_e, spec.shape[1]), *spec.shape[2:])

            def read(idx: tuple[slice, ...]) -> np.ndarray:
                g, pos = slot_of[(name, idx[0].start if stacked else None)]
                if stacked and g.part and idx[1] != slice(0, spec.shape[1]):
                    out = g.part(_Lazy(source, g.hf), idx[1])[pos]
                else:
                    out = g.to_native(_Lazy(source, g.hf))[pos]
                out = np.asarray(out).astype(spec.dtype, copy=False)
                _count_nonfinite(bad, name, out)
                bar.update(out.nbytes)
                return out[None] if stacked else out

            return LazyLeaf(spec.shape, np.dtype(spec.dtype), read, chunk)

        leaves = {n: lazy(n, s) for n, s in specs.items()}
        if scheme:  # every chunk above holds whole contracted axes: one layer (or experts), lm_head's (D, rows)
            cfg, leaves = cfg.replace(quantization=scheme), quantized_leaves(specs, leaves, scheme)
        record = {"family": mod.NAME, "variants": variants, "dtypes": sv.dtypes, "config": hf, "tensor_fields": extra,
                  "text_only": text_only,
                  "parts": {p: len(sv.parts[p]) if carried else 0 for p in (published.VISION, published.MTP)}}
        files = {SOURCE_FILE: json.dumps(record, indent=1, sort_keys=True)}
        layout = None if text_only or not isinstance(source, hf_io.SafetensorsSource) else hf_io.read_layout(src)
        if layout is not None:
            with open(os.path.join(src, "config.json"), encoding="utf-8", newline="") as f:
                layout["config"] = f.read()
            files[LAYOUT_FILE] = json.dumps(layout, indent=1, sort_keys=True)
        dirs: dict[str, Callable[[str], Any]] = {}
        if carried:
            dirs[EXTRAS_DIR] = lambda d: hf_io.copy_tensors(source, carried, d, DEFAULT_SHARD_BYTES,
                                                           ROW_BLOCK_BYTES, bar.update)
        if side:
            dirs[HF_FILES_DIR] = lambda d: _copy_files(src, side, d)
        try:
            options = {"family": mod.NAME, "mask_token_id": mask_token_id, "quantize": scheme, "text_only": text_only}
            out = checkpoint.save_streaming(dst, cfg, leaves, tokenizer_dir=src, force=force, extra_files=files,
                                            extra_dirs=dirs, fingerprint=_fingerprint(src, options), resume=resume,
                                            on_skip=bar.update)
        finally:
            bar.close()
        _warn_nonfinite(bad, src)
        return out
    finally:
        source.close()


def _warn_nonfinite(bad: dict[str, int], src: str) -> None:
    if bad:
        print(f"clover convert: warning: {sum(bad.values())} NaN/Inf values in {len(bad)} weights ("
              + ", ".join(f"{k}: {v}" for k, v in sorted(bad.items())[:6]) + (", ..." if len(bad) > 6 else "")
              + f"); the checkpoint {src} itself holds them", file=sys.stderr)


def _side_files(src: str) -> dict[str, str]:
    """The text files next to config.json in a native checkpoint (hf_source.json, MODEL_CARD.md, ...), by name;
    config.json and the tokenizer files (copied on their own) left out."""
    out = {}
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name == checkpoint.CONFIG_FILE or name in TOKENIZER_FILES or name.startswith(".") \
                or not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8", newline="") as f:  # byte for byte, line ends included
                out[name] = f.read()
        except UnicodeDecodeError:
            print(f"clover convert: warning: {path} is not a text file; not copied", file=sys.stderr)
    return out


def quantize_native(src: str, dst: str, scheme: str, force: bool = False, progress: bool = True) -> str:
    """Write the native float checkpoint `src` as a native checkpoint at `dst` with its matmul weights
    quantized (`scheme`: "int8" or "fp8"), streaming a chunk at a time; returns `dst`'s path. Tokenizer files,
    hf_source.json and the other files next to config.json are copied; the other weights are copied exactly.
    ConversionError, before anything is written, when `src` is quantized already. The vision and MTP tensors
    and side files an import carried (`extras/`, `hf_files/`) are copied as they are."""
    scheme = check_scheme(scheme)
    if scheme is None:
        raise ConversionError(f"quantize_native needs a scheme; choose one of {', '.join(quant.QTYPES)}")
    reader = WeightReader(src)
    cfg = reader.config
    if cfg.quantization != quant.NONE:
        raise ConversionError(f"{src} is already quantized ({cfg.quantization}); quantize a float checkpoint "
                              f"instead (this one exports to float with --dequantize)")
    specs = checkpoint.expected_leaves(cfg)
    bar = _progress(sum(s.size * np.dtype(s.dtype).itemsize for s in specs.values()), "quantize", progress)
    bad: dict[str, int] = {}

    def lazy(name: str, spec: Any) -> LazyLeaf:
        def read(idx: tuple[slice, ...]) -> np.ndarray:
            a = reader.read(name, idx)
            _count_nonfinite(bad, name, a)
            bar.update(a.nbytes)
            return a

        chunk = stream_chunk(spec.shape, np.dtype(spec.dtype).itemsize, tuple(spec.contract), "layers." in name,
                             ROW_BLOCK_BYTES)
        return LazyLeaf(spec.shape, np.dtype(spec.dtype), read, chunk)

    leaves = quantized_leaves(specs, {n: lazy(n, s) for n, s in specs.items()}, scheme)
    dirs = {d: (lambda out, d=d: shutil.copytree(os.path.join(src, d), out, dirs_exist_ok=True))
            for d in (EXTRAS_DIR, HF_FILES_DIR) if os.path.isdir(os.path.join(src, d))}
    try:
        out = checkpoint.save_streaming(dst, cfg.replace(quantization=scheme), leaves, tokenizer_dir=src, force=force,
                                        extra_files=_side_files(src), extra_dirs=dirs)
    finally:
        bar.close()
    _warn_nonfinite(bad, src)
    return out


def _text_only_config(text: dict[str, Any], hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a text-only export: the source's text config updated by the family's, without
    the MTP layers (their tensors are not written)."""
    out = {**text, **hf_cfg}
    if isinstance(text.get("rope_parameters"), dict):  # the multimodal rotary sections stay (text ignores them)
        out["rope_parameters"] = {**text["rope_parameters"], **hf_cfg.get("rope_parameters", {})}
    for key in ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"):
        out.pop(key, None)
    return out


def native_to_hf(src: str, dst: str, family: str | None = None, max_shard_bytes: int | None = None,
                 force: bool = False, progress: bool = True, dequantize: bool = False, text_only: bool = False) -> str:
    """Export a native checkpoint as HuggingFace safetensors at `dst`; returns its path.

    family: write the tensors as another family names them (default: the checkpoint's own). The config
    and dtypes an import came from are restored exactly when the config is unchanged; so are the vision and
    MTP tensors of a published checkpoint (`extras/`) and its other files, and, when the tensors' keys, shapes
    and dtypes are those of the source, its very files (`hf_layout.json`: the same shards, byte for byte for
    unchanged weights), unless `max_shard_bytes` asks for other shards (default: the source's, else
    DEFAULT_SHARD_BYTES). `text_only`: leave vision and MTP out and write the text model alone. A quantized
    checkpoint is refused unless `dequantize`: then each weight is written as `qvalue * scale` in the config's
    dtype (`convert.quantize.DequantizedReader`), and the HF config is the float model's.
    """
    reader: Any = WeightReader(src)
    if reader.config.quantization != quant.NONE:
        if not dequantize:
            raise ConversionError(f"{src} holds {reader.config.quantization} weights; pass --dequantize to export "
                                  f"them as {reader.config.dtype} safetensors")
        reader = DequantizedReader(reader)
    cfg = reader.config
    record: dict[str, Any] = {}
    rec_path = os.path.join(src, SOURCE_FILE)
    if os.path.isfile(rec_path):
        with open(rec_path) as f:
            record = json.load(f)
    recorded = record.get("family", record.get("layout"))  # "layout": the record's key before 0.2
    name = family or recorded or cfg.family
    if name not in FAMILIES:
        raise ConversionError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    mod = FAMILIES[name]
    hf_cfg = mod.config_to_hf(cfg)  # refuses configs the family cannot express
    source_cfg = record.get("config") if recorded == name else None
    extras_dir = os.path.join(src, EXTRAS_DIR)
    text_only = text_only or bool(record.get("text_only"))
    carry = os.path.isdir(extras_dir) and not text_only and source_cfg is not None
    layout = (_read_json(os.path.join(src, LAYOUT_FILE))
              if source_cfg is not None and not text_only and max_shard_bytes is None else None)
    same = False
    pub = published.read(source_cfg) if source_cfg is not None else None
    if pub is not None:
        # Unchanged config: write the original back verbatim; else update it with the new values.
        same = mod.config_from_hf(pub.text, cfg.name, cfg.dtype, cfg.mask_token_id).replace(
            **record.get("tensor_fields", {})) == cfg
        if pub.wrapper is not None and not carry:
            hf_cfg = _text_only_config(pub.text, hf_cfg)
        elif pub.wrapper is not None:
            fields = {k: v for k, v in hf_cfg.items() if k not in ("model_type", "architectures")}
            hf_cfg = source_cfg if same else {**source_cfg, "text_config": {**source_cfg["text_config"], **fields}}
        else:
            hf_cfg = source_cfg if same else {**source_cfg, **hf_cfg}
    # The keys the import read (fused experts, a key prefix, ...); "fused_experts" alone: records before 0.2.
    variants = dict(record.get("variants", {"fused_experts": bool(record.get("fused_experts"))}))
    if pub is not None and pub.wrapper is not None and not carry and variants.get("prefix") == "model.language_model.":
        variants["prefix"] = "model."  # the text model alone, keyed as Qwen3_5MoeForCausalLM saves it
    groups = mod.groups(cfg, **(variants if source_cfg is not None else {}))
    dtypes = record.get("dtypes", {}) if source_cfg is not None else {}
    specs = checkpoint.expected_leaves(cfg)

    def out_dtype(key: str, slot: mapping.Slot) -> str:
        return dtypes.get(key) or dtypes.get(tensor_check.pattern(key)) or np.dtype(specs[slot[0]].dtype).name

    plan = [hf_io.PlannedTensor(k, tuple(s), out_dtype(k, g.native[0]))
            for g in groups for k, s in zip(g.hf, g.hf_shapes, strict=True)]
    extras = hf_io.open_source(extras_dir) if carry else None
    try:
        if extras is not None:
            plan += [hf_io.PlannedTensor(k, t.shape, t.dtype) for k, t in extras.tensors.items()]
        if layout is not None and (not same or hf_io.layout_tensors(layout) != {t.key: t for t in plan}):
            layout = None  # the tensors changed: shards planned anew
        bar = _progress(sum(t.nbytes for t in plan), "export", progress)
        try:
            with checkpoint.atomic_directory(dst, force) as tmp:
                if layout is not None:
                    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8", newline="") as f:
                        f.write(layout["config"])
                else:
                    with open(os.path.join(tmp, "config.json"), "w") as f:
                        json.dump(hf_cfg, f, indent=2, sort_keys=True)
                checkpoint.copy_tokenizer_files(src, tmp)
                side = os.path.join(src, HF_FILES_DIR)
                if os.path.isdir(side):
                    _copy_files(side, [n for n in sorted(os.listdir(side)) if carry or n not in VISION_ONLY_FILES],
                                tmp)
                write_hf_extras(tmp, src, cfg, hf_cfg, verbatim=layout is not None)
                writer: Any = (hf_io.LayoutWriter(tmp, layout) if layout is not None
                               else hf_io.ShardedWriter(tmp, plan, max_shard_bytes or DEFAULT_SHARD_BYTES))
                i = 0
                for g in groups:
                    if g.native[0][0] in ("embed", "lm_head"):  # the largest tensors: in row blocks
                        writer.write_rows(g.hf[0], _row_blocks(reader, g.native[0][0], plan[i], bar))
                        i += 1
                        continue
                    if g.part and len(g.hf) > len(g.native):  # per-expert keys: the experts a chunk at a time
                        outs = g.to_hf([_ExpertChunks(reader, *g.native[0])])
                    else:
                        outs = g.to_hf([reader.read(n, idx) for n, idx in g.native])
                    for key, a in zip(g.hf, outs, strict=True):
                        a = a.astype(hf_io.np_dtype(plan[i].dtype), copy=False)
                        writer.write(key, a)
                        bar.update(a.nbytes)
                        i += 1
                for t in plan[i:]:  # the carried vision and MTP tensors, as stored
                    writer.write_rows(t.key, _counted(hf_io.row_blocks(extras, t.key, ROW_BLOCK_BYTES), bar))
                writer.finish()
        finally:
            bar.close()
    finally:
        if extras is not None:
            extras.close()
    return os.path.abspath(dst)


def _counted(blocks: Any, bar: Any) -> Any:
    for a in blocks:
        bar.update(a.nbytes)
        yield a


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _row_blocks(reader: WeightReader, name: str, t: hf_io.PlannedTensor, bar: Any) -> Any:
    """HF rows of embed (native rows) or lm_head (native columns), a block at a time."""
    rows = _rows_per_block(t.shape, hf_io.np_dtype(t.dtype))
    for r in range(0, t.shape[0], rows):
        block = slice(r, min(t.shape[0], r + rows))
        if name == "lm_head":
            a = np.ascontiguousarray(reader.read(name, (slice(None), block)).T)
        else:
            a = reader.read(name, (block, slice(None)))
        a = a.astype(hf_io.np_dtype(t.dtype), copy=False)
        bar.update(a.nbytes)
        yield a


class _ExpertChunks:
    """experts[i] of one layer of a stacked expert weight, read one storage chunk of experts at a time."""

    def __init__(self, reader: WeightReader, name: str, layer: int) -> None:
        self.reader, self.name, self.layer = reader, name, layer
        self.n_experts = reader.leaves[name][0][1]
        self.step = max(1, reader.chunk_shape(name)[1])
        self.start, self.block = -1, np.empty(0)

    def __getitem__(self, i: int) -> np.ndarray:
        if not self.start <= i < self.start + len(self.block):
            self.start = i - i % self.step
            self.block = self.reader.read(self.name, (self.layer, slice(self.start, min(self.n_experts,
                                                                                       self.start + self.step))))
        return self.block[i - self.start]
