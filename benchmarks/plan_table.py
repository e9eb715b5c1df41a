"""`clover plan --generate` over a grid: which (layout, weights, prompt, batch) cells fit, and how fast.

    python benchmarks/plan_table.py                       # the README grid; results appended to plan_table.jsonl
    python benchmarks/plan_table.py --budget-min 40       # start no new cell after 40 minutes
    python benchmarks/plan_table.py --table               # only print the markdown of the results so far

One process compiles every cell in turn (`clover_jax.plan.plan_generate`, the sampler's whole generate
program AOT-compiled for the layout's TPU topology), appending one JSON line per cell, so a run can be
stopped and resumed (cells already in the results file are skipped). A cell is not compiled when a
cell of the same layout and weights with no longer prompt and no larger batch already ran out of HBM:
it needs at least as much (marked "implied" in the results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU topologies through libtpu; run nothing

from clover_jax.config import load_config
from clover_jax.errors import CloverError
from clover_jax.mesh.layouts import load_layout
from clover_jax.plan import plan_generate

LAYOUTS = ("tpu-v5e-8", "tpu-v5p-8", "tpu-v6e-4")
PROMPTS = {"4K": 4096, "32K": 32_768, "128K": None}  # 128K: max_seq_len - gen_len (the longest the model takes)
BATCHES = (1, 8, 32)
QUANT = ("none", "int8")


def cell_key(c: dict[str, Any]) -> tuple:
    return (c["config"], c["quantize"], c["layout"], c["prompt"], c["batch"], c["gen_len"])


def run_cell(config: str, quantize: str, layout: str, prompt: int, batch: int, gen_len: int) -> dict[str, Any]:
    """Plan one cell; the result row (JSON-able)."""
    cfg = load_config(config)
    if quantize != "none":
        cfg = cfg.replace(quantization=quantize)
    row: dict[str, Any] = dict(config=config, quantize=quantize, layout=layout, prompt=prompt, batch=batch,
                               gen_len=gen_len)
    t0 = time.perf_counter()
    try:
        plan = plan_generate(cfg, load_layout(layout), prompt_len=prompt, gen_len=gen_len, batch=batch)
    except CloverError as e:
        row.update(status="error", error=str(e), wall_s=time.perf_counter() - t0)
        return row
    comp = plan.programs[0].compiled
    refine_s, bound = plan.passes["refine"].bound(plan.chip)
    pre_s, decode_s = plan.request_seconds()
    row.update(status="fits" if plan.fits else "does not fit", wall_s=round(time.perf_counter() - t0, 1),
               compile_s=None if comp is None else round(comp.seconds, 1),
               hbm_bytes=None if comp is None or not comp.ok else comp.hbm_bytes,
               compiler_peak=None if comp is None else comp.memory.get("peak_memory_in_bytes"),
               memory=None if comp is None else comp.memory, error=None if comp is None else comp.error,
               chip_hbm=plan.chip.hbm_bytes, weights_per_chip=plan.weights_per_chip, cache_bytes=plan.cache_total,
               cache_per_chip=plan.cache_per_chip, refine_s=refine_s, refine_bound=bound, prefill_s=pre_s,
               decode_s=decode_s, tokens_per_s=plan.tokens_per_s(), method=plan.method, dispatch=plan.dispatch,
               prompt_cols=plan.prompt_cols, cache_columns=plan.cache_columns)
    return row


def implied_by(row: dict[str, Any], done: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A compiled cell that ran out of HBM with no longer prompt and no larger batch, same layout and weights."""
    for d in done:
        if (d["status"] == "does not fit" and d.get("compile_s") is not None and d["config"] == row["config"]
                and d["quantize"] == row["quantize"] and d["layout"] == row["layout"]
                and d["prompt"] <= row["prompt"] and d["batch"] <= row["batch"]):
            return d
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def cell_text(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not run"
    if r["status"] == "error":
        return f"error: {r['error'][:60]}"
    if r["status"] == "fits":
        return f"{_gb(r['hbm_bytes'])}, {r['tokens_per_s']:.0f} tok/s"
    if r.get("implied"):
        return "does not fit (implied)"
    if r.get("hbm_bytes"):  # compiled, but more than the chip's published HBM
        return f"does not fit ({_gb(r['hbm_bytes'])} > {_gb(r['chip_hbm'])})"
    # the TPU compiler's messages count in GiB: "... temporaries (17.05G) exceeds available HBM (15.75G)", or
    # "Ran out of memory in memory space hbm. Used 15.77G of 15.75G hbm."
    m = re.search(r"\(([0-9.]+)([GT])\) exceeds available HBM|Used ([0-9.]+)(G) of [0-9.]+G hbm", r.get("error") or "")
    need = m and float(m[1] or m[3]) * (1024 if (m[2] or m[4]) == "T" else 1)
    return f"does not fit (needs {need * 2**30 / 1e9:.1f} GB)" if need else "does not fit (compiler OOM)"


def markdown(rows: list[dict[str, Any]], config: str, gen_len: int) -> str:
    """One table per weight format: a row per layout and prompt, a column per batch."""
    by = {cell_key(r): r for r in rows}
    prompts = sorted({r["prompt"] for r in rows if r["config"] == config})
    out = []
    for q in QUANT:
        if not any(r["quantize"] == q for r in rows):
            continue
        out.append("\nbf16 weights\n" if q == "none" else f"\n{q} weights (`--quantize {q}`)\n")
        out.append("| layout | prompt | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
        out.append("|---|---|" + "---|" * len(BATCHES))
        present = set(LAYOUTS) | {r["layout"] for r in rows}
        for lay in sorted(present, key=lambda x: (LAYOUTS.index(x) if x in LAYOUTS else len(LAYOUTS), x)):
            for p in prompts:
                cells = [by.get((config, q, lay, p, b, gen_len)) for b in BATCHES]
                out.append(f"| {lay} | {p:,} | " + " | ".join(cell_text(c) for c in cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="clover-35b-a3b")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--quantize", nargs="+", default=list(QUANT))
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS), help="4K 32K 128K, or token counts")
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--results", default="plan_table.jsonl", help="JSON lines, appended to (resumable)")
    ap.add_argument("--budget-min", type=float, default=None, help="start no new cell after this many minutes")
    ap.add_argument("--breadth", action="store_true",
                    help="run the smallest prompt and batch of every layout and weight format first, then the next "
                         "size (default: one layout and format after the other)")
    ap.add_argument("--no-implied", action="store_true", help="compile cells even when a smaller one ran out of HBM")
    ap.add_argument("--table", action="store_true", help="print the markdown of the results and exit")
    args = ap.parse_args()

    path = Path(args.results)
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    if args.table:
        print(markdown(rows, args.config, args.gen_len))
        return 0
    max_len = load_config(args.config).max_seq_len
    prompts = [PROMPTS[p] if p in PROMPTS else int(p) for p in args.prompts]
    prompts = [max_len - args.gen_len if p is None else p for p in prompts]
    done = {cell_key(r) for r in rows}
    t_start = time.monotonic()
    print(f"# {datetime.date.today()}: {args.config}, gen_len {args.gen_len}", flush=True)
    prompts, batches = sorted(prompts), sorted(args.batches)
    cells = [(q, lay, p, b) for q in args.quantize for lay in args.layouts for p in prompts for b in batches]
    if args.breadth:
        cells.sort(key=lambda c: (prompts.index(c[2]) + batches.index(c[3]), prompts.index(c[2]),
                                  args.quantize.index(c[0]), args.layouts.index(c[1])))
    for q, lay, p, b in cells:
        row = dict(config=args.config, quantize=q, layout=lay, prompt=p, batch=b, gen_len=args.gen_len)
        if cell_key(row) in done:
            continue
        if args.budget_min is not None and time.monotonic() - t_start > args.budget_min * 60:
            print(f"budget spent: stopping before {row}", flush=True)
            return 0
        cause = None if args.no_implied else implied_by(row, rows)
        if cause is not None:
            row.update(status="does not fit", implied=f"prompt {cause['prompt']} batch {cause['batch']}")
        else:
            row = run_cell(args.config, q, lay, p, b, args.gen_len)
        rows.append(row)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{q:5s} {lay:10s} prompt {p:>7d} batch {b:>2d}: {cell_text(row)}"
              + (f" (compiled in {row['compile_s']} s, wall {row['wall_s']} s)"
                 if row.get("compile_s") is not None else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
