"""Fine-tune the shipped clover-tiny to call the toy task's tools, scoring the held-out turns after each round.

    python scripts/train_tool_model.py --out runs/clover-tiny-tools

Block-diffusion SFT (`toy_agent.finetune`) on `toy_agent.sft_rows` of the task's training questions, in rounds
of `--round-steps` steps (each round a fresh cosine schedule and data order). After each round the held-out
questions' two turns are generated as `clover serve` renders them (greedy, one token a pass): the first turn
must be exactly the expected call, the second exactly the tool's result. The checkpoint of the best round so
far is written to `--out`; training stops early when every held-out turn is right. Prints one line per round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--round-steps", type=int, default=100)
    p.add_argument("--train-questions", type=int, default=300)
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--seed", type=int, default=0, help="seed of the task split")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and not args.force:
        print(f"train_tool_model: error: {args.out} exists (pass --force to overwrite it)", file=sys.stderr)
        return 2

    import clover_jax
    from clover_jax import shipped
    from clover_jax.serving import toy_agent
    from clover_jax.tokenizer import load_tokenizer

    model_dir = str(shipped.MODEL_DIR)
    cfg, weights = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    train, held = toy_agent.split(args.train_questions, args.held_out, args.seed)
    best, t0 = -1, time.perf_counter()
    for r in range(args.rounds):
        weights = toy_agent.finetune(cfg, weights, tok, train, steps=args.round_steps, seed=r)
        calls, answers = toy_agent.score_turns(weights, cfg, tok, held)
        print(f"round {r + 1}: {(r + 1) * args.round_steps} steps, {time.perf_counter() - t0:.0f} s; held out: "
              f"calls {calls}/{len(held)}, answers {answers}/{len(held)}", flush=True)
        if calls + answers > best:
            best = calls + answers
            clover_jax.save_model(args.out, cfg, weights, tokenizer_dir=model_dir, force=True)
        if best == 2 * len(held):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
