"""`clover convert SRC DST`: native <-> HuggingFace safetensors, streaming, atomic; `--quantize int8|fp8` writes
a quantized native checkpoint (from HF or from a native float one), `--dequantize` exports a quantized one."""

from __future__ import annotations

import argparse
import re

from clover_jax.convert import FAMILIES, convert
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
    p.add_argument("dst", metavar="DST", help="destination directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing destination (atomically)")
    p.add_argument("--family", "--layout", dest="family", default=None, choices=sorted(FAMILIES),
                   help="HF family, when config.json does not say (import), or to export a native model as another "
                        "family names its tensors (--layout: the old spelling)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="mask token id for families whose config has none (qwen3_moe: default the last id)")
    p.add_argument("--max-shard-size", type=_size, default="2GB", help="largest safetensors file on export (2GB)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept PyTorch .bin pickles (loaded with torch.load(weights_only=True))")
    p.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="write a native checkpoint with int8 or fp8 (e4m3) matmul weights, one scale per output "
                        "channel (SRC: HuggingFace, or a native float checkpoint); config.json records it")
    p.add_argument("--dequantize", action="store_true",
                   help="export a quantized native checkpoint to HuggingFace as float weights (qvalue * scale in "
                        "the model's dtype, e.g. bfloat16); without it such an export is refused")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Convert SRC into DST and print DST's path."""
    out = convert(args.src, args.dst, force=args.force, family=args.family, mask_token_id=args.mask_token_id,
                  allow_pickle=args.allow_pickle, max_shard_bytes=args.max_shard_size, progress=not args.no_progress,
                  quantize=args.quantize, dequantize=args.dequantize)
    print(out)
    return 0
