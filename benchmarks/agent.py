"""An agent loop through `clover serve`: held-out questions of the toy tool task
(`examples/toy_agent`: square, double, capital; one or two calls), each asked with the tools through
the `openai` client, every call executed and its result sent back, until the model answers in text.

    python benchmarks/agent.py --train-steps 400              # fine-tune clover-tiny on the task first
    python benchmarks/agent.py --model DIR --questions 20     # a checkpoint that already calls the tools
    python benchmarks/agent.py --model checkpoints/clover-tiny-tools --untrained --threshold 0.9   # the shipped one

Starts `make_app` over an `Engine` with uvicorn in this process (its compile time is printed, not counted),
runs every question non-streamed and streamed, and prints per mode: the share answered correctly, steps
(chat completions) per task, tool calls per task, completion tokens per step, forward passes per step (from
/metrics), wall time per task and the malformed calls (from /metrics: calls the model broke, those rewritten into
the canvas and any still malformed), with calls left as the model wrote them and rewritten into the canvas
(`--tool-calls`); with `--untrained` also the same loop on the model before fine-tuning (with
`--model` and no `--train-steps`: the shipped clover-tiny).
`--save DIR` keeps the fine-tuned checkpoint. A comparison with causal generation in transformers is not
offered: no causal model of this vocabulary calls these tools. Prints figures; asserts nothing.

    python benchmarks/agent.py --conversation 8 --observation 1024    # a long conversation, prefix cache on / off

`--conversation STEPS` instead runs one long agent-shaped conversation through the server, decoded six ways
(`RUNS`): block diffusion one token a pass with the prefix cache (`--prefix-cache-gb` 1) and without, at threshold
0.9 and four tokens a pass with it, self-speculatively with one-pass drafts (the causal model's greedy text,
drafted by the diffusion) and causally, one token a pass as an autoregressive model decodes (the same text; both on
the server's `--self-speculative` lane); a task, then at each step the whole conversation
is sent again (chat completions, greedy, `--reply` tokens), the reply appended and an observation of about
`--observation` tokens (a page of text, sent as a user message, as a tool's result would be) after it. The shipped
clover-tiny
(a causal-prefix model, whose prompts the prefix cache can cut anywhere) runs it with its `max_seq_len` raised to
hold the conversation (the figures are about time, not text). Prints per step the prompt's tokens, those the
prefix cache gave (usage.prompt_tokens_details.cached_tokens), each run's wall time and forward passes per step
and per task, and a plot of step time against conversation length with and without the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: clover_jax, examples/


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--train-steps", type=int, default=0, help="fine-tune on the task for this many steps first")
    p.add_argument("--train-questions", type=int, default=400, help="training questions (an SFT row per turn)")
    p.add_argument("--questions", type=int, default=20, help="held-out questions")
    p.add_argument("--threshold", type=float, default=0.0,
                   help="diffusion threshold (0: one token per pass)")
    p.add_argument("--remasking", default=None, help="the order a block is filled in (default: the model's)")
    p.add_argument("--clients", type=int, default=4, help="questions in flight at once")
    p.add_argument("--untrained", action="store_true", help="also run the loop on the model before fine-tuning "
                   "(without --train-steps: the shipped model)")
    p.add_argument("--save", default=None, help="write the fine-tuned checkpoint here")
    p.add_argument("--seed", type=int, default=0, help="seed of the task split")
    p.add_argument("--call-turns", action="store_true",
                   help="instead of whole loops: every call turn of the held-out questions alone (the conversation "
                        "before it given), the call compared with the expected one, tool_choice auto and required")
    p.add_argument("--tool-calls", choices=("scaffold", "free", "both"), default="both",
                   help="how the server writes a call the model did not write whole and valid (`clover serve "
                        "--tool-calls`); both: each in turn (default)")
    p.add_argument("--conversation", type=int, default=0, metavar="STEPS", help="the long conversation (see above)")
    p.add_argument("--observation", type=int, default=1024, metavar="TOKENS", help="its observations' length")
    p.add_argument("--reply", type=int, default=32, metavar="TOKENS", help="its replies' length")
    return p.parse_args(argv)


def _counters(port: int) -> tuple[float, dict[tuple[str, str], float]]:
    """(row passes so far, tool calls so far by (written, result)) from /metrics."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    m = re.search(r"^clover_row_passes_total (\S+)$", text, re.M)
    calls = {(w, r): float(n) for w, r, n in
             re.findall(r'^clover_tool_calls_total\{written="(\w+)",result="(\w+)"\} (\S+)$', text, re.M)}
    return (float(m.group(1)) if m else float("nan")), calls


@contextmanager
def serve(weights: Any, cfg: Any, tok: Any, scaffold: bool = True, defaults: dict[str, Any] | None = None
          ) -> Iterator[tuple[Any, int]]:
    """An engine behind `make_app` on a free loopback port: (openai client, port); drained on exit. `scaffold`:
    tool calls rewritten into the canvas (`clover serve --tool-calls scaffold`), else left as written. `defaults`:
    the request defaults `clover serve` takes from the checkpoint's generation_config.json."""
    import openai

    from clover_jax.commands.serve import SCAFFOLD_CLASSES
    from clover_jax.serving.background import serve_in_background
    from clover_jax.serving.engine import Engine

    eng = Engine(weights, cfg, max_prompt=256, max_tokens=96, batch_sizes=(1, 2, 4), queue_size=64,
                 scaffold_classes=SCAFFOLD_CLASSES if scaffold else 0)
    t0 = time.perf_counter()
    eng.warm_up(lambda line: None)
    print(f"compiled the serving programs in {time.perf_counter() - t0:.0f} s", flush=True)
    eng.start()
    with serve_in_background(eng, tok, cfg.name, defaults=defaults) as srv:
        yield openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=600), srv.port


def _extra_body(args: argparse.Namespace) -> dict:
    """The requests' extra body from `--threshold` and `--remasking` ({} when neither is given)."""
    diffusion: dict[str, Any] = {"threshold": args.threshold} if args.threshold > 0 else {}
    if args.remasking:
        diffusion["remasking"] = args.remasking
    return {"diffusion": diffusion} if diffusion else {}


def run_loop(label: str, client: Any, port: int, model: str, held: list, stream: bool, args: argparse.Namespace
             ) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from examples.toy_agent import run_agent

    extra = _extra_body(args)
    (before, calls0), t0 = _counters(port), time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        eps = list(pool.map(lambda t: run_agent(client, model, t, stream=stream, extra_body=extra), held))
    wall = time.perf_counter() - t0
    after, calls1 = _counters(port)
    passes = after - before
    made = {k: calls1.get(k, 0) - calls0.get(k, 0) for k in calls1}
    malformed = made.get(("model", "malformed"), 0)
    rewritten = sum(v for (w, _), v in made.items() if w == "scaffold")
    still = made.get(("scaffold", "malformed"), 0)
    steps = [e.steps for e in eps]
    tokens = [n for e in eps for n in e.tokens]
    print(f"{label:28s} correct {sum(e.correct for e in eps)}/{len(eps)} "
          f"(through the task's calls {sum(e.through_the_tools for e in eps)})  "
          f"steps/task {statistics.mean(steps):.2f}  "
          f"calls/task {statistics.mean(e.calls for e in eps):.2f}  tokens/step {statistics.mean(tokens):.1f}  "
          f"passes/step {passes / sum(steps):.1f}  wall/task {statistics.mean(e.wall_s for e in eps):.1f} s "
          f"({wall:.0f} s for all, {args.clients} at a time)  calls the model broke {malformed:.0f}, rewritten into "
          f"the canvas {rewritten:.0f}, malformed after {still:.0f}; malformed calls returned "
          f"{still if rewritten else malformed:.0f}", flush=True)


WORDS = ("the", "king", "my", "lord", "shall", "speak", "of", "love", "and", "death", "upon", "this", "night", "where",
         "fortune", "lies", "in", "wait", "for", "all", "that", "breathe", "beneath", "heavy", "crown", "a", "sword",
         "rose", "letter", "sealed", "with", "wax")


def _page(tok: Any, n: int, seed: int) -> str:
    """About `n` tokens of words (an observation: a page the agent must read)."""
    import random

    rng = random.Random(seed)
    words: list[str] = []
    while len(tok.encode(" ".join(words))) < n:
        words += [rng.choice(WORDS) for _ in range(64)]
    return " ".join(words)


# the conversation's runs: (label, prefix cache on, the request's diffusion settings)
RUNS = (("diffusion, cache on", True, {}), ("diffusion, cache off", False, {}),
        ("threshold 0.9, cache on", True, {"threshold": 0.9}),
        ("4 tokens a pass, cache on", True, {"steps": 8}),
        ("self-speculative", True, {"self_speculative": True, "steps": 1}),
        ("causal, one token a pass", True, {"causal": True}))


def conversation(args: argparse.Namespace) -> None:
    """`--conversation`: one long conversation, decoded several ways (see the module docstring)."""
    import openai

    import clover_jax
    from clover_jax import shipped
    from clover_jax.serving.background import serve_in_background
    from clover_jax.serving.engine import Engine
    from clover_jax.tokenizer import load_tokenizer

    model_dir = args.model or str(shipped.MODEL_DIR)
    cfg, weights = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    pages = [_page(tok, args.observation, k) for k in range(args.conversation)]
    longest = 64 + sum(len(tok.encode(p)) + args.reply + 16 for p in pages)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, -(-(longest + args.reply + 64) // 1024) * 1024))
    walls: dict[str, list[float]] = {}
    passes: dict[str, list[int]] = {}
    table: list[tuple[int, int]] = []
    for on in (True, False):
        eng = Engine(weights, cfg, max_prompt=longest, max_tokens=args.reply, batch_sizes=(1,), prefill_rows=1,
                     prefix_cache_gb=1.0 if on else 0.0, self_speculative=on and cfg.causal_prefix)
        t0 = time.perf_counter()
        eng.warm_up(lambda line: None, lane=True)
        print(f"prefix cache {'on' if on else 'off'}: compiled in {time.perf_counter() - t0:.0f} s", flush=True)
        eng.start()
        with serve_in_background(eng, tok, cfg.name) as srv:
            client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=600)
            for label, cache_on, diffusion in RUNS:
                lane = diffusion.get("self_speculative") or diffusion.get("causal")
                if cache_on != on or (lane and not cfg.causal_prefix):
                    continue
                # each run its own task line, so no run reuses another's saved conversation
                messages = [{"role": "system", "content": "You read pages and act."},
                            {"role": "user", "content": f"Task ({label}): find the letter sealed with wax."}]
                walls[label], passes[label] = [], []
                for k, page in enumerate(pages):
                    before = _counters(srv.port)[0]
                    t0 = time.perf_counter()
                    out = client.chat.completions.create(model=cfg.name, messages=messages, max_tokens=args.reply,
                                                         temperature=0, extra_body={"diffusion": diffusion})
                    walls[label].append(time.perf_counter() - t0)
                    passes[label].append(round(_counters(srv.port)[0] - before))
                    details = out.usage.prompt_tokens_details
                    if label == RUNS[0][0]:
                        table.append((out.usage.prompt_tokens, details.cached_tokens if details else 0))
                    messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                                 {"role": "user", "content": f"Observation {k + 1}: {page}"}]
        eng.drain()
    labels = [label for label, _, _ in RUNS if label in walls]
    print(f"\n{args.conversation} steps, observations of about {args.observation} tokens, replies of {args.reply}")
    print("| step | prompt tokens | reused (cache on) | " + " | ".join(f"wall, {lb}" for lb in labels) + " |")
    print("|---|---|---|" + "---|" * len(labels))
    for k, (n, cached) in enumerate(table):
        print(f"| {k + 1} | {n:,} | {cached:,} | " + " | ".join(f"{walls[lb][k]:.2f} s ({passes[lb][k]} passes)"
                                                              for lb in labels) + " |")
    print("| task | | | " + " | ".join(f"{sum(walls[lb]):.1f} s ({sum(passes[lb])} passes)" for lb in labels) + " |")
    on, off = labels[0], labels[1]
    top = max(walls[off] + walls[on])
    print("\nstep time against conversation length (# cache on, . cache off):")
    for (n, _), a, b in zip(table, walls[on], walls[off], strict=True):
        print(f"{n:>7,} tokens  #{'#' * round(40 * a / top):<40} {a:.2f} s")
        print(f"{'':>14}  .{'.' * round(40 * b / top):<40} {b:.2f} s")


def call_turns(label: str, client: Any, port: int, model: str, held: list, choice: str, extra: dict) -> None:
    """`--call-turns`: each held-out call turn once, greedy; exact calls, malformed ones (/metrics) and passes.
    `extra`: the request's extra body (`--threshold`, `--remasking`)."""
    from examples.toy_agent.task import TOOLS, turns

    want_calls, exact, answered, forced = 0, 0, 0, 0
    (before, calls0) = _counters(port)

    def ask(turn: Any) -> list:
        messages = [m.as_template() for m in turn.messages]
        for m in messages:
            for c in m.get("tool_calls", []):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        out = client.chat.completions.create(model=model, messages=messages, tools=list(TOOLS), max_tokens=96,
                                             temperature=0.0, tool_choice=choice, extra_body=extra)
        return out.choices[0].message.tool_calls or []

    answer_turns = [t for task in held for t in turns(task) if not t.is_call]
    for task in held:
        for turn in turns(task):
            if not turn.is_call:
                continue
            want_calls += 1
            calls = ask(turn)
            answered += bool(calls)
            want = turn.response[len("<tool_call>"):-len("</tool_call>")]
            exact += bool(calls) and {"name": calls[0].function.name,
                                      "arguments": json.loads(calls[0].function.arguments)} == json.loads(want)
    after, calls1 = _counters(port)
    if choice == "required":  # the turns that want a text answer: a call is what the request demands
        forced = sum(bool(ask(t)) for t in answer_turns)
    made = {k: calls1.get(k, 0) - calls0.get(k, 0) for k in calls1}
    rewritten = sum(v for (w, _), v in made.items() if w == "scaffold")
    print(f"{label:34s} call turns {want_calls}: exact {exact}, answered with a call {answered}, calls the model "
          f"broke {made.get(('model', 'malformed'), 0):.0f}, rewritten {rewritten:.0f} "
          f"(malformed after {made.get(('scaffold', 'malformed'), 0):.0f}), passes per turn "
          f"{(after - before) / want_calls:.1f}" + (f"; answer turns {len(answer_turns)}, answered with a call "
                                                     f"{forced}" if choice == "required" else ""), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.conversation:
        conversation(args)
        return
    import clover_jax
    from clover_jax import loading, shipped
    from clover_jax.serving.http_request import request_defaults
    from clover_jax.tokenizer import load_tokenizer
    from examples import toy_agent

    model_dir = args.model or str(shipped.MODEL_DIR)
    cfg, weights = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    train, held = toy_agent.split(args.train_questions, args.questions, args.seed)
    base = weights
    if args.train_steps:
        t0 = time.perf_counter()
        weights = toy_agent.finetune(cfg, weights, tok, train, toy_agent.Recipe(steps=args.train_steps))
        print(f"fine-tuned {args.train_steps} steps on {len(train)} questions in {time.perf_counter() - t0:.0f} s "
              "(compile included)", flush=True)
        if args.save:
            clover_jax.save_model(args.save, cfg, weights, tokenizer_dir=model_dir)
    # each model served with the request defaults `clover serve` takes from its generation_config.json
    runs = [("tuned" if args.train_steps else "model", cfg, weights, tok, request_defaults(
        loading.sampler_defaults(model_dir)))]
    if args.untrained:
        runs.insert(0, ("untrained", cfg, base, tok, runs[0][4]) if args.train_steps else
                    ("shipped clover-tiny", *clover_jax.load_model(str(shipped.MODEL_DIR)),
                     load_tokenizer(str(shipped.MODEL_DIR)),
                     request_defaults(loading.sampler_defaults(str(shipped.MODEL_DIR)))))
    modes = ("free", "scaffold") if args.tool_calls == "both" else (args.tool_calls,)
    for label, c, w, t, defaults in runs:
        for mode in modes:
            with serve(w, c, t, scaffold=mode == "scaffold", defaults=defaults) as (client, port):
                if args.call_turns:
                    for choice in ("auto", "required"):
                        call_turns(f"{label}, {mode}, tool_choice {choice}", client, port, c.name, held, choice,
                                   _extra_body(args))
                    continue
                for stream in (False, True):
                    run_loop(f"{label}, {mode}, {'streamed' if stream else 'not streamed'}", client, port, c.name,
                             held, stream, args)


if __name__ == "__main__":
    main()
