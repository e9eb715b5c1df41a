"""The flags that bound a command's activation memory at long prompts: `--attention` and `--attention-chunk` (how
attention layers compute: ModelConfig's `attention_impl` and `attention_chunk`, `model.layers.attend`) and
`--prefill-chunk` (how many prompt columns one prefill pass writes: ModelConfig's `prefill_chunk`,
`sampler.step.prefill`)."""

from __future__ import annotations

import argparse

from clover_jax.config import ATTENTION_IMPLS, ModelConfig


def _columns(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number of columns, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """Add --attention, --attention-chunk and --prefill-chunk (each defaults to the model's own setting) to `p`."""
    p.add_argument("--attention", choices=ATTENTION_IMPLS, default=None,
                   help="how attention layers compute: 'dense' (a window's whole score matrix at once), 'chunked' "
                        "(query and key chunks with an online softmax: memory flat in the prompt's length), "
                        "'splash' (a causal-prefix model's prefill through TPU's splash-attention kernel; off TPU in "
                        "Pallas' interpret mode, slow) or 'auto' (splash for that prefill on a TPU, chunked for a "
                        "long prompt's other windows, dense for block passes); default: the model's (auto)")
    p.add_argument("--attention-chunk", type=_columns(1), default=None,
                   help="columns per query / key chunk of chunked attention (default: the model's, 1024)")
    p.add_argument("--prefill-chunk", type=_columns(0), default=None,
                   help="write prompts into the cache in passes of this many tokens over all rows (a batch of B "
                        "shares it: N / B columns, at least 64), so a prefill's memory grows with neither the prompt "
                        "nor the batch (exact; 0: the whole prompt in one pass; default: the model's, 4096)")


FLAG_FIELDS = (("attention", "attention_impl"), ("attention_chunk", "attention_chunk"),
               ("prefill_chunk", "prefill_chunk"))  # flag dest -> ModelConfig field


def with_memory_flags(cfg: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """`cfg` with the flags of `args` applied (unchanged where they were not given)."""
    changes = {f: getattr(args, dest) for dest, f in FLAG_FIELDS if getattr(args, dest, None) is not None}
    return cfg.replace(**changes) if changes else cfg
