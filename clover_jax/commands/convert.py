"""`clover convert SRC DST`: native <-> HuggingFace safetensors, streaming, atomic; `--quantize int8|fp8` writes
a quantized native checkpoint (from HF or from a native float one), `--dequantize` exports a quantized one;
`clover convert --check SRC` reports what importing SRC would find, from headers alone (`convert.check`)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from clover_jax.convert import FAMILIES, convert, is_native
from clover_jax.convert.check import check
from clover_jax.model.quant import QTYPES

QUANTIZE = tuple(QTYPES)  # int8, fp8


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB)")
    return int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)])


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `convert` subcommand (SRC, DST and its flags) to `sub`; it dispatches to `run`."""
    p = sub.add_parser(
        "convert", help="convert a checkpoint: HuggingFace safetensors -> native Orbax, or native -> HuggingFace",
        description="The direction follows SRC: a native checkpoint (config.json + weights/) is exported to "
                    "HuggingFace safetensors, anything else is imported as a HuggingFace checkpoint of the family "
                    f"named by its config.json ({', '.join(FAMILIES)}). With --quantize the destination is a "
                    "native checkpoint whose matmul weights are quantized per output channel, from a HuggingFace "
                    "SRC or a native float one, a tensor at a time.")
    p.add_argument("src", metavar="SRC", help="source checkpoint directory")
    p.add_argument("dst", metavar="DST", nargs="?",
                   help="destination directory (must not exist unless --force); none with --check")
    p.add_argument("--check", action="store_true",
                   help="check the HuggingFace SRC before converting it, from config.json and the safetensors "
                        "headers alone (seconds): family, model, tensors missing / unexpected / of the wrong shape "
                        "or dtype, parameters and bytes by part, the native size (with --quantize too); exit 0 when "
                        "the conversion would succeed, 2 when it would fail")
    p.add_argument("--force", action="store_true", help="replace an existing destination (atomically)")
    p.add_argument("--family", "--layout", dest="family", default=None, choices=sorted(FAMILIES),
                   help="HF family, when config.json does not say (import), or to export a native model as another "
                        "family names its tensors (--layout: the old spelling)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="mask token id for families whose config has none (qwen3_moe: default the last id)")
    p.add_argument("--max-shard-size", type=_size, default=None,
                   help="largest safetensors file on export (default: the shards of the checkpoint it was imported "
                        "from, when its tensors are unchanged; else 2GB)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept PyTorch .bin pickles (loaded with torch.load(weights_only=True))")
    p.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="write a native checkpoint with int8 or fp8 (e4m3) matmul weights, one scale per output "
                        "channel (SRC: HuggingFace, or a native float checkpoint); config.json records it")
    p.add_argument("--dequantize", action="store_true",
                   help="export a quantized native checkpoint to HuggingFace as float weights (qvalue * scale in "
                        "the model's dtype, e.g. bfloat16); without it such an export is refused")
    p.add_argument("--text-only", action="store_true",
                   help="leave out the vision tower (model.visual.*) and the multi-token-prediction layers (mtp.*) "
                        "of a published checkpoint; the native checkpoint, and any export of it, is then the text "
                        "model alone (without it they are carried untouched and exported back)")
    p.add_argument("--restart", action="store_true",
                   help="start an import over instead of resuming a killed run of it (by default a rerun of the same "
                        "import continues where the killed one stopped)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    def dispatch(args: argparse.Namespace) -> int:  # DST: required, except with --check which takes none
        if args.check == (args.dst is not None):
            p.error("--check takes SRC alone (no DST)" if args.check
                    else "the following arguments are required: DST (or pass --check)")
        return run(args)

    p.set_defaults(func=dispatch)


def few_malloc_arenas(n: int = 2) -> None:
    """Cap glibc's malloc arenas for this process (no-op elsewhere). A conversion's chunks are made on one thread
    and freed on tensorstore's, and with glibc's default of 8 arenas per core the freed chunks stay mapped in the
    other arenas: measured, a 1 GB import peaked about 1.7x higher than with 1 arena, and ran slower."""
    import contextlib
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name and "libc" in name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).mallopt(-8, n)  # M_ARENA_MAX


def run(args: argparse.Namespace) -> int:
    """Convert SRC into DST and print DST's path; with --check print SRC's `check` report instead and return its
    exit code."""
    if args.check:
        report = check(args.src, family=args.family, mask_token_id=args.mask_token_id, quantize=args.quantize,
                       text_only=args.text_only)
        print(report.render())
        return report.exit_code
    few_malloc_arenas()
    out = convert(args.src, args.dst, force=args.force, family=args.family, mask_token_id=args.mask_token_id,
                  allow_pickle=args.allow_pickle, max_shard_bytes=args.max_shard_size, progress=not args.no_progress,
                  quantize=args.quantize, dequantize=args.dequantize, text_only=args.text_only,
                  resume=not args.restart)
    print(out)
    print(next_step(out), file=sys.stderr)
    return 0


def next_step(out: str) -> str:
    """One line for after a conversion: what the result at `out` carries for generation and the command that runs
    it (a native checkpoint), or how transformers loads it (an export). stdout keeps the bare path for scripts."""
    if not is_native(out):
        return f"clover convert: a HuggingFace checkpoint: AutoModelForCausalLM.from_pretrained({out!r}) loads it"
    has = [n for n in ("tokenizer.json", "tokenizer.model", "chat_template.jinja")
           if os.path.isfile(os.path.join(out, n))]
    carries = f"it carries {', '.join(has)}" if has else \
        "it carries no tokenizer: generation reads bytes (copy the model's tokenizer.json beside config.json)"
    return f"clover convert: {carries}; run it: clover generate --model {shlex.quote(out)} \"Hello\""
