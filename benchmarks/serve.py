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
"""

from __future__ import annotations

import argparse
import json
import os
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
    from clover_jax.commands.generate import default_model, load
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request

    cfg, weights, tok, _ = load(args.model or default_model(), None)
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


def pass_scaling(args: argparse.Namespace, batches: tuple[int, ...] = (1, 4, 16), reps: int = 20) -> None:
    """ms of the model's refinement pass (one block of 32 against a cache of the server's columns) at
    each batch: the most batching can give on this machine is the ratio of tokens per second. Next to it,
    the pass's FLOPs (`plan.arithmetic.analytic_flops`), the rate it reaches, and what a jitted dense dot of
    the LM head's shape at the same rows reaches here (`pass_floor.dot_flops_per_s`): the pass's compute
    floor, and so the most any batching could give on this machine."""
    import jax
    import jax.numpy as jnp
    from pass_floor import dot_flops_per_s

    from clover_jax.commands.generate import default_model, load
    from clover_jax.model import masks, transformer
    from clover_jax.plan.arithmetic import PassShape, analytic_flops

    cfg, weights, _, _ = load(args.model or default_model(), None)
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
        args_ = (weights, jnp.full((b, bl), 5, jnp.int32), transformer.init_cache(cfg, b, s))
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
    from clover_jax.commands.generate import default_model, load
    from clover_jax.sampler import SamplerConfig, generate

    cfg, weights, tok, _ = load(args.model or default_model(), None)
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pass_scaling:
        pass_scaling(args)
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
