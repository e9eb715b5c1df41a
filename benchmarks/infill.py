"""Infill accuracy versus speed for each sampler mode on held-out text: a markdown table for the README.

Each example is a window of held-out text: its first --prompt tokens stay as context and the next
--span tokens are masked and filled by the sampler (greedy). For a block-causal model such as
clover-tiny a masked span can only use the text to its left (later blocks are invisible to earlier
ones), so a span of held-out text is exactly a continuation. Token accuracy is the fraction of
filled positions equal to the original token; forward passes (NFE) and tokens per pass measure the
cost.

    python benchmarks/infill.py --data ../shared/data/tinyshakespeare-train.txt --holdout 0.05
    (--checkpoint DIR for another model; default: the shipped clover-tiny)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

MODES = [
    # (label, SamplerConfig overrides); steps are over the whole span
    ("low_confidence, 1 token/step", dict(remasking="low_confidence", steps_per_token=1.0)),
    ("low_confidence, 2 tokens/step", dict(remasking="low_confidence", steps_per_token=0.5)),
    ("low_confidence, 4 tokens/step", dict(remasking="low_confidence", steps_per_token=0.25)),
    ("low_confidence, one pass a block", dict(remasking="low_confidence", steps_per_token=1 / 32)),
    ("margin, 1 token/step", dict(remasking="margin", steps_per_token=1.0)),
    ("entropy, 1 token/step", dict(remasking="entropy", steps_per_token=1.0)),
    ("random, 1 token/step", dict(remasking="random", steps_per_token=1.0)),
    ("threshold 0.9", dict(remasking="low_confidence", steps_per_token=1.0, threshold=0.9)),
    ("threshold 0.7", dict(remasking="low_confidence", steps_per_token=1.0, threshold=0.7)),
    ("threshold 0.5", dict(remasking="low_confidence", steps_per_token=1.0, threshold=0.5)),
    ("entropy bound 1.0", dict(remasking="low_confidence", steps_per_token=1.0, entropy_bound=1.0)),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="native checkpoint (default: the shipped clover-tiny)")
    p.add_argument("--data", default="../shared/data/tinyshakespeare-train.txt")
    p.add_argument("--holdout", type=float, default=0.05, help="the eval split: last fraction of the file")
    p.add_argument("--examples", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64, help="context tokens before each span")
    p.add_argument("--span", type=int, default=64, help="masked tokens to fill (a multiple of --block)")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--cache", default="prefix", choices=("none", "prefix", "dual"))
    p.add_argument("--modes", default=None, help="comma-separated indices into the mode list (default: all)")
    args = p.parse_args(argv)

    from clover_jax import shipped
    from clover_jax.checkpoint import load_model
    from clover_jax.sampler import SamplerConfig, generate
    from clover_jax.tokenizer import load_tokenizer
    from clover_jax.training import read_text, split_text

    ckpt = os.path.abspath(args.checkpoint or shipped.MODEL_DIR)  # orbax metadata reads want an absolute path
    cfg, weights = load_model(ckpt)
    tok = load_tokenizer(ckpt)
    _, held_out = split_text(read_text(args.data), args.holdout)
    ids = np.asarray(tok.encode(held_out), np.int32)
    win = args.prompt + args.span
    starts = np.linspace(0, len(ids) - win, args.examples).astype(int)
    prompts = [ids[s: s + args.prompt].tolist() for s in starts]
    truth = np.stack([ids[s + args.prompt: s + win] for s in starts])

    modes = MODES if args.modes is None else [MODES[int(i)] for i in args.modes.split(",")]
    rows = []
    for label, m in modes:
        m = dict(m)
        steps = max(1, round(args.span * m.pop("steps_per_token")))
        sc = SamplerConfig(gen_length=args.span, block_length=args.block, steps=steps, cache=args.cache, **m)
        t0 = time.perf_counter()
        res = generate(weights, cfg, prompts, sc)
        acc = float(np.mean(res.raw[:, : args.span] == truth))
        rows.append((label, steps, res.stats.nfe, res.stats.tokens_per_pass, acc, res.stats.wall_s))
        print(f"{label}: acc {acc:.3f} nfe {res.stats.nfe} ({time.perf_counter() - t0:.1f} s incl. compile)",
              file=sys.stderr, flush=True)

    print(f"\n{cfg.name}: {args.examples} held-out windows, {args.prompt} context tokens, {args.span} masked "
          f"tokens in blocks of {args.block}, cache `{args.cache}`, greedy\n")
    print("| mode | steps | forward passes | tokens / pass | token accuracy | time (s) |")
    print("|---|---|---|---|---|---|")
    for label, steps, nfe, tpp, acc, wall in rows:
        print(f"| {label} | {steps} | {nfe} | {tpp:.2f} | {acc:.3f} | {wall:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
