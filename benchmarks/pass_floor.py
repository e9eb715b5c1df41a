"""A cached block pass against the memory-bandwidth floor of the bytes it reads.

    python benchmarks/pass_floor.py                      # medium shape, batch 1 and 8, block 32, 288 cached columns
    python benchmarks/pass_floor.py --batch 1 --context 1056 --runs 30

The pass is what the sampler's `prefix` / `dual` cache modes run for every refinement step: one block of
`--block` tokens per row against a K/V cache of `--context` columns (the medium shape of
benchmarks/vs_reference.py: prompt 32 + gen 256), logits for the block only. At these sizes it is
bound by memory traffic, not arithmetic: it reads every weight once (the experts the block's tokens
are routed to, counted from the pass's own routing), the cache, and the LM head.

Printed per batch: the pass's time (median of `--runs` passes run back to back inside one jitted
`lax.fori_loop`, and as separately dispatched jitted calls), the bytes it touches, the machine's read
bandwidth (a jitted float32 sum over a `--probe-mb` array, best of 5, so that the figure is what XLA
reaches here, not a datasheet's), the memory floor = bytes / bandwidth, the pass's FLOPs and the compute
floor = FLOPs / what a jitted dense dot of the LM head's shape reaches here, and the ratio of the pass to
the larger floor.
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--context", type=int, default=288, help="cached columns the block attends to")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--probe-mb", type=int, default=1024, help="size of the bandwidth probe's array")
    p.add_argument("--dispatch", default=None, help="MoE dispatch (default: the config's)")
    args = p.parse_args(argv)
    for name in ("block", "context", "runs", "probe_mb"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.context < args.block:
        p.error("--context must hold the block")
    return args


def best_seconds(fn, *args, tries: int = 5) -> float:
    """The fastest of `tries` warm calls of jitted `fn(*args)` (one call first, to compile)."""
    import jax

    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth(mb: int) -> float:
    """Bytes per second of a jitted float32 sum over an `mb` MiB array (best of 5)."""
    import jax.numpy as jnp

    x = jnp.ones((mb * 2**20 // 4,), jnp.float32)
    return x.nbytes / best_seconds(jnp.sum, x)


def dot_flops_per_s(rows: int, d: int, v: int) -> float:
    """FLOP/s of a jitted float32 [rows, d] @ [d, v] here (best of 5): what a dense dot of the LM head's
    shape reaches, the pass's compute ceiling."""
    import jax.numpy as jnp

    return 2 * rows * d * v / best_seconds(jnp.dot, jnp.ones((rows, d), jnp.float32), jnp.ones((d, v), jnp.float32))


def pass_flops(cfg, batch: int, block: int, context: int) -> int:
    """Multiply-adds x 2 of one block pass: projections, attention over the cache, router, the routed
    experts (top-k copies of every token) and the LM head over the block."""
    t = batch * block
    d, hd = cfg.d_model, cfg.head_dim
    proj = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    attn = 2 * context * cfg.n_heads * hd
    experts = cfg.n_experts_per_tok * 3 * d * cfg.expert_mlp_dim + d * cfg.n_experts
    return 2 * (t * cfg.n_layers * (proj + attn + experts) + t * d * cfg.vocab_size)


def touched_bytes(weights, cfg, load, batch: int, block: int, context: int) -> tuple[dict[str, int], int]:
    """What one block pass reads: every non-expert weight except the embedding table (only `batch x
    block` rows of it), the experts with routed tokens (`load` [layers, experts] > 0), the K/V cache.
    Returns (bytes by part, experts hit)."""
    import jax
    import numpy as np

    size = lambda tree: sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))
    mlp = weights.moe_layers.mlp
    per_expert = (size(mlp.gate) + size(mlp.up) + size(mlp.down)) // (cfg.n_layers * cfg.n_experts)
    hit = int(np.sum(np.asarray(load) > 0))
    rest = size(weights.moe_layers.replace(mlp=mlp.replace(gate=None, up=None, down=None)))
    head = size(weights.lm_head if weights.lm_head is not None else weights.embed)
    itemsize = np.dtype(cfg.dtype).itemsize
    cache = 2 * cfg.n_layers * batch * context * cfg.n_kv_heads * cfg.head_dim * itemsize
    embed_rows = batch * block * cfg.d_model * itemsize
    return {"experts": hit * per_expert, "attention, router, norms": rest, "lm head": head, "kv cache": cache,
            "embedding rows": embed_rows}, hit


def time_block_pass(cfg, weights, b: int, s: int, bl: int, dispatch: str | None, runs: int):
    """(ms per pass inside one fori_loop, median ms per separately dispatched call, the pass's MoE
    statistics) of one block of `bl` tokens per row against a cache of `s` columns filled by a prefill."""
    import jax
    import jax.numpy as jnp

    from clover_jax.model import init_cache, transformer

    cache = init_cache(cfg, b, s)
    ctx = jax.random.randint(jax.random.key(b), (b, s), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    prefill = jax.jit(lambda w, c: transformer.forward(w, cfg, ctx, pos, jnp.ones((b, s, s), bool), c, 0,
                                                       logits_start=0, logits_len=bl, dispatch=dispatch).cache)
    cache = prefill(weights, cache)
    lo = s - bl
    toks, bpos, mask = ctx[:, lo:], pos[:, lo:], jnp.ones((b, bl, s), bool)

    def one(w, c, t):
        out = transformer.forward(w, cfg, t, bpos, mask, c, lo, logits_start=0, logits_len=bl, dispatch=dispatch)
        return out.logits, out.cache, out.moe_stats

    def loop(w, c, t, n):
        def body(_, carry):
            c, acc = carry
            logits, c, _ = one(w, c, t)
            return c, acc + logits[:, 0, 0]
        return jax.lax.fori_loop(0, n, body, (c, jnp.zeros((b,), jnp.float32)))[1]

    single = jax.jit(one)
    _, _, stats = single(weights, cache, toks)
    looped = jax.jit(loop, static_argnums=3)
    looped(weights, cache, toks, runs).block_until_ready()
    times_loop = []
    for _ in range(3):
        t = time.perf_counter()
        looped(weights, cache, toks, runs).block_until_ready()
        times_loop.append((time.perf_counter() - t) / runs)
    times_call = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(single(weights, cache, toks))
        times_call.append(time.perf_counter() - t)
    return min(times_loop) * 1e3, statistics.median(times_call) * 1e3, stats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import forward as fwd_bench
    import jax

    from clover_jax.model.params import init

    cfg = fwd_bench.make_config(fwd_bench.parse_args([]))
    weights = init(cfg, jax.random.key(0))
    bw = read_bandwidth(args.probe_mb)
    print(f"{cfg.n_layers} layers, d {cfg.d_model}, {cfg.n_experts} experts top-{cfg.n_experts_per_tok} width "
          f"{cfg.expert_mlp_dim}, vocab {cfg.vocab_size}, fp32; block {args.block} against {args.context} cached "
          f"columns; read bandwidth {bw / 1e9:.1f} GB/s ({args.probe_mb} MiB jitted sum, best of 5); "
          f"{os.cpu_count()} cores, jax {jax.__version__} on {jax.default_backend()}", flush=True)
    print("floor = the larger of bytes touched / read bandwidth and the pass's FLOPs / a dense dot's FLOP/s at "
          "the LM head's shape (measured here per batch)")
    print(f"{'batch':>5} {'pass ms (loop)':>15} {'pass ms (calls)':>16} {'MB touched':>11} {'experts hit':>12} "
          f"{'memory ms':>10} {'GFLOP':>6} {'dot GFLOP/s':>12} {'compute ms':>11} {'ratio':>6}")
    for b in args.batch:
        s, bl = args.context, args.block
        ms_loop, ms_call, stats = time_block_pass(cfg, weights, b, s, bl, args.dispatch, args.runs)
        parts, hit = touched_bytes(weights, cfg, stats.load, b, bl, s)
        total = sum(parts.values())
        mem = total / bw
        flops = pass_flops(cfg, b, bl, s)
        peak = dot_flops_per_s(b * bl, cfg.d_model, cfg.vocab_size)
        floor = max(mem, flops / peak)
        print(f"{b:>5} {ms_loop:>15.1f} {ms_call:>16.1f} {total / 1e6:>11.0f} "
              f"{hit:>5}/{cfg.n_layers * cfg.n_experts:<6} {mem * 1e3:>10.1f} {flops / 1e9:>6.2f} {peak / 1e9:>12.1f} "
              f"{flops / peak * 1e3:>11.1f} {ms_loop / 1e3 / floor:>6.2f}")
        print("      bytes: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in parts.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
