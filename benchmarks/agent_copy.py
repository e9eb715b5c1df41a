"""How many fine-tuning steps clover-tiny needs before it copies a question's number into a tool call.

The agent task (`examples/toy_agent`) asks the model to write calls such as
`<tool_call>{"name": "square", "arguments": {"x": 47}}</tool_call>` for "What is the square of 47?". The shipped
clover-tiny has no copying ability at all (Tiny Shakespeare teaches none), and the argument sits about 40 tokens
after the question's number, so the copy has to be learned from scratch. This control isolates that one skill:
one tool, two phrasings ("Square N." / "What is the square of N?"), N in 0..99; 20 of the 200 questions held
out, the other 180 trained on (block-diffusion SFT from the shipped model with the digit embeddings lifted, 8
rows of 128 tokens a step, lr 2e-3). Every `--every` steps it generates the held-out responses greedily and
prints how many are exactly the call (`--form call`) or the number (`--form number`), how many carry the
question's number as their argument, and how many its first digit. The run keeps checkpoints in `--run` and
resumes from them.

    python benchmarks/agent_copy.py --run runs/copy --steps 1500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: clover_jax, examples/
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare-train.txt"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run directory (checkpoints; resumed if present)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=150, help="steps between checkpoints and scores")
    p.add_argument("--form", choices=("call", "number"), default="call",
                   help="the response: the tool call, or the number alone")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--data", default=str(DEFAULT_DATA), help="text whose words the repeat check draws")
    args = p.parse_args()
    if args.steps < args.every or args.every < 1:
        print("agent_copy: error: --steps must be at least --every, and --every at least 1", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp

    import clover_jax
    from clover_jax import shipped
    from clover_jax.serving.chat import Message, call_text, plain_prompt
    from clover_jax.tokenizer import load_tokenizer
    from clover_jax.training import PairDataset, TrainConfig
    from clover_jax.training import train as run_training
    from examples import toy_agent

    cfg, base = clover_jax.load_model(str(shipped.MODEL_DIR))
    tok = load_tokenizer(str(shipped.MODEL_DIR))
    print(f"the shipped model repeats {repeat_rate(clover_jax, cfg, base, tok, args.data):.1%} of a repeated span "
          "(48 tokens of random Shakespeare words, then the first 16 again: the next 32 tokens)", flush=True)
    base = toy_agent.lift_digit_embeddings(base, tok)
    tools = toy_agent.specs()
    questions = [(x, q) for x in range(100) for q in ("Square {x}.", "What is the square of {x}?")]
    random.Random(0).shuffle(questions)
    held, train = questions[:20], questions[20:]

    def row(x: int, question: str) -> dict[str, str]:
        answer = call_text("square", {"x": x}) if args.form == "call" else str(x)
        return {"prompt": plain_prompt([Message("user", question.format(x=x))], tools), "response": " " + answer}

    os.makedirs(args.run, exist_ok=True)
    path = os.path.join(args.run, "rows.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row(*q)) + "\n" for q in train)
    seq_len = 128
    data = PairDataset(path, tok.encode, seq_len, cfg.eos_token_id, cfg.filler_id, seed=0)
    config = TrainConfig(steps=args.steps, batch_size=8, seq_len=seq_len, lr=args.lr, warmup_steps=20,
                         noise_eps=0.3, seed=0, dispatch="tiled", log_every=10**9, eval_every=10**9,
                         ckpt_every=args.every)
    length = 64 if args.form == "call" else 32
    sampler = clover_jax.SamplerConfig(gen_length=length, block_length=32, steps=length, temperature=0.0,
                                       remasking="low_confidence", seed=0)
    prompts = [tok.encode(row(*q)["prompt"]) for q in held]
    print(f"{len(train)} training questions, {len(held)} held out; response: the {args.form}", flush=True)
    started = time.perf_counter()
    for stop in range(args.every, args.steps + 1, args.every):
        res = run_training(cfg, config, data, ckpt_dir=os.path.join(args.run, "checkpoints"), stop_at=stop,
                           init_weights=jax.tree.map(jnp.copy, base), progress=False, eval_at_end=False,
                           log=lambda line: None)
        out = clover_jax.generate(res.state.weights, cfg, prompts, sampler)
        texts = [tok.decode(ids).strip() for ids in out.tokens]
        numbers = [re.findall(r"\d+", t)[:1] for t in texts]
        exact = sum(t == row(*q)["response"].strip() for t, q in zip(texts, held, strict=True))
        argument = sum(n == [str(q[0])] for n, q in zip(numbers, held, strict=True))
        first = sum(bool(n) and n[0][0] == str(q[0])[0] for n, q in zip(numbers, held, strict=True))
        print(f"step {stop} ({time.perf_counter() - started:.0f} s): exact {exact}/{len(held)}, the question's "
              f"number {argument}/{len(held)}, its first digit {first}/{len(held)}", flush=True)
    return 0


def repeat_rate(clover_jax, cfg, weights, tok, data: str, rows: int = 8, seed: int = 0) -> float:
    """The share of the next 32 tokens the model continues a repeat with: 48 tokens of random words of
    `data`, then their first 16 again (greedy, one token a pass); 0 for a model that cannot copy."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(data) as f:
        words = sorted(set(f.read(200_000).split()))
    prompts, targets = [], []
    for _ in range(rows):
        ids = tok.encode(" ".join(rng.choice(words, 30)))[:48]
        prompts.append(ids + ids[:16])
        targets.append(ids[16:48])
    sampler = clover_jax.SamplerConfig(gen_length=32, block_length=32, steps=32, temperature=0.0,
                                       remasking="low_confidence", seed=0)
    out = clover_jax.generate(weights, cfg, prompts, sampler)
    hits = [np.mean(np.asarray(o[:32]) == np.asarray(t)) for o, t in zip(out.tokens, targets, strict=True)]
    return float(np.mean(hits))


if __name__ == "__main__":
    raise SystemExit(main())
