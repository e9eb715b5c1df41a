"""Long prompts on the shipped clover-tiny: prefill time and peak memory, then generation speed.

    python benchmarks/long_context.py                          # prompts of 2K, 16K, 32K, 64K and 128K tokens
    python benchmarks/long_context.py --sizes 2048 16384       # a choice of sizes
    python benchmarks/long_context.py --sizes --runs 5         # only the 16K comparison (table 2)

Table 1, one subprocess per prompt size (one at a time; "RSS GB" is its peak `ru_maxrss`): the sampler
(`clover_jax.sampler.generate`, cache=prefix, 64 tokens in blocks of 32, one token a pass) on one random
prompt. "prefill s" is the prompt's prefill inside that program (the time to the first refinement pass
minus one pass), "gen tok/s" the 64 tokens after it (timed between the sampler's progress callbacks);
best of `--runs` calls of the compiled program (one call above 16K). The sampler drops the prefill's
logits, so XLA drops what only they need: clover-tiny's one attention layer is its last, so its prefill is
the three Gated DeltaNet layers with their MoE and the attention layer's K/V (no [prompt, prompt] scores).
The prompt is prefilled in windows of `--prefill-chunk` columns through the cache (ModelConfig.prefill_chunk,
default the model's 4,096; exact); `--prefill-chunk 0` prefills it in one pass.

Table 2, at `--compare-size` (16K): the same sampler runs for three forms of the Gated DeltaNet layers: the shipped
weights read as the earlier reconstruction's block diffusion (bd_gdn="reconstructed", whose prompt runs the
block-diffusion mixer; the shipped model itself reads its prompt causally, as the third row does) with its delta
rule as it runs on a CPU (the position-by-position scan `delta_rule_blocks` at every width: `delta_rule.CPU_SCAN`),
the same forced onto the chunked form accelerators run (`delta_rule_blocks_chunked`, above
`delta_rule.BLOCKS_SCAN_MAX` = 256 columns), and the same weights as the plain causal Gated DeltaNet (bd_gdn="none",
`delta_rule_chunked`); then, in one process with the three taken in turns (the machine is shared), one
Gated DeltaNet layer's mixer over the whole prompt and its delta rule alone (best of `--runs`).
Table 3 (`--attention-sizes`, default 2K .. 16K): the same sampler on an all-attention model of the same size
(`clover-tiny-attention`: clover-tiny with its three Gated DeltaNet layers made attention layers; random weights),
with attention chunked (`attention_impl: auto`, the default: a prompt longer than 1,024 columns is attended in
chunks with an online softmax) and dense (its whole [heads, prompt, cache] float32 scores at once).
Prints the tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["CLOVER_COMPILE_CACHE"] = "off"  # the scan mode changes a module constant, not the program's key

MODES = {"scan": "block diffusion (scan: CPU default)", "chunked": "block diffusion, chunked",
         "plain": "plain causal GDN (bd_gdn=none)"}
ATTENTION_MODES = {"attention-auto": "auto", "attention-dense": "dense"}  # table 3: attention_impl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="*", default=[2048, 16384, 32768, 65536, 131072],
                   help="prompt lengths in tokens, multiples of 32 (none: only table 2)")
    p.add_argument("--no-compare", action="store_true", help="skip table 2")
    p.add_argument("--compare-size", type=int, default=16384)
    p.add_argument("--runs", type=int, default=3, help="timed runs per figure up to 16K tokens (best of)")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill in windows of this many columns (default: the model's, 4096; 0: one pass)")
    p.add_argument("--attention-sizes", type=int, nargs="*", default=[2048, 8192, 16384],
                   help="prompt lengths for table 3, the all-attention model chunked and dense (none: skip it)")
    p.add_argument("--worker", nargs=3, metavar=("KIND", "MODE", "SIZE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _model(mode: str, length: int):
    """The shipped clover-tiny as `mode` runs it, max_seq_len raised to `length` (table 2's modes: its weights read
    as the earlier reconstruction's block diffusion, or as the plain causal Gated DeltaNet). The chunked mode clears
    delta_rule.CPU_SCAN, which functions traced afterwards read."""
    from clover_jax import load_model
    from clover_jax.model import delta_rule
    from clover_jax.shipped import MODEL_DIR

    if mode in ATTENTION_MODES:
        import jax

        from clover_jax.config import get_config
        from clover_jax.model import params

        cfg = get_config("clover-tiny-attention").replace(max_seq_len=length, attention_impl=ATTENTION_MODES[mode])
        return cfg, params.init(cfg, jax.random.key(0))
    delta_rule.CPU_SCAN = mode != "chunked"
    cfg, weights = load_model(str(MODEL_DIR))
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, length))
    if mode == "shipped":  # table 1: the model as it is shipped
        return cfg, weights
    # the block-diffusion forms are the earlier reconstruction's reading of the prompt (the shipped model reads its
    # prompt through the plain causal path, the "plain" row)
    return cfg.replace(bd_gdn="none" if mode == "plain" else "reconstructed"), weights


def run_sampler(mode: str, size: int, args: argparse.Namespace) -> dict:
    """Prefill + generation of one random prompt through the sampler program (see the module docstring)."""
    import numpy as np

    from clover_jax.sampler import SamplerConfig, generate

    g, bl = args.gen_length, args.block_length
    cfg, weights = _model(mode, size + 2 * g + bl)
    if args.prefill_chunk is not None:
        cfg = cfg.replace(prefill_chunk=args.prefill_chunk)
    chunk = cfg.prefill_chunk if 0 < cfg.prefill_chunk < size else size
    sc = SamplerConfig(gen_length=g, block_length=bl, steps=g, cache="prefix", eos_stop=False)
    prompt = np.random.default_rng(size).integers(4, cfg.vocab_size, size).tolist()
    best: dict = {}
    for _ in range(args.runs if size <= 16384 else 1):
        stamps: list[float] = []
        res = generate(weights, cfg, [prompt], sc,
                       progress=lambda toks, blk, nfe, s=stamps: s.append(time.perf_counter()))
        start = time.perf_counter() - res.stats.wall_s  # when the compiled program started (generate times it)
        per_pass = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        prefill = stamps[0] - start - per_pass
        if not best or prefill < best["prefill_s"]:
            best.update(prefill_s=prefill, compile_s=best.get("compile_s", res.stats.compile_s), chunk=chunk)
        best["gen_tps"] = max(best.get("gen_tps", 0.0), (len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return best


def run_compare(size: int, args: argparse.Namespace) -> dict:
    """Seconds of the model's first Gated DeltaNet mixer over a whole prompt (random hidden states), and of its
    delta rule alone (random inputs of its shape), per mode, the modes taken in turns; best of `args.runs`."""
    import jax
    import jax.numpy as jnp

    from clover_jax.model import delta_rule as dr
    from clover_jax.model import gated_deltanet as gdn
    from clover_jax.model import masks

    calls = {}
    for mode in MODES:
        cfg, weights = _model(mode, size)  # (sets CPU_SCAN for the functions traced here)
        valid = jnp.ones((1, size), bool)
        blocks = masks.block_ids(cfg, valid)
        x = jax.random.normal(jax.random.key(0), (1, size, cfg.d_model))
        one = jax.tree.map(lambda a: a[0], weights.linear_layers.attn)
        mixer = jax.jit(lambda x, w, cfg=cfg, valid=valid, blocks=blocks: gdn.mixer(x, w, cfg, valid, None, blocks))
        keys = jax.random.split(jax.random.key(1), 5)
        hk, dk, (hv, _, dv) = cfg.linear_num_key_heads, cfg.linear_key_head_dim, gdn.initial_shape(cfg)
        st = dr.Stream(dr.l2_normalize(jax.random.normal(keys[0], (1, size, hk, dk))),
                       dr.l2_normalize(jax.random.normal(keys[1], (1, size, hk, dk))),
                       jax.random.normal(keys[2], (1, size, hv, dv)),
                       -jax.random.uniform(keys[3], (1, size, hv), minval=0.01, maxval=0.5),
                       jax.random.uniform(keys[4], (1, size, hv), minval=0.05, maxval=0.95))
        rule = (jax.jit(lambda s: dr.delta_rule_chunked(*s)) if mode == "plain" else
                jax.jit(lambda s, blocks=blocks, valid=valid, c=cfg: dr.blocks_rule(
                    size, c.block_size, inference=True)(s, blocks, valid, history=True)))
        for f, a in ((mixer, (x, one)), (rule, (st,))):
            jax.block_until_ready(f(*a))  # compile
        calls[mode] = ((mixer, (x, one)), (rule, (st,)))
    best = {m: [float("inf"), float("inf")] for m in MODES}
    for _ in range(args.runs):
        for mode, fs in calls.items():
            for j, (f, a) in enumerate(fs):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*a))
                best[mode][j] = min(best[mode][j], time.perf_counter() - t0)
    return best


def worker(kind: str, mode: str, size: int, args: argparse.Namespace) -> int:
    out = run_sampler(mode, size, args) if kind == "sampler" else run_compare(size, args)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print("RESULT " + json.dumps({"rss_gb": rss, "out": out}), flush=True)
    return 0


def spawn(kind: str, mode: str, size: int, argv: list[str]) -> dict:
    """One worker subprocess: its RESULT, or {"error": ...}."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", kind, mode, str(size)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return {"error": f"exit {proc.returncode}: {tail[:160]}"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        kind, mode, size = args.worker
        return worker(kind, mode, int(size), args)
    import jax

    print(f"clover-tiny (shipped), backend {jax.default_backend()}, {os.cpu_count()} cores; sampler: "
          f"{args.gen_length} tokens in blocks of {args.block_length}, one a pass, cache=prefix, batch 1", flush=True)
    if args.sizes:
        head = f"{'prompt':>7} {'chunk':>6} {'prefill s':>9} {'RSS GB':>6} {'gen tok/s':>9} {'compile s':>9}"
        print(f"\n{head}\n{'-' * len(head)}", flush=True)
        for size in args.sizes:
            r = spawn("sampler", "shipped", size, argv)
            if "error" in r:
                print(f"{size:7d}  {r['error']}", flush=True)
                continue
            o = r["out"]
            print(f"{size:7d} {o['chunk']:6d} {o['prefill_s']:9.2f} {r['rss_gb']:6.2f} {o['gen_tps']:9.1f} "
                  f"{o['compile_s']:9.1f}", flush=True)
    if args.attention_sizes:
        head = f"{'all-attention, attention':28} {'prompt':>7} {'prefill s':>9} {'RSS GB':>6} {'gen tok/s':>9}"
        print(f"\n{head}\n{'-' * len(head)}", flush=True)
        for size in args.attention_sizes:
            for mode, impl in ATTENTION_MODES.items():
                r = spawn("sampler", mode, size, argv)
                o = r.get("out")
                row = (f"{o['prefill_s']:9.2f} {r['rss_gb']:6.2f} {o['gen_tps']:9.1f}" if o else r.get("error", ""))
                print(f"{impl:28} {size:7d} {row}", flush=True)
    if args.no_compare:
        return 0
    size = args.compare_size
    rows = {m: spawn("sampler", m, size, argv) for m in MODES}
    cmp = spawn("compare", "all", size, argv)
    head = (f"{'at ' + str(size) + ' tokens':32} {'prefill s':>9} {'RSS GB':>6} {'gen tok/s':>9} "
            f"{'mixer s':>7} {'rule s':>7}")
    print(f"\n{head}\n{'-' * len(head)}", flush=True)
    for mode, r in rows.items():
        o = r.get("out", {})
        c = cmp.get("out", {}).get(mode, [float("nan")] * 2)
        pre = f"{o['prefill_s']:9.2f} {r['rss_gb']:6.2f} {o['gen_tps']:9.1f}" if o else f"{r.get('error', '')}"
        print(f"{MODES[mode]:32} {pre} {c[0]:7.3f} {c[1]:7.3f}", flush=True)
    if "error" in cmp:
        print(f"mixer / rule timings: {cmp['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
