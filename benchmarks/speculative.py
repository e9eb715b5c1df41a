"""Self-speculative decoding on a trained causal-prefix model: forward passes per token against the causal model's
one a token, and the block diffusion's own greedy decoding.

    python benchmarks/speculative.py                                   # the shipped clover-tiny, held-out prompts
    python benchmarks/speculative.py --model DIR --steps-per-block 1 2 4 --threshold 0 0.5
    python benchmarks/speculative.py --model checkpoints/clover-tiny-tools --task tools --gen-length 64

Prompts are `--prompts` windows of `--prompt-tokens` tokens from the held-out tail (`--holdout`) of `--data` (the
text the shipped model was trained on, minus what it saw), or with `--task tools` every turn of the toy tool task's
held-out questions (`examples/toy_agent`, as `clover serve` renders them for clover-tiny-tools), each continued by
`--gen-length` tokens, greedily:
  * `causal`: the causal model decoding autoregressively with its cache, one token a pass (`SamplerConfig.causal`):
    the reference text (the property tests check it token for token against transformers' greedy `generate`);
  * `self-speculative` for each draft setting (`--steps-per-block` refinement passes per drafted block, and
    `--threshold`, which lets a draft pass commit every position it is that sure of): passes per token (the
    prompt's prefill counted, as one pass), tokens a second (warm, compile excluded), and whether the text is the
    same under every setting (it must be: the drafts change only the cost);
  * `diffusion`: the block diffusion's greedy decoding, one token a pass (its own text, not the causal one).
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a causal-prefix checkpoint (default: the shipped clover-tiny)")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "tinyshakespeare-train.txt"))
    p.add_argument("--holdout", type=float, default=0.05, help="the text's held-out tail the prompts come from")
    p.add_argument("--task", choices=("text", "tools"), default="text",
                   help="text: held-out windows of --data; tools: the toy tool task's held-out turns")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--steps-per-block", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--threshold", type=float, nargs="+", default=[0.0])
    return p.parse_args(argv)


def prompts_from(text: str, tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` windows of `length` tokens spread evenly over `text`."""
    ids = tokenizer.encode(text)
    stride = max((len(ids) - length) // n, 1)
    return [ids[i * stride:i * stride + length] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import clover_jax
    from clover_jax import shipped
    from clover_jax.tokenizer import load_tokenizer

    model = args.model or str(shipped.MODEL_DIR)
    cfg, weights = clover_jax.load_model(model)
    if not cfg.causal_prefix:
        print(f"speculative: {model} is not run with a causal prefix (bd_gdn {cfg.bd_gdn!r})", file=sys.stderr)
        return 2
    tok = load_tokenizer(model)
    if args.task == "tools":
        from clover_jax.serving.chat import plain_prompt
        from examples import toy_agent

        _, held_tasks = toy_agent.split(400, 20, 0)
        turns = [t for task in held_tasks for t in toy_agent.turns(task)][:args.prompts]
        prompts = [tok.encode(plain_prompt(t.messages, toy_agent.specs())) for t in turns]
        what = "held-out tool-task turns"
    else:
        text = Path(args.data).read_text(encoding="utf-8")
        held = text[int(len(text) * (1 - args.holdout)):]
        prompts = prompts_from(held, tok, args.prompts, args.prompt_tokens)
        what = f"held-out prompts x {args.prompt_tokens} tokens"
    bl = cfg.block_size
    base = clover_jax.SamplerConfig(gen_length=args.gen_length, block_length=bl, temperature=0.0,
                                    remasking="low_confidence", eos_stop=args.task == "tools")

    def run(sc):
        clover_jax.generate(weights, cfg, prompts[:1], sc)  # compile
        t0 = time.perf_counter()
        res = clover_jax.generate(weights, cfg, prompts, sc)
        return res, time.perf_counter() - t0

    print(f"{model}: {len(prompts)} {what}, {args.gen_length} new tokens "
          f"each, greedy, blocks of {bl}")
    print(f"{'decoding':34s} {'passes':>7s} {'tokens':>7s} {'passes/token':>13s} {'tok/s':>8s}  text")
    res, wall = run(base.replace(causal=True))  # the prompts one after another, one token a pass
    texts = [list(r) for r in res.raw]
    print(f"{'causal, one token a pass':34s} {res.stats.nfe:7d} {res.stats.tokens:7d} "
          f"{res.stats.nfe / res.stats.tokens:13.3f} {res.stats.tokens / wall:8.1f}  the causal model's greedy")
    for spb in args.steps_per_block:
        for th in args.threshold:
            sc = base.replace(self_speculative=True, steps_per_block=spb, threshold=th)
            res, wall = run(sc)
            same = "same" if [list(r) for r in res.raw] == texts else "DIFFERENT"
            name = f"self-speculative, {spb} pass{'es' if spb > 1 else ''}/draft" + (f", thr {th}" if th else "")
            print(f"{name:34s} {res.stats.nfe:7d} {res.stats.tokens:7d} {res.stats.nfe / res.stats.tokens:13.3f} "
                  f"{res.stats.tokens / wall:8.1f}  {same}")
    res, wall = run(base)  # the prompts as one batch: each of its passes is a pass of every row
    passes = res.stats.nfe * len(prompts)
    print(f"{'diffusion, one token a pass':34s} {passes:7d} {res.stats.tokens:7d} "
          f"{passes / res.stats.tokens:13.3f} {res.stats.tokens / wall:8.1f}  its own (a batch of {len(prompts)})")
    print("\nfirst prompt, causal:", repr(tok.decode(prompts[0])), "->", repr(tok.decode(texts[0][:48])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
