"""The files besides config.json and the shards that make a HuggingFace export usable by HF tools.

`write_hf_extras(tmp, src, cfg, hf_cfg)` runs inside the export's temporary directory `tmp`, after the
tokenizer files of the native checkpoint `src` were copied there, and writes (into `tmp` only):

  tokenizer_config.json, special_tokens_map.json
      Only when `src` has a tokenizer (`tokenizer.model` or `tokenizer.json`) and the copy brought no
      tokenizer_config.json (one from an HF import is kept as it is, and then no map is added either: it
      could contradict it). They name the mask, pad and eos tokens of `cfg` by the tokenizer's own
      strings for those ids; an id that `cfg` leaves None, or that the tokenizer does not have, is left
      out, never made up. A SentencePiece model's own bos and unk pieces are named too. The tokenizer
      class is `PreTrainedTokenizerFast`: transformers 5 builds it from `tokenizer.model` alone (from
      the SentencePiece proto, BPE or unigram; needs `sentencepiece` and `protobuf`), and with no BOS or
      EOS added it encodes text to the ids `clover_jax.tokenizer` gives. One difference is HF's own: text
      that spells a special token (e.g. "[MASK]") is read as that token, where SentencePiece reads its
      characters. transformers 4 cannot load a `tokenizer.model` this way (it needs a tokenizer.json).
      transformers 5 ignores the class for a `qwen3_5_moe_text` config (its MODELS_WITH_INCORRECT_HUB_
      TOKENIZER_CLASS) and AutoTokenizer builds its byte-level Qwen3_5Tokenizer, which cannot hold a
      SentencePiece model: such an export's tokenizer loads with `PreTrainedTokenizerFast.from_pretrained`
      (the generated card says so). A Qwen tokenizer.json from an HF import is not affected.
  generation_config.json
      In `transformers.GenerationConfig`'s format: the native file's keys (SamplerConfig names) with
      `gen_length` spelled `max_new_tokens`, every other key (the diffusion knobs: block_length, steps,
      remasking, ...) kept under its own name, `do_sample` from the temperature when it is not given,
      and eos_token_id / pad_token_id / mask_token_id from `cfg` unless the file has them (None ones
      left out). The tokenizer copy already put the native file there (it is one of TOKENIZER_FILES);
      it is rewritten only when this changes something, so an HF-format file comes back byte for byte.
      `clover generate` reads the result back (`sampler.settings.read_defaults` maps max_new_tokens).
  README.md
      The model card: `src/MODEL_CARD.md` with an HF front-matter header put before it when it has
      none, or else a short card generated from `cfg`. An existing README.md is kept.

Returns the names of the files it wrote; ConversionError for a generation_config.json that is not a
JSON object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import sentencepiece as spm

from clover_jax.config import ModelConfig
from clover_jax.errors import ConversionError
from clover_jax.jsonfile import read_object
from clover_jax.model.params import count_params
from clover_jax.sampler.settings import HF_NAMES
from clover_jax.version import __version__

TOKENIZER_CLASS = "PreTrainedTokenizerFast"
MODEL_CARD = "MODEL_CARD.md"
README = "README.md"
GENERATION_CONFIG = "generation_config.json"
# model_type values transformers itself implements (AutoModelForCausalLM loads them without remote code).
TRANSFORMERS_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
# model_type values whose AutoTokenizer class transformers 5 fixes, whatever tokenizer_config.json says.
SENTENCEPIECE_UNSUPPORTED = ("qwen3_5_moe", "qwen3_5_moe_text")
_HF_NAMES = {v: k for k, v in HF_NAMES.items()}  # SamplerConfig name -> GenerationConfig name


def write_hf_extras(tmp: str, src: str, cfg: ModelConfig, hf_cfg: dict[str, Any], verbatim: bool = False) -> list[str]:
    """Write the tokenizer config, generation_config.json and README.md of the export in `tmp` from the
    native checkpoint `src` (see the module docstring); returns the names written. `verbatim`: an export that
    gives back a downloaded checkpoint's own files: a generation_config.json the copy brought is kept as it is,
    and no README.md is added."""
    written = _tokenizer_files(tmp, src, cfg)
    if not (verbatim and os.path.isfile(os.path.join(tmp, GENERATION_CONFIG))) and _generation_config(tmp, src, cfg):
        written.append(GENERATION_CONFIG)
    if not verbatim and _readme(tmp, src, cfg, hf_cfg):
        written.append(README)
    return written


def _write(tmp: str, name: str, text: str) -> None:
    with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
        f.write(text)


def _json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---- tokenizer -------------------------------------------------------------------------------------


def _token_strings(src: str) -> tuple[Callable[[int], str | None], dict[str, str]] | None:
    """(id -> the tokenizer's string for it, or None; the model's own bos/unk strings) of the tokenizer in
    `src`, or None when it has none. tokenizer.model first, as `clover_jax.tokenizer.load_tokenizer` does."""
    model = os.path.join(src, "tokenizer.model")
    if os.path.isfile(model):
        sp = spm.SentencePieceProcessor(model_file=model)
        size = sp.get_piece_size()
        own = {name: sp.id_to_piece(i) for name, i in (("bos_token", sp.bos_id()), ("unk_token", sp.unk_id()))
               if 0 <= i < size}
        return (lambda i: sp.id_to_piece(i) if 0 <= i < size else None), own
    path = os.path.join(src, "tokenizer.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        vocab = (doc.get("model") or {}).get("vocab") or {}
        by_id: dict[int, str] = {}
        if isinstance(vocab, dict):  # BPE / WordPiece / WordLevel: {token: id}
            by_id.update({int(i): t for t, i in vocab.items()})
        else:  # Unigram: [[token, score], ...] in id order
            by_id.update({i: entry[0] for i, entry in enumerate(vocab)})
        by_id.update({int(t["id"]): t["content"] for t in doc.get("added_tokens") or []})
        return by_id.get, {}
    return None


def _tokenizer_files(tmp: str, src: str, cfg: ModelConfig) -> list[str]:
    if os.path.exists(os.path.join(tmp, "tokenizer_config.json")):
        return []  # the source's own (an HF import's), kept as it is
    found = _token_strings(src)
    if found is None:
        return []
    string_of, own = found
    special = dict(own)
    for name, i in (("eos_token", cfg.eos_token_id), ("pad_token", cfg.pad_token_id),
                    ("mask_token", cfg.mask_token_id)):
        s = string_of(i) if i is not None else None
        if s is not None:
            special[name] = s
    config = {"tokenizer_class": TOKENIZER_CLASS, **special, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_seq_len}
    _write(tmp, "tokenizer_config.json", _json(config))
    written = ["tokenizer_config.json"]
    if not os.path.exists(os.path.join(tmp, "special_tokens_map.json")):
        _write(tmp, "special_tokens_map.json", _json(special))
        written.append("special_tokens_map.json")
    return written


# ---- generation_config.json ------------------------------------------------------------------------


def _generation_config(tmp: str, src: str, cfg: ModelConfig) -> bool:
    """Write tmp/generation_config.json in HF's format; False when the copied file already was it."""
    path = os.path.join(src, GENERATION_CONFIG)
    native: dict[str, Any] = {}
    if os.path.isfile(path):
        native = read_object(path, ConversionError)
    doc = {_HF_NAMES.get(k, k): v for k, v in native.items()}  # later keys win, as settings.read_defaults reads
    for key, value in (("eos_token_id", cfg.eos_token_id), ("pad_token_id", cfg.pad_token_id),
                       ("mask_token_id", cfg.mask_token_id)):
        if value is not None:
            doc.setdefault(key, value)
    temperature = doc.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        doc.setdefault("do_sample", temperature > 0)
    if doc == native and os.path.isfile(os.path.join(tmp, GENERATION_CONFIG)):
        return False
    _write(tmp, GENERATION_CONFIG, _json(doc))
    return True


# ---- README.md -------------------------------------------------------------------------------------


def _front_matter(hf_cfg: dict[str, Any], cfg: ModelConfig) -> str:
    model_type = str(hf_cfg.get("model_type") or cfg.family)
    library = "transformers" if model_type in TRANSFORMERS_MODEL_TYPES else "clover-jax"
    tags = ", ".join(dict.fromkeys(["clover-jax", "masked-diffusion", "mixture-of-experts", model_type]))
    return f"---\nlibrary_name: {library}\ntags: [{tags}]\n---\n\n"


def _generated_card(src: str, cfg: ModelConfig, hf_cfg: dict[str, Any]) -> str:
    count = count_params(cfg)
    archs = ", ".join(hf_cfg.get("architectures") or []) or "-"
    attention = cfg.attention + (f", blocks of {cfg.block_size}" if cfg.attention == "block_causal" else "")
    shared = f", {cfg.n_shared_experts} shared (width {cfg.shared_mlp_dim})" if cfg.n_shared_experts else ""
    dense = f"; {cfg.n_dense_layers} dense layers first (width {cfg.dense_mlp_dim})" if cfg.n_dense_layers else ""
    mixers = ""
    if cfg.layer_types:
        n_linear = sum(t == "linear_attention" for t in cfg.layer_types)
        mixers = f"| sequence mixers | {n_linear} Gated DeltaNet, {len(cfg.layer_types) - n_linear} attention |\n"

    note = ""
    if hf_cfg.get("model_type") in SENTENCEPIECE_UNSUPPORTED and os.path.isfile(os.path.join(src, "tokenizer.model")):
        note = ("\nThe tokenizer is SentencePiece; transformers' AutoTokenizer builds its own byte-level tokenizer "
                "for this model_type, so load it with `transformers.PreTrainedTokenizerFast.from_pretrained`.\n")

    def tok(i: int | None) -> str:
        return "none" if i is None else str(i)

    return (
        f"# {cfg.name}\n\n"
        f"A masked-diffusion mixture-of-experts language model of the `{cfg.family}` family, exported from a "
        f"clover-jax native checkpoint by `clover convert` (clover-jax {__version__}).\n\n"
        "| | |\n|---|---|\n"
        f"| architecture | {archs} (model_type `{hf_cfg.get('model_type', cfg.family)}`) |\n"
        f"| parameters | {count.total:,} total, {count.active:,} active per token |\n"
        f"| layers / d_model / heads | {cfg.n_layers} / {cfg.d_model} / {cfg.n_heads} q, {cfg.n_kv_heads} kv "
        f"x {cfg.head_dim} |\n"
        f"| experts | {cfg.n_experts} routed (top-{cfg.n_experts_per_tok}, width {cfg.expert_mlp_dim}){shared}"
        f"{dense} |\n"
        f"| attention | {attention} |\n"
        f"{mixers}"
        f"| vocabulary | {cfg.vocab_size}; mask token id {cfg.mask_token_id}, eos {tok(cfg.eos_token_id)}, "
        f"pad {tok(cfg.pad_token_id)} |\n"
        f"| dtype | {cfg.dtype} |\n\n"
        f"Text is generated by masked diffusion: the answer starts as mask tokens (id {cfg.mask_token_id}) that "
        "the model fills in over a number of refinement steps, not left to right. `clover generate` samples it "
        "this way; generation_config.json holds the sampler's defaults.\n"
        f"{note}"
    )


def _readme(tmp: str, src: str, cfg: ModelConfig, hf_cfg: dict[str, Any]) -> bool:
    if os.path.exists(os.path.join(tmp, README)):
        return False
    card = os.path.join(src, MODEL_CARD)
    if os.path.isfile(card):
        with open(card, encoding="utf-8") as f:
            text = f.read()
        if not text.startswith("---\n"):
            text = _front_matter(hf_cfg, cfg) + text
    else:
        text = _front_matter(hf_cfg, cfg) + _generated_card(src, cfg, hf_cfg)
    _write(tmp, README, text)
    return True
