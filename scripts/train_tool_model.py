"""Fine-tune the shipped clover-tiny to call the toy task's tools: one resumable run, held-out turns scored as it goes.

    python scripts/train_tool_model.py --run runs/tools --export runs/clover-tiny-tools
    python scripts/train_tool_model.py --run runs/tools --export runs/clover-tiny-tools   # later: resumes

The shipped `checkpoints/clover-tiny-tools` is two such runs: the recipe's 6,000 steps from clover-tiny as it was
under the earlier reading (`--base FIRST_BASE --export runs/clover-tiny-tools-rc`, FIRST_BASE that checkpoint from
the repository's history; its step 5,700, about 3.7 h on two cores), then a fine-tune of those weights into the
reading Clover's ports run (a causal clean prefix; 2,400 steps, about 67 min, its step 2,200 shipped):

    python scripts/train_tool_model.py --run runs/tools-cp --export runs/clover-tiny-tools-cp \
        --base runs/clover-tiny-tools-rc --bd-gdn causal_prefix --causal-coef 1 --no-lift \
        --lr 5e-4 --warmup 20 --schedule 2400 --score-every 200

Its card (`checkpoints/clover-tiny-tools/MODEL_CARD.md`) has the held-out figures of both.

The toy task and its recipe are the repository's example `examples/toy_agent`. Block-diffusion SFT
(`toy_agent.finetune`, settings in `toy_agent.Recipe`) on `toy_agent.sft_rows` of the task's training questions,
with Orbax checkpoints in `--run` every `--score-every` steps: stop it at any time (Ctrl-C, a closed session) and
the same command resumes from the latest one. At every checkpoint every turn of the held-out
questions (`toy_agent.turns`: each call, then the answer, the conversation before it given) is generated as
`clover serve` renders it (greedy, one token a pass, in low-confidence order and in random order, the shipped
model's own): a call turn must be exactly the expected call, an answer turn exactly the last tool's result.
The best weights so far (by the sum over both orders) are exported to `--export`, a native checkpoint
`clover serve --model` takes. Prints one line per checkpoint; stops early when every held-out turn is right in
both orders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: clover_jax, examples/


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory: training checkpoints (resumed if present)")
    p.add_argument("--export", required=True, help="checkpoint directory for the best weights so far")
    p.add_argument("--steps", type=int, default=None, help="stop after this global step (default: the recipe's)")
    p.add_argument("--score-every", type=int, default=200, help="steps between checkpoints and scores")
    p.add_argument("--train-questions", type=int, default=400)
    p.add_argument("--held-out", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the task split")
    p.add_argument("--name", default="clover-tiny-tools", help="the exported model's name")
    p.add_argument("--force", action="store_true", help="let a new run replace an existing --export")
    p.add_argument("--base", default=None, help="the checkpoint to start from (default: the shipped clover-tiny)")
    p.add_argument("--bd-gdn", choices=("reconstructed", "causal_prefix"), default=None,
                   help="read the base's block-diffusion tensors this way (default: as the base says)")
    p.add_argument("--causal-coef", type=float, default=0.0,
                   help="weight of the clean half's next-token loss (a causal-prefix reading; default 0)")
    p.add_argument("--no-lift", action="store_true",
                   help="leave the digits' embeddings as the base has them (a base already tuned on the task)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: the recipe's)")
    p.add_argument("--schedule", type=int, default=None, help="the cosine schedule's steps (default: the recipe's)")
    args = p.parse_args(argv)
    scores_path = os.path.join(args.run, "scores.jsonl")
    if os.path.exists(args.export) and not os.path.exists(scores_path) and not args.force:
        print(f"train_tool_model: error: {args.export} exists and this run did not write it (pass --force to "
              "replace it)", file=sys.stderr)
        return 2

    import clover_jax
    from clover_jax import shipped
    from clover_jax.tokenizer import load_tokenizer
    from examples import toy_agent

    recipe = toy_agent.Recipe()
    changes = {"lr": args.lr, "warmup_steps": args.warmup, "steps": args.schedule}
    recipe = dataclasses.replace(recipe, causal_coef=args.causal_coef, lift_digits=not args.no_lift,
                                 **{k: v for k, v in changes.items() if v is not None})
    last = args.steps or recipe.steps
    model_dir = args.base or str(shipped.MODEL_DIR)
    cfg, base = clover_jax.load_model(model_dir)
    if args.bd_gdn is not None:
        cfg = cfg.replace(bd_gdn=args.bd_gdn)  # the same tensors, read another way
    out_cfg = cfg.replace(name=args.name)  # the exported checkpoint's name (what `clover serve` reports)
    tok = load_tokenizer(model_dir)
    train, held = toy_agent.split(args.train_questions, args.held_out, args.seed)
    history = ([json.loads(x) for x in Path(scores_path).read_text().splitlines()]
               if os.path.exists(scores_path) else [])
    best = max((h["total"] for h in history), default=-1)
    t0 = time.perf_counter()
    ckpts = Path(args.run, "checkpoints")
    done = [int(d.name) for d in ckpts.iterdir() if d.name.isdigit()] if ckpts.is_dir() else []
    step = max(done, default=0)  # where the run resumes
    while step < last:
        step = min(last, (step // args.score_every + 1) * args.score_every)
        weights = toy_agent.finetune(cfg, base, tok, train, recipe, stop_at=step, run_dir=args.run)
        row = {"step": step}
        for order in ("low_confidence", "random"):
            row[order] = toy_agent.score_turns(weights, cfg, tok, held, remasking=order)
        row["total"] = sum(right for o in ("low_confidence", "random") for right, _ in row[o])
        with open(scores_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        (c, nc), (a, na) = row["low_confidence"]
        (rc, _), (ra, _) = row["random"]
        print(f"step {step} ({time.perf_counter() - t0:.0f} s this session): held-out turns right, calls / answers: "
              f"low-confidence order {c}/{nc}, {a}/{na}; random order {rc}/{nc}, {ra}/{na}", flush=True)
        if row["total"] > best:
            best = row["total"]
            clover_jax.save_model(args.export, out_cfg, weights, tokenizer_dir=model_dir, force=True)
        if best == 2 * sum(n for _, n in row["low_confidence"]):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
