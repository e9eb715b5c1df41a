"""The `--attention` and `--attention-chunk` flags: how a command's attention layers compute (ModelConfig's
`attention_impl` and `attention_chunk`; `model.layers.attend`)."""

from __future__ import annotations

import argparse

from clover_jax.config import ATTENTION_IMPLS, ModelConfig


def _chunk(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of columns, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_attention_arguments(p: argparse.ArgumentParser) -> None:
    """Add --attention and --attention-chunk (both default to the model's own setting) to `p`."""
    p.add_argument("--attention", choices=ATTENTION_IMPLS, default=None,
                   help="how attention layers compute: 'dense' (a window's whole score matrix at once), 'chunked' "
                        "(query and key chunks with an online softmax: memory flat in the prompt's length) or "
                        "'auto' (chunked when both are longer than a chunk); default: the model's (auto)")
    p.add_argument("--attention-chunk", type=_chunk, default=None,
                   help="columns per query / key chunk of chunked attention (default: the model's, 1024)")


def with_attention(cfg: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """`cfg` with the attention flags of `args` applied (unchanged where they were not given)."""
    changes = {k: v for k, v in (("attention_impl", args.attention), ("attention_chunk", args.attention_chunk))
               if v is not None}
    return cfg.replace(**changes) if changes else cfg
