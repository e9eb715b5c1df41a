"""`clover eval`: score a checkpoint on lm-evaluation-harness tasks (the `eval` extra).

    clover eval --tasks hellaswag --limit 100
    clover eval --model DIR --tasks my_task --include-path tasks/ --model-args mc_num=64,batch_size=16 --output r.json

A thin wrapper of `lm_eval.simple_evaluate` with the `clover` model (clover_jax.evaluation.harness): it prints
lm-eval's table, the Monte-Carlo standard error of the likelihood estimates, and writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from clover_jax import shipped
from clover_jax.errors import UsageError
from clover_jax.paths import unwritable_reason

EXTRA_MISSING = "clover eval needs lm-evaluation-harness: pip install 'clover-jax[eval]'"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `eval` subcommand to `sub`; it dispatches to `run`."""
    p = sub.add_parser("eval", help="score a checkpoint on lm-evaluation-harness tasks",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped clover-tiny model)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="a directory of extra task YAMLs")
    p.add_argument("--no-builtin-tasks", action="store_true",
                   help="only the tasks of --include-path (skips indexing lm-eval's own thousands of task files)")
    p.add_argument("--limit", type=float, default=None,
                   help="at most this many items per task (below 1: a fraction of each task)")
    p.add_argument("--model-args", default="",
                   help="k=v,... for the model: mc_num, batch_size, cfg, check_greedy, seed, max_length, gen_length, "
                        "block_length, steps, threshold, cache, remasking, temperature, apply_chat_template")
    p.add_argument("--output", default=None, help="write the results here as JSON")
    p.set_defaults(func=run)


def _harness() -> Any:
    """clover_jax.evaluation.harness; UsageError (one line) when lm-eval is not installed."""
    try:
        import lm_eval  # noqa: F401

        from clover_jax.evaluation import harness
    except ImportError as e:
        if (e.name or "").split(".")[0] == "lm_eval":
            raise UsageError(EXTRA_MISSING) from None
        raise
    return harness


def error_summary(estimates: list[tuple[str, Any]]) -> dict[str, dict[str, float]]:
    """Per request kind: how many estimates, and the median and largest Monte-Carlo standard error (nats)."""
    out = {}
    for kind in sorted({k for k, _ in estimates}):
        se = np.asarray([e.stderr for k, e in estimates if k == kind], float)
        out[kind] = {"count": int(se.size), "stderr_median": float(np.nanmedian(se)),
                     "stderr_max": float(np.nanmax(se))}
    return out


def run(args: argparse.Namespace) -> int:
    """Check the flags, build the model and the tasks, evaluate, print and write the results."""
    if args.output:
        if os.path.isdir(args.output):
            raise UsageError(f"--output {args.output!r} is a directory; name a .json file")
        if reason := unwritable_reason(os.path.abspath(args.output)):
            raise UsageError(f"--output {args.output!r}: {reason}")
    if args.include_path and not os.path.isdir(args.include_path):
        raise UsageError(f"--include-path {args.include_path!r} is not a directory")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit must be positive, got {args.limit}")
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise UsageError("--tasks names no task")
    harness = _harness()
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table, simple_parse_args_string

    model = args.model or str(shipped.MODEL_DIR)
    if "pretrained" in simple_parse_args_string(args.model_args):
        raise UsageError("give the checkpoint with --model, not pretrained= in --model-args")
    harness.register()
    lm = harness.CloverLM(pretrained=model, **simple_parse_args_string(args.model_args))
    if args.no_builtin_tasks and not args.include_path:
        raise UsageError("--no-builtin-tasks needs --include-path")
    manager = TaskManager(include_path=args.include_path, include_defaults=not args.no_builtin_tasks)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UsageError(f"unknown task(s): {', '.join(unknown)} (see `lm-eval ls tasks`, or pass --include-path)")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=False)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    summary = error_summary(lm.estimates)
    for kind, s in summary.items():
        print(f"{kind}: {s['count']} estimates, Monte-Carlo standard error median {s['stderr_median']:.3f}, "
              f"max {s['stderr_max']:.3f} nats (mc_num={lm.settings.mc_num})")
    if args.output:
        results["clover"] = {"model": model, "model_args": args.model_args, "mc_num": lm.settings.mc_num,
                             "likelihood_error": summary}
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2, default=handle_non_serializable)
        print(f"clover eval: results written to {args.output}", file=sys.stderr)
    return 0
