"""`clover plan`: does a config fit a mesh layout, and what does one denoising pass cost? With
`--generate` / `--serve`: do the whole programs `clover generate` / `clover serve` run fit, and how fast
can they go?

Exit status: 0 when the plan fits the chips' memory, 3 when it does not (2: bad input), so scripts can
branch on it. Long stages (the AOT compile) report their elapsed time every 15 s.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from clover_jax.commands.memory_flags import add_memory_arguments, with_memory_flags
from clover_jax.config import QUANTIZATIONS, ModelConfig, load_config
from clover_jax.errors import PlanError
from clover_jax.mesh.layouts import Layout, load_layout
from clover_jax.model.moe import get_dispatch
from clover_jax.plan import format_plan, format_program_plan, make_plan, plan_generate, plan_serve


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand (--mesh required, --config and the pass-shape flags) to `sub`; it dispatches
    to `run`."""
    p = sub.add_parser(
        "plan", help="per-chip memory and pass cost of a config on a mesh layout (TPU: AOT-compiled, no TPU needed)",
        description="TPU layouts are AOT-compiled for the slice's topology with libtpu (works on a CPU-only host); "
                    "GPU/CPU layouts are planned by arithmetic. Exit status 0: it fits; 3: it does not fit.")
    p.add_argument("--config", "--model", dest="config", default="clover-35b-a3b",
                   help="preset name, config.json path or checkpoint directory (a quantized one plans its weights)")
    p.add_argument("--mesh", required=True, help="mesh layout: a name from sharding/ (e.g. tpu-v5e-8) or a .toml path")
    p.add_argument("--batch", type=int, default=None, help="sequences per pass (default: the data-parallel size)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="canvas / KV-cache length in tokens (default: 4096, or the config's max_seq_len if smaller)")
    p.add_argument("--block", type=int, default=None, help="block length (default: the config's block_size)")
    p.add_argument("--dispatch", default=None,
                   help="MoE dispatch to compile (ep_gather, ep_a2a, ep_ragged_a2a, ragged, ...; default: ep_gather "
                        "for the pass plan, the sampler's / engine's own choice for --generate / --serve)")
    p.add_argument("--chip", default=None, help="chip for the roofline if the layout names none (v5e, v5p, v6e, "
                                                "h100, h200)")
    p.add_argument("--dtype", default=None, help="override the config's dtype (e.g. bfloat16)")
    p.add_argument("--quantize", default=None, choices=QUANTIZATIONS,
                   help="plan the config with weight-only int8 / fp8 matmul weights (default: the config's own)")
    p.add_argument("--no-compile", action="store_true", help="TPU layouts: arithmetic only, skip the AOT compile")
    p.add_argument("--coreset", type=int, default=None, metavar="M",
                   help="the block expert coreset: a block being denoised routes among M experts (0: off; default: "
                        "the config's moe_block_coreset); changes the roofline's expert reads")
    whole = p.add_argument_group(
        "whole programs", "compile what runs instead of two single passes: the sampler's whole generate loop, or "
                          "the serving engine's block and prefill programs")
    mode = whole.add_mutually_exclusive_group()
    mode.add_argument("--generate", action="store_true",
                      help="plan `clover generate`: the sampler's compiled loop for --batch prompts of --prompt-len "
                           "tokens and --gen-len new ones")
    mode.add_argument("--serve", action="store_true",
                      help="plan `clover serve`: the engine's block program for --batch rows (prompts up to "
                           "--prompt-len, up to --gen-len new tokens) and its widest prefill program")
    whole.add_argument("--prompt-len", type=int, default=None,
                       help="prompt tokens (--serve: the longest prompt; default 4096, or what fits the config's "
                            "max_seq_len with --gen-len)")
    whole.add_argument("--gen-len", type=int, default=None, help="generated tokens (--serve: the most; default 128)")
    whole.add_argument("--cache", default="auto", choices=("auto", "none", "prefix", "dual"),
                       help="the sampler's cache mode (default auto: prefix for block-causal models, else none)")
    add_memory_arguments(whole)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan the config on the mesh layout and print the report."""
    cfg = load_config(args.config)
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    if args.quantize:
        cfg = cfg.replace(quantization=args.quantize)
    if args.coreset is not None:
        try:
            cfg = cfg.replace(moe_block_coreset=args.coreset)
        except ValueError as e:
            raise PlanError(f"--coreset: {e}") from None
    cfg = with_memory_flags(cfg, args)
    layout = load_layout(args.mesh)
    if args.generate or args.serve:
        return run_program_plan(args, cfg, layout)
    given = [f for f, v in (("--prompt-len", args.prompt_len), ("--gen-len", args.gen_len)) if v is not None]
    if given or args.cache != "auto":
        raise PlanError(f"{', '.join(given) or '--cache'} plan{'s' if len(given) < 2 else ''} a whole program: "
                        "add --generate or --serve")
    seq_len = min(4096, cfg.max_seq_len) if args.seq_len is None else args.seq_len
    if seq_len <= 0 or (args.batch is not None and args.batch <= 0):
        raise PlanError("--seq-len and --batch must be positive")
    with stages() as stage:
        plan = make_plan(cfg, layout, batch=args.batch, seq_len=seq_len, block=args.block,
                         dispatch=args.dispatch or "ep_gather", compile_tpu=not args.no_compile, chip=args.chip,
                         progress=stage)
    print(format_plan(plan))
    return 0 if plan.fits else 3


def run_program_plan(args: argparse.Namespace, cfg: ModelConfig, layout: Layout) -> int:
    """`--generate` / `--serve`: compile the whole program for the layout and print its report; 0 when it
    fits, 3 when it does not (bad sizes raise a CloverError: exit 2)."""
    if args.seq_len is not None:
        raise PlanError("--seq-len sizes the pass plan; with --generate / --serve give --prompt-len and --gen-len")
    if args.dispatch is not None:
        try:
            get_dispatch(args.dispatch)
        except ValueError as e:
            raise PlanError(str(e)) from e
    gen_len = 128 if args.gen_len is None else args.gen_len
    prompt_len = min(4096, cfg.max_seq_len - gen_len) if args.prompt_len is None else args.prompt_len
    plan_fn = plan_generate if args.generate else plan_serve
    with stages() as stage:
        plan = plan_fn(cfg, layout, prompt_len=prompt_len, gen_len=gen_len, batch=args.batch, block=args.block,
                       cache=args.cache, dispatch=args.dispatch, compile_tpu=not args.no_compile, chip=args.chip,
                       progress=stage)
    print(format_program_plan(plan))
    return 0 if plan.fits else 3


@contextmanager
def stages(every_s: float = 15.0) -> Iterator[object]:
    """A progress function for `make_plan`: prints each stage, then its elapsed time every `every_s`
    seconds until the next stage starts or the block ends."""
    current: list[tuple[str, float]] = []
    done = threading.Event()

    def stage(name: str) -> None:
        current[:] = [(name, time.monotonic())]
        print(f"[plan] {name} ...", file=sys.stderr, flush=True)

    def tick() -> None:
        while not done.wait(every_s):
            if current:
                name, t0 = current[0]
                print(f"[plan] {name} ... {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield stage
    finally:
        done.set()
        thread.join()
