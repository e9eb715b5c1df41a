"""Requests per second of the lm-eval model `clover` on this machine: loglikelihood and generate_until.

For each batch size it runs the requests once to compile every program they need, then times the harness's own
`loglikelihood` / `generate_until` over --requests requests from the local Shakespeare tasks and reports
requests/s and the share of that time spent in compiled work (the estimator's passes, the sampler's loop);
the rest is tokenising, laying out and the Python around them.

    python benchmarks/eval.py --requests 16 --mc-num 8 --gen-length 32
    (--checkpoint DIR for another model; default: the shipped clover-tiny)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

TASKS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "eval_tasks"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="native checkpoint (default: the shipped clover-tiny)")
    p.add_argument("--requests", type=int, default=16, help="requests timed per kind and batch size")
    p.add_argument("--mc-num", type=int, default=8, help="Monte-Carlo samples per likelihood")
    p.add_argument("--gen-length", type=int, default=32, help="tokens generated per request")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated rows per forward pass")
    args = p.parse_args(argv)

    import clover_jax.evaluation.harness as harness
    from clover_jax.evaluation.harness import CloverLM
    from clover_jax.sampler import generate as sampler_generate

    rows = [json.loads(x) for x in (TASKS / "shakespeare_next_line.jsonl").read_text().splitlines()]
    ll_reqs = [SimpleNamespace(args=(r["context"], r["choices"][r["label"]])) for r in rows]
    gen_reqs = [SimpleNamespace(args=(r["context"], {"until": ["\n\n"], "max_gen_toks": args.gen_length}))
                for r in rows]
    print("| kind | batch | requests | requests/s | share in compiled work |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        lm = CloverLM(pretrained=args.checkpoint, mc_num=max(args.mc_num, batch), batch_size=batch)
        # loglikelihood: the same requests twice, the first run compiling every width they use
        lm.loglikelihood(ll_reqs[:args.requests], disable_tqdm=True)
        lm.estimates.clear()
        t0 = time.perf_counter()
        lm.loglikelihood(ll_reqs[:args.requests], disable_tqdm=True)
        wall = time.perf_counter() - t0
        compiled = sum(e.compute_s for _, e in lm.estimates)
        print(f"| loglikelihood (mc_num {lm.settings.mc_num}) | {batch} | {args.requests} | "
              f"{args.requests / wall:.2f} | {compiled / wall:.0%} |")
        # generate_until: the sampler's own wall time (its compiled loop) against the harness's
        loop = [0.0]

        def timed(*a, _inner=sampler_generate, _loop=loop, **k):
            res = _inner(*a, **k)
            _loop[0] += res.stats.wall_s
            return res

        harness.generate = timed
        try:
            lm.generate_until(gen_reqs[:args.requests], disable_tqdm=True)  # compiles every bucket they use
            loop[0] = 0.0
            t0 = time.perf_counter()
            lm.generate_until(gen_reqs[:args.requests], disable_tqdm=True)
            wall = time.perf_counter() - t0
        finally:
            harness.generate = sampler_generate
        print(f"| generate_until ({args.gen_length} tokens) | {batch} | {args.requests} | "
              f"{args.requests / wall:.2f} | {loop[0] / wall:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
