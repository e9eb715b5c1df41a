"""`clover serve` under load: N concurrent streaming clients on loopback, against `generate` run one
request at a time on the same prompts.

    python benchmarks/serve.py                       # the shipped model, 1 / 4 / 16 / 64 clients
    python benchmarks/serve.py --clients 1 16 --requests 32 --max-tokens 64

Starts `clover serve` in a subprocess (`--port 0`, the batch buckets of `--batch-sizes`), waits for it
to listen (its compile time is printed, not counted), then for each client count N runs N threads
that each send streaming completions one after another until `--requests` requests are done or
`--time-limit` seconds passed. Prints per N: requests/s, output tokens/s (the server's usage counts),
p50 / p99 latency and time to the first block (the first chunk with text), and the server's tokens
per pass and mean rows per block call from /metrics. Then the same prompts through
`clover_jax.sampler.generate` one after another in this process (greedy, the same settings, after
one warm-up call per shape). `--pass-scaling` only times the model's refinement pass at batch 1 / 4
/ 16 (the ceiling of what batching can give on this machine). `--engine` also runs the same
closed-loop clients on an `Engine` in this process (no HTTP), which separates what the batching gives
from what the HTTP layer costs. Prints figures; asserts nothing about time.

    python benchmarks/serve.py --burst 16            # 16 requests at once: prefilled together or one at a time

`--burst N` runs an `Engine` in this process twice, `--prefill-rows` 1 and then 4 (`--burst-rows`): N requests
with prompts of about `--burst-prompt` tokens, all queued before the scheduler starts, so the first admission takes
as many as there are rows. Prints per setting the engine's compile time, the admission (prefill) calls, the time
until each request's first block (p50 / last) and until all finished.

    python benchmarks/serve.py --soak 10             # 10 minutes of mixed traffic, then the ledger

`--soak MINUTES` instead runs `clover serve` with an API key ($CLOVER_API_KEY), --request-timeout
`--soak-timeout`, a 64 KiB body limit and JSON access lines, and `--soak-clients` threads on 127.0.0.1
sending a random mix (seeded) until the time is up: valid completions and chats, streamed ones, invalid
ones (bad JSON, wrong types, a prompt too long, an unknown model, no key, a wrong key, a body over the
limit, a wrong content type, n too large, NaN, nesting 10,000 deep), streams the client hangs up on
after the first chunk, and long ones (max_tokens 128, n 2) meant to pass the deadline. It prints
p50 / p99 latency (all answered requests and per kind), responses by status, requests accepted (200)
against requests finished (every choice with exactly one final finish_reason, or an error event, then
[DONE]; a hung-up stream counts as finished once the server's ledger closes), the server's own ledger
(generations submitted vs ended, rows and queue back to 0), access lines against requests answered,
and the server's RSS at start (after compiling), at the end and at its peak. It exits 1 if anything
was lost.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "KING RICHARD III:", "First Citizen:\nBefore we proceed",
           "MENENIUS:", "QUEEN MARGARET:\nSo", "DUKE VINCENTIO:", "LADY CAPULET:"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory or preset (default: the shipped model)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=64, help="requests per client count (at least one per client)")
    p.add_argument("--time-limit", type=float, default=180.0, help="seconds per client count")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--no-generate", action="store_true", help="skip the sequential generate baseline")
    p.add_argument("--pass-scaling", action="store_true",
                   help="only time the model's refinement pass at batch 1 / 4 / 16 (what batching can give here)")
    p.add_argument("--engine", action="store_true",
                   help="also the same clients on the engine in this process (no HTTP): what the batching gives")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="run the soak test for MINUTES instead (mixed traffic, then the ledger; see above)")
    p.add_argument("--soak-clients", type=int, default=24, help="client threads of the soak (default 24)")
    p.add_argument("--soak-timeout", type=float, default=10.0,
                   help="the server's --request-timeout during the soak, seconds (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the soak's request mix")
    p.add_argument("--burst", type=int, default=None, metavar="N", help="N requests queued at once (see above)")
    p.add_argument("--burst-prompt", type=int, default=200, metavar="TOKENS", help="their prompts' length")
    p.add_argument("--burst-rows", type=int, nargs="+", default=[1, 4], metavar="K",
                   help="the --prefill-rows settings compared (default 1 4)")
    return p.parse_args(argv)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, int, float]:
    cmd = [sys.executable, "-m", "clover_jax.cli", "serve", "--port", "0", "--max-prompt", "32",
           "--max-tokens", str(args.max_tokens), "--batch-sizes", *map(str, args.batch_sizes), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        if "listening on" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, int(line.rsplit(":", 1)[1]), time.perf_counter() - t0
    raise SystemExit(f"serve.py: the server exited ({proc.wait()}) before listening")


def one_request(client: object, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(latency s, time to first block s, completion tokens) of one streaming completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    # greedy, most confident first: what the engine and `generate` sides run (the server's defaults
    # come from the checkpoint's generation_config.json, which samples)
    stream = client.completions.create(model=MODEL[0], prompt=prompt, max_tokens=max_tokens, stream=True,
                                       temperature=0.0, stream_options={"include_usage": True},
                                       extra_body={"diffusion": {"remasking": "low_confidence"}})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return total, first if first is not None else total, tokens


MODEL = [""]


def closed_loop(n_clients: int, todo: int, time_limit: float, one: Callable[[int], tuple]) -> tuple[list, float]:
    """`n_clients` threads, each calling `one(i)` for the next request index i until `todo` requests ran
    or `time_limit` seconds passed; returns the results and the wall time."""
    lock, counter, results = threading.Lock(), [0], []
    end = time.perf_counter() + time_limit

    def worker() -> None:
        while True:
            with lock:
                if counter[0] >= todo or time.perf_counter() > end:
                    return
                i = counter[0]
                counter[0] += 1
            r = one(i)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def load_run(port: int, n_clients: int, args: argparse.Namespace) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    MODEL[0] = client.models.list().data[0].id
    before = metrics(port)
    results, wall = closed_loop(n_clients, max(args.requests, n_clients), args.time_limit,
                                lambda i: one_request(client, PROMPTS[i % len(PROMPTS)], args.max_tokens))
    after = metrics(port)
    lat = sorted(r[0] for r in results)
    ttfb = sorted(r[1] for r in results)
    toks = sum(r[2] for r in results)
    passes = after.get("clover_row_passes", 0) - before.get("clover_row_passes", 0)
    blocks = after.get("clover_blocks", 0) - before.get("clover_blocks", 0)
    rows = after.get("clover_mean_rows_per_block", 0) * after.get("clover_blocks", 0) - \
        before.get("clover_mean_rows_per_block", 0) * before.get("clover_blocks", 0)
    return {"clients": n_clients, "requests": len(results), "wall_s": wall, "req_per_s": len(results) / wall,
            "tok_per_s": toks / wall, "p50_s": pct(lat, 50), "p99_s": pct(lat, 99), "ttfb_p50_s": pct(ttfb, 50),
            "ttfb_p99_s": pct(ttfb, 99), "tokens": toks,
            "tokens_per_pass": toks / passes if passes else float("nan"),
            "rows_per_block": rows / blocks if blocks else float("nan")}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))]


def metrics(port: int) -> dict[str, float]:
    """The server's unlabelled gauges and counters (name -> value)."""
    import httpx

    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removesuffix("_total")] = float(value)
    return out


def engine_runs(args: argparse.Namespace) -> list[dict]:
    """The same closed-loop clients calling `Engine.submit` in this process: no HTTP, no JSON, no SSE."""
    from clover_jax.loading import default_model, open_model
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request

    cfg, weights, tok, _ = open_model(args.model or default_model())
    eng = Engine(weights, cfg, max_prompt=32, max_tokens=args.max_tokens, batch_sizes=tuple(args.batch_sizes))
    eng.start()
    prompts = [tuple(tok.encode(p)) for p in PROMPTS]
    rows = []
    for n_clients in args.clients:
        def one(i: int) -> tuple[float, int]:
            done, got, t0 = threading.Event(), [0], time.perf_counter()

            def on_event(ev: Any) -> None:
                got[0] += len(ev.tokens)
                if ev.finish_reason:
                    done.set()

            eng.submit(Request(prompts[i % len(prompts)], args.max_tokens), on_event)
            done.wait()
            return time.perf_counter() - t0, got[0]

        before = eng.stats()
        results, wall = closed_loop(n_clients, max(args.requests, n_clients), args.time_limit, one)
        after = eng.stats()
        lat = sorted(r[0] for r in results)
        toks = sum(r[1] for r in results)
        blocks = after.blocks_run - before.blocks_run
        rows.append({"clients": f"{n_clients} (engine)", "requests": len(results), "wall_s": wall,
                     "req_per_s": len(results) / wall, "tok_per_s": toks / wall, "p50_s": pct(lat, 50),
                     "p99_s": pct(lat, 99), "ttfb_p50_s": float("nan"), "ttfb_p99_s": float("nan"), "tokens": toks,
                     "tokens_per_pass": toks / max(after.row_passes - before.row_passes, 1),
                     "rows_per_block": (after.rows_in_blocks - before.rows_in_blocks) / max(blocks, 1)})
        print(json.dumps(rows[-1]), flush=True)
    eng.drain()
    return rows


def burst(args: argparse.Namespace) -> list[dict]:
    """`--burst`: N requests queued before the scheduler starts, admitted K at a time (`Engine.prefill_rows`)."""
    from clover_jax.loading import default_model, open_model
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request

    cfg, weights, tok, _ = open_model(args.model or default_model())
    text = " ".join(PROMPTS) * 64
    ids = tok.encode(text)
    prompts = [tuple(ids[i * 7:i * 7 + args.burst_prompt]) for i in range(args.burst)]  # each its own text
    n, rows = args.burst, []
    for k in args.burst_rows:
        eng = Engine(weights, cfg, max_prompt=args.burst_prompt, max_tokens=args.max_tokens,
                     batch_sizes=tuple(args.batch_sizes), prefill_rows=k)
        t0 = time.perf_counter()
        eng.warm_up()
        compile_s = time.perf_counter() - t0
        first: dict[int, float] = {}
        done = threading.Semaphore(0)

        def sink(i: int, first: dict[int, float] = first, done: threading.Semaphore = done) -> Callable[[Any], None]:
            def on_event(ev: Any) -> None:
                first.setdefault(i, time.perf_counter())
                if ev.finish_reason:
                    done.release()
            return on_event

        for i, p in enumerate(prompts):
            eng.submit(Request(p, args.max_tokens), sink(i))
        t0 = time.perf_counter()
        eng.start()
        for _ in range(n):
            done.acquire()
        wall = time.perf_counter() - t0
        st = eng.stats()
        eng.drain()
        ttfb = sorted(t - t0 for t in first.values())
        rows.append({"prefill_rows": k, "requests": n, "prompt": args.burst_prompt, "compile_s": compile_s,
                     "prefill_calls": st.prefill_calls, "ttfb_p50_s": pct(ttfb, 50), "ttfb_last_s": ttfb[-1],
                     "wall_s": wall})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{n} requests at once, prompts of {args.burst_prompt} tokens, {args.max_tokens} tokens each, buckets "
          f"{args.batch_sizes}")
    print("| --prefill-rows | compile | admission calls | p50 first block | last first block | all done |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prefill_rows']} | {r['compile_s']:.1f} s | {r['prefill_calls']} | {r['ttfb_p50_s']:.2f} s "
              f"| {r['ttfb_last_s']:.2f} s | {r['wall_s']:.2f} s |")
    return rows


def pass_scaling(args: argparse.Namespace, batches: tuple[int, ...] = (1, 4, 16), reps: int = 20) -> None:
    """ms of the model's refinement pass (one block of 32 against a cache of the server's columns) at
    each batch: the most batching can give on this machine is the ratio of tokens per second. Next to it,
    the pass's FLOPs (`plan.arithmetic.analytic_flops`), the rate it reaches, and what a jitted dense dot of
    the LM head's shape at the same rows reaches here (`pass_floor.dot_flops_per_s`): the pass's compute
    floor, and so the most any batching could give on this machine."""
    import jax
    import jax.numpy as jnp
    from pass_floor import dot_flops_per_s

    from clover_jax.loading import default_model, open_model
    from clover_jax.model import init_cache, masks, transformer
    from clover_jax.plan.arithmetic import PassShape, analytic_flops

    cfg, weights, _, _ = open_model(args.model or default_model())
    bl = 32
    s = 32 + -(-args.max_tokens // bl) * bl
    base = None
    print(f"{cfg.name}: one block of {bl} against {s} columns per row; GFLOP counted by plan.arithmetic, 'dot' = a "
          "jitted [rows, d] @ [d, vocab] at the same rows (best of 5)")
    for b in batches:
        valid = jnp.ones((b, s), bool)
        ids = jnp.broadcast_to(jnp.where(jnp.arange(s) >= s - bl, s, jnp.arange(s) // cfg.block_size), (b, s))
        qv, qi = valid[:, s - bl:], ids[:, s - bl:]
        mask = masks.attention_mask(qv, qi, valid, ids, True)
        pos = masks.positions(valid)[:, s - bl:]
        extra = dict(valid=qv, blocks=qi, commit=0) if cfg.is_hybrid else {}

        def one(w: Any, t: Any, c: Any, mask=mask, pos=pos, extra=extra) -> Any:
            return transformer.forward(w, cfg, t, pos, mask, c, jnp.int32(s - bl), logits_start=0, logits_len=bl,
                                       **extra).logits[0, 0, 0]

        loop = jax.jit(lambda w, t, c, one=one: jax.lax.fori_loop(
            0, reps, lambda i, acc: acc + one(w, t + (acc > 1e30).astype(jnp.int32), c), 0.0))
        args_ = (weights, jnp.full((b, bl), 5, jnp.int32), init_cache(cfg, b, s))
        loop(*args_).block_until_ready()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            loop(*args_).block_until_ready()
            best = min(best, (time.perf_counter() - t0) / reps)
        ms = best * 1e3
        rate = b * bl / ms * 1e3
        base = base or rate
        flops = analytic_flops(cfg, PassShape("refinement", b, bl, s, bl, True))
        dot = dot_flops_per_s(b * bl, cfg.d_model, cfg.vocab_size)
        print(f"refinement pass, batch {b:3d}: {ms:7.2f} ms  {rate:8.0f} tok/s  ({rate / base:.2f}x batch 1)  "
              f"{flops / 1e9:6.3f} GFLOP at {flops / best / 1e9:5.1f} GFLOP/s; dot {dot / 1e9:5.1f} GFLOP/s -> "
              f"floor {flops / dot * 1e3:6.2f} ms, at most {b * bl / (flops / dot) / base:.2f}x batch 1", flush=True)


def generate_baseline(args: argparse.Namespace, n: int) -> dict:
    from clover_jax.loading import default_model, open_model
    from clover_jax.sampler import SamplerConfig, generate

    cfg, weights, tok, _ = open_model(args.model or default_model())
    gen = -(-args.max_tokens // 32) * 32
    sc = SamplerConfig(gen_length=gen, block_length=32, cache="prefix")
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    generate(weights, cfg, prompts[:1], sc)  # compile (every prompt here fits the same bucket)
    lat, toks = [], 0
    t0 = time.perf_counter()
    for p in prompts:
        t1 = time.perf_counter()
        toks += len(generate(weights, cfg, [p], sc).tokens[0][:args.max_tokens])
        lat.append(time.perf_counter() - t1)
    wall = time.perf_counter() - t0
    lat.sort()
    return {"clients": "generate", "requests": n, "wall_s": wall, "req_per_s": n / wall, "tok_per_s": toks / wall,
            "p50_s": pct(lat, 50), "p99_s": pct(lat, 99), "ttfb_p50_s": float("nan"), "ttfb_p99_s": float("nan"),
            "tokens": toks, "tokens_per_pass": float("nan"), "rows_per_block": 1.0}


# --- the soak test ---------------------------------------------------------------------------------

SOAK_MAX_TOKENS = 128
SOAK_BODY_LIMIT = 64 * 1024
KINDS = (("valid", 30), ("stream", 30), ("invalid", 20), ("cancelled", 10), ("timeout", 10))


class Ledger:
    """What the soak's clients saw (thread-safe): statuses, latencies, and how each accepted request ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: collections.Counter = collections.Counter()  # by kind
        self.status: collections.Counter = collections.Counter()  # by status code (or an exception name)
        self.ended: collections.Counter = collections.Counter()  # finished / errored / hung_up / lost
        self.timed_out: collections.Counter = collections.Counter()  # by kind
        self.unexpected: list[str] = []
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.answered_v1 = 0  # requests to /v1/* that got a status line: each must have one access line

    def add(self, kind: str, status: int | str, seconds: float | None, ended: str | None = None,
            timed_out: bool = False, note: str | None = None) -> None:
        """One request: its kind, status (or exception name), latency, how it ended (accepted ones)."""
        with self.lock:
            self.sent[kind] += 1
            self.status[status] += 1
            if isinstance(status, int):
                self.answered_v1 += 1
            if seconds is not None:
                self.latency[kind].append(seconds)
            if ended is not None:
                self.ended[ended] += 1
            if timed_out:
                self.timed_out[kind] += 1
            if note is not None and len(self.unexpected) < 20:
                self.unexpected.append(note)


def _invalid(rng: random.Random, key: str) -> tuple[str, bytes, dict[str, str], int]:
    """(path, body, headers, expected status) of one invalid request."""
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    good = {"model": MODEL[0], "prompt": "ROMEO:", "max_tokens": 8}
    cases = [
        ("/v1/completions", b'{"prompt": ', auth, 400),
        ("/v1/completions", json.dumps({**good, "max_tokens": "10"}).encode(), auth, 400),
        ("/v1/completions", json.dumps({**good, "prompt": "word " * 200}).encode(), auth, 400),
        ("/v1/completions", json.dumps({**good, "model": "gpt-4"}).encode(), auth, 404),
        ("/v1/completions", json.dumps(good).encode(), {"Content-Type": "application/json"}, 401),
        ("/v1/chat/completions", json.dumps(good).encode(), {**auth, "Authorization": "Bearer wrong"}, 401),
        ("/v1/completions", json.dumps({**good, "prompt": "x" * (SOAK_BODY_LIMIT + 1)}).encode(), auth, 413),
        ("/v1/completions", json.dumps(good).encode(), {**auth, "Content-Type": "text/plain"}, 415),
        ("/v1/completions", json.dumps({**good, "n": 99}).encode(), auth, 400),
        ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', auth, 400),
        ("/v1/chat/completions", b"[" * 10000 + b"]" * 10000, auth, 400),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), auth, 400),
    ]
    return rng.choice(cases)


def _sse_end(lines: list[str], n: int) -> tuple[str, bool]:
    """How a stream ended: "finished" (each of the n choices exactly one finish_reason, then [DONE]),
    "errored" (an error event, then [DONE]) or "lost"; and whether it says timed_out."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return "lost", False
    finals: collections.Counter = collections.Counter()
    timed_out = False
    for d in data[:-1]:
        obj = json.loads(d)
        if "error" in obj:
            return "errored", False
        timed_out |= bool(obj.get("timed_out"))
        for c in obj.get("choices", []):
            if c.get("finish_reason"):
                finals[c["index"]] += 1
    return ("finished" if finals == dict.fromkeys(range(n), 1) else "lost"), timed_out


def soak_client(url: str, key: str, end: float, rng: random.Random, ledger: Ledger) -> None:
    """Send random requests until `end` (time.monotonic()), one at a time, recording each in `ledger`."""
    import httpx

    auth = {"Authorization": f"Bearer {key}"}
    names, weights = zip(*KINDS, strict=True)
    with httpx.Client(base_url=url, timeout=120) as c:
        while time.monotonic() < end:
            kind = rng.choices(names, weights)[0]
            prompt = rng.choice(PROMPTS)
            t0 = time.perf_counter()
            try:
                if kind == "invalid":
                    path, raw, headers, want = _invalid(rng, key)
                    r = c.post(path, content=raw, headers=headers)
                    ok = r.status_code == want and "error" in r.json()
                    ledger.add(kind, r.status_code, time.perf_counter() - t0,
                               note=None if ok else f"invalid {path} wanted {want}, got {r.status_code} {r.text[:200]}")
                    continue
                chat = rng.random() < 0.3
                n = 2 if kind == "timeout" else rng.choice((1, 1, 1, 2))
                body: dict[str, Any] = {"model": MODEL[0], "n": n, "temperature": rng.choice((0.0, 0.0, 0.8)),
                                        "max_tokens": SOAK_MAX_TOKENS if kind == "timeout" else rng.choice((8, 16, 32))}
                if chat:
                    body["messages"] = [{"role": "user", "content": prompt}]
                else:
                    body["prompt"] = prompt
                if rng.random() < 0.2:
                    body["stop"] = ["\n\n"]
                path = "/v1/chat/completions" if chat else "/v1/completions"
                if kind in ("stream", "cancelled") or (kind == "timeout" and rng.random() < 0.5):
                    body["stream"] = True
                    with c.stream("POST", path, json=body, headers=auth) as r:
                        if r.status_code != 200:
                            ledger.add(kind, r.status_code, time.perf_counter() - t0,
                                       note=f"{kind} got {r.status_code} {r.read()[:200]!r}")
                            continue
                        lines = []
                        for line in r.iter_lines():
                            lines.append(line)
                            if kind == "cancelled" and line.startswith("data: "):
                                break  # hang up after the first chunk
                    if kind == "cancelled" and lines[-1] != "data: [DONE]":
                        ledger.add(kind, 200, None, ended="hung_up")
                        continue
                    how, timed_out = _sse_end(lines, n)
                    ledger.add(kind, 200, time.perf_counter() - t0, ended=how, timed_out=timed_out,
                               note=None if how != "lost" else f"lost stream: {lines[-3:]}")
                else:
                    r = c.post(path, json=body, headers=auth)
                    if r.status_code != 200:
                        ledger.add(kind, r.status_code, time.perf_counter() - t0,
                                   note=f"{kind} got {r.status_code} {r.text[:200]}")
                        continue
                    obj = r.json()
                    ok = len(obj["choices"]) == n and all(ch["finish_reason"] for ch in obj["choices"])
                    ledger.add(kind, 200, time.perf_counter() - t0, ended="finished" if ok else "lost",
                               timed_out=bool(obj.get("timed_out")), note=None if ok else f"lost: {r.text[:200]}")
            except Exception as e:  # a dropped connection or a timeout: counted, never silent
                ledger.add(kind, type(e).__name__, None, note=f"{kind}: {e!r}"[:200])


def metrics_ledger(port: int, key: str) -> dict[str, Any]:
    """The soak's view of /metrics: the generation ledger, rows, queue and timeouts."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    values: dict[str, float] = {}
    ended_by: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("clover_generations_ended_total{"):
            ended_by[name.split('"')[1]] = float(value)
        values[name] = float(value)
    return {"submitted": values.get("clover_generations_submitted_total", 0.0), "ended": sum(ended_by.values()),
            "ended_by": ended_by, "in_flight": values.get("clover_generations_in_flight", 0.0),
            "active": values.get("clover_active_rows", 0.0), "queue": values.get("clover_queue_depth", 0.0),
            "timed_out": values.get("clover_requests_timed_out_total", 0.0)}


def start_soak_server(args: argparse.Namespace, key: str) -> tuple[subprocess.Popen, int, list[dict], float]:
    """`clover serve` for the soak: (process, port, its log lines as parsed JSON, seconds to listen)."""
    cmd = [sys.executable, "-m", "clover_jax.cli", "serve", "--port", "0", "--max-prompt", "32",
           "--max-tokens", str(SOAK_MAX_TOKENS), "--batch-sizes", *map(str, args.batch_sizes),
           "--request-timeout", str(args.soak_timeout), "--max-body-bytes", str(SOAK_BODY_LIMIT),
           "--log-format", "json", "--log-level", "info"]
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    env = {**os.environ, "CLOVER_API_KEY": key}  # never on the command line
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert proc.stderr is not None
    log: list[dict] = []

    def parse(line: str) -> dict:
        try:
            return json.loads(line)
        except ValueError:
            return {"message": line.rstrip("\n"), "not_json": True}

    for line in proc.stderr:
        log.append(parse(line))
        if log[-1].get("message", "").startswith("listening on"):
            rest = proc.stderr
            threading.Thread(target=lambda rest=rest: [log.append(parse(x)) for x in rest], daemon=True).start()
            return proc, int(log[-1]["message"].rsplit(":", 1)[1]), log, time.perf_counter() - t0
    raise SystemExit(f"serve.py: the server exited ({proc.wait()}) before listening")


def soak(args: argparse.Namespace) -> int:
    """The soak test (see the module docstring); 0 when nothing was lost."""
    import httpx
    import psutil

    key = secrets.token_urlsafe(24)
    proc, port, log, ready_s = start_soak_server(args, key)
    url = f"http://127.0.0.1:{port}"
    print(f"soak: server ready after {ready_s:.1f} s; {args.soak:g} min, {args.soak_clients} clients, "
          f"--request-timeout {args.soak_timeout:g} s, max_tokens up to {SOAK_MAX_TOKENS}", flush=True)
    server = psutil.Process(proc.pid)
    rss_start = rss_peak = server.memory_info().rss
    MODEL[0] = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
    ledger = Ledger()
    ledger.answered_v1 = 1  # the GET /v1/models just above
    t_start = time.monotonic()
    end = t_start + args.soak * 60
    threads = [threading.Thread(target=soak_client, args=(url, key, end, random.Random(args.seed * 1000 + i), ledger))
               for i in range(args.soak_clients)]
    for t in threads:
        t.start()
    last_report = t_start
    while any(t.is_alive() for t in threads):
        time.sleep(2)
        rss_peak = max(rss_peak, server.memory_info().rss)
        if time.monotonic() - last_report >= 60:
            last_report = time.monotonic()
            print(f"soak: {(last_report - t_start) / 60:.0f} min, {sum(ledger.sent.values())} requests, "
                  f"RSS {server.memory_info().rss / (1 << 20):.0f} MiB", flush=True)
    for t in threads:
        t.join()
    idle_by = time.monotonic() + 60  # the hung-up streams' rows free at their next block boundary
    m = metrics_ledger(port, key)
    while (m["in_flight"] or m["active"] or m["queue"]) and time.monotonic() < idle_by:
        time.sleep(0.5)
        m = metrics_ledger(port, key)
    rss_end = server.memory_info().rss
    rss_peak = max(rss_peak, rss_end)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    time.sleep(0.5)  # the reader thread takes the last lines
    access = [o for o in log if o.get("event") == "access" and str(o.get("path", "")).startswith("/v1/")]
    access_by_status = collections.Counter(o["status"] for o in access)
    not_json = [o["message"] for o in log if o.get("not_json")]
    key_leaked = any(key in json.dumps(o) for o in log)

    def pcts(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"p50 {pct(xs, 50):.2f} s, p99 {pct(xs, 99):.2f} s (n={len(xs)})" if xs else "-"

    accepted, ends = ledger.status[200], ledger.ended
    closed = ends["finished"] + ends["errored"] + ends["hung_up"]
    mib = 1 << 20
    print(f"\nsoak: {args.soak:g} min on {MODEL[0]}, {args.soak_clients} clients on 127.0.0.1 "
          "(a shared 2-core machine)")
    print("requests sent by kind: " + ", ".join(f"{k} {ledger.sent[k]}" for k, _ in KINDS)
          + f" (total {sum(ledger.sent.values())}, {sum(ledger.sent.values()) / (args.soak * 60):.2f}/s)")
    print("responses by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(ledger.status.items(), key=str)))
    print(f"latency, every answered request: {pcts([x for v in ledger.latency.values() for x in v])}")
    for k, _ in KINDS:
        print(f"  {k:9s} {pcts(ledger.latency[k])}")
    print(f"accepted (200): {accepted}; ended: finished {ends['finished']} + error event {ends['errored']} + "
          f"hung up by the client {ends['hung_up']} = {closed}; lost {ends['lost']}")
    print("timed out (finish_reason length + timed_out): " + (", ".join(f"{k} {n}" for k, n in ledger.timed_out.items())
                                                             or "none") + f" (server counter {m['timed_out']:.0f})")
    print(f"server ledger: generations submitted {m['submitted']:.0f}, ended {m['ended']:.0f} {m['ended_by']}; "
          f"in flight {m['in_flight']:.0f}, active rows {m['active']:.0f}, queue {m['queue']:.0f}")
    print(f"access lines for /v1/*: {len(access)} for {ledger.answered_v1} requests answered "
          f"(by status {dict(sorted(access_by_status.items()))}); log lines not JSON: {len(not_json)}; "
          f"key in the log: {key_leaked}")
    print(f"server RSS: start {rss_start / mib:.0f} MiB (after compiling), end {rss_end / mib:.0f} MiB, "
          f"peak {rss_peak / mib:.0f} MiB; exit code after SIGTERM {code}")
    if ledger.unexpected:
        print("unexpected:\n  " + "\n  ".join(ledger.unexpected))
    if not_json:
        print("log lines that are not JSON (written past the logging setup):\n  " + "\n  ".join(not_json[:5]))
    lost = bool(ends["lost"] or m["submitted"] != m["ended"] or m["in_flight"] or m["active"] or m["queue"]
                or len(access) != ledger.answered_v1 or accepted != closed or key_leaked)
    summary = {"minutes": args.soak, "clients": args.soak_clients, "sent": dict(ledger.sent),
               "status": {str(k): v for k, v in ledger.status.items()}, "ended": dict(ends),
               "timed_out": dict(ledger.timed_out), "server": {k: v for k, v in m.items() if k != "ended_by"},
               "access_lines": len(access), "answered_v1": ledger.answered_v1, "rss_start_mib": rss_start / mib,
               "rss_end_mib": rss_end / mib, "rss_peak_mib": rss_peak / mib, "lost": lost}
    print(json.dumps(summary))
    print("soak: " + ("SOMETHING WAS LOST" if lost else "nothing lost: every accepted request ended exactly once"))
    return 1 if lost else 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pass_scaling:
        pass_scaling(args)
        return
    if args.soak is not None:
        raise SystemExit(soak(args))
    if args.burst is not None:
        burst(args)
        return
    proc, port, ready_s = start_server(args)
    print(f"server ready after {ready_s:.1f} s (load + compile of every bucket)")
    rows = []
    try:
        for n in args.clients:
            rows.append(load_run(port, n, args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    if args.engine:
        rows += engine_runs(args)
    if not args.no_generate:
        rows.append(generate_baseline(args, min(args.requests, 32)))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nmax_tokens {args.max_tokens}, buckets {args.batch_sizes}")
    print("| clients | requests | req/s | output tok/s | p50 latency | p99 latency | p50 first block | tokens/pass |"
          " rows/block |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} "
              f"| {r['p50_s']:.2f} s | {r['p99_s']:.2f} s | {r['ttfb_p50_s']:.2f} s | {r['tokens_per_pass']:.2f} "
              f"| {r['rows_per_block']:.1f} |")
    for tag in ("", " (engine)"):
        one = next((r for r in rows if str(r["clients"]) == f"1{tag}"), None)
        sixteen = next((r for r in rows if str(r["clients"]) == f"16{tag}"), None)
        if one and sixteen:
            print(f"tokens/s at 16 clients / at 1 client{tag}: {sixteen['tok_per_s'] / one['tok_per_s']:.2f}x")


if __name__ == "__main__":
    main()
