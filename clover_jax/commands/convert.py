"""`clover convert SRC DST`: native <-> HuggingFace safetensors, streaming, atomic."""

from __future__ import annotations

import argparse
import re


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB)")
    return int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert a checkpoint: HuggingFace safetensors -> native Orbax, or native -> HuggingFace",
        description="The direction follows SRC: a native checkpoint (config.json + weights/) is exported to "
                    "HuggingFace safetensors, anything else is imported as a HuggingFace checkpoint of the layout "
                    "named by its config.json (clover, llada2_moe, llada_moe, qwen3_moe).")
    p.add_argument("src", metavar="SRC", help="source checkpoint directory")
    p.add_argument("dst", metavar="DST", help="destination directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing destination (atomically)")
    p.add_argument("--layout", default=None, help="HF layout, when config.json does not say (import) or to export "
                   "a native model in another family's layout")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="mask token id for layouts whose config has none (qwen3_moe: default the last id)")
    p.add_argument("--max-shard-size", type=_size, default="2GB", help="largest safetensors file on export (2GB)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept PyTorch .bin pickles (loaded with torch.load(weights_only=True))")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from clover_jax.checkpoint import CheckpointError
    from clover_jax.cli import UserError
    from clover_jax.config import ConfigError
    from clover_jax.convert import ConversionError, convert

    try:
        out = convert(args.src, args.dst, force=args.force, layout=args.layout, mask_token_id=args.mask_token_id,
                      allow_pickle=args.allow_pickle, max_shard_bytes=args.max_shard_size,
                      progress=not args.no_progress)
    except (ConversionError, CheckpointError, ConfigError) as e:
        raise UserError(str(e)) from e
    print(out)
    return 0
