"""Our sampler against the official LLaDA and Fast-dLLM generate functions, on the same weights.

    python benchmarks/vs_reference.py --llada-repo /tmp/ref/llada --fastdllm-repo /tmp/ref/fastdllm
    python benchmarks/vs_reference.py --llada-repo ... --fastdllm-repo ... --tiny --runs 1   # quick check
    python benchmarks/vs_reference.py --llada-repo ... --fastdllm-repo ... --checkpoint HF_DIR  # trained model

`--llada-repo` is a checkout of ML-GSAI/LLaDA (its generate.py), `--fastdllm-repo` one of NVlabs/Fast-dLLM
(its llada/generate.py, or that llada/ folder itself). Their functions are imported from there, never copied,
and called on transformers' `Qwen3MoeForCausalLM` made bidirectional (a full 4-D boolean mask; the
adapters are in benchmarks/reference_harness.py). Our side loads the very same weights the way a user
does: the HF model is saved with save_pretrained, converted by `clover convert`
(`clover_jax.convert.convert`) and loaded by `clover_jax.checkpoint.load_model`.

Default model ("medium"): 8 layers, d 512, 8 x 64 query heads, 4 KV heads, 32 experts top-4 of width 256,
vocab 32000, float32, random weights (initializer range `--init-range`); `--tiny` is 2 layers, d 64, 8
experts top-2, vocab 256, and shorter generations. `--checkpoint DIR` runs a trained HF Qwen3-MoE instead
(thresholds only fire on a trained model; tokens per pass are printed for both sides).

Tables (greedy, low-confidence remasking, EOS never stops a row):
  (a) equal settings and passes: LLaDA `generate` (no cache) vs ours cache=none, gen 128, block 32, 128
      steps, batch 1 and 8; Fast-dLLM generate / generate_with_prefix_cache / generate_with_dual_cache vs
      ours none / prefix / dual, batch 1, gen 256, block 32, one token a step;
  (b) each side's fastest mode: Fast-dLLM dual cache + threshold vs ours dual + threshold (`--best-modes`
      adds prefix), with the agreement of each with the uncached greedy run of its own side.
Our threshold rule is "the scheduled top-n plus every masked position above the threshold", which is
Fast-dLLM's "top-1 plus every position at or above it" when one token is scheduled a step (steps = gen).

Every figure is over `--runs` interleaved runs (ours, theirs, ours, theirs, ...), median and [min-max],
after one warm-up call of each program (ours: the compiled program at those shapes; theirs: the same
call). Times are the wall clock of the whole generate call on both sides (our `compile_s` is excluded by
the warm-up). `equal` is the fraction of generated positions where the two sides' tokens agree; torch
runs with the thread count the start-up probe found faster (1 or all cores: on a busy machine all
cores can be several times slower). Prints figures, asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MEDIUM = {"layers": 8, "d_model": 512, "heads": 8, "kv_heads": 4, "head_dim": 64, "experts": 32, "top_k": 4,
          "expert_width": 256, "vocab": 32000}
TINY = {"layers": 2, "d_model": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 8, "top_k": 2,
        "expert_width": 32, "vocab": 256}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llada-repo", type=Path, required=True, help="checkout of ML-GSAI/LLaDA (holds generate.py)")
    p.add_argument("--fastdllm-repo", type=Path, required=True,
                   help="checkout of NVlabs/Fast-dLLM (holds llada/generate.py) or its llada/ folder")
    p.add_argument("--checkpoint", type=Path, default=None, help="a trained HF Qwen3-MoE directory instead of "
                                                                 "random weights")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="with --checkpoint: the mask id (default: config.json's, else the converter's: the last id)")
    p.add_argument("--prompt", default=None, help="with --checkpoint: a prompt text for its tokenizer (default: "
                                                  "random ids)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and short generations: a quick check")
    for name, val in MEDIUM.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {val} (--tiny: "
                                                                                   f"{TINY[name]})")
    p.add_argument("--init-range", type=float, default=0.1, help="std of the random weights (peaked logits, so "
                                                                 "near-ties between the sides are rare)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--llada-gen", type=int, default=None, help="LLaDA rows' gen length = steps (default 128; "
                                                               "--tiny 64)")
    p.add_argument("--fast-gen", type=int, default=None, help="Fast-dLLM rows' gen length (default 256; --tiny 64)")
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--llada-batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--best-modes", nargs="+", default=["dual"], choices=["prefix", "dual"],
                   help="cache modes of table (b), each with the threshold on both sides")
    p.add_argument("--parts", nargs="+", default=["llada", "fastdllm", "best"], choices=["llada", "fastdllm", "best"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dispatch", default=None, help="our MoE dispatch (default: the config's)")
    p.add_argument("--torch-threads", type=int, default=0, help="0: probe 1 vs all cores and take the faster")
    args = p.parse_args(argv)
    sizes = TINY if args.tiny else MEDIUM
    for name, val in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, val)
    args.llada_gen = args.llada_gen or (64 if args.tiny else 128)
    args.fast_gen = args.fast_gen or (64 if args.tiny else 256)
    return args


# ---- the model on both sides ----------------------------------------------------------------------------


def random_hf(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
        intermediate_size=args.expert_width, norm_topk_prob=True, rope_theta=10000.0,
        max_position_embeddings=max(1024, args.prompt_len + max(args.llada_gen, args.fast_gen)), rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        initializer_range=args.init_range, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    return transformers.Qwen3MoeForCausalLM(cfg).float().eval()


def load_both(args: argparse.Namespace, tmp: Path) -> tuple[Any, Any, Any]:
    """(the HF model, our config, our weights): the same weights through save_pretrained + clover convert."""
    import transformers

    from clover_jax import checkpoint
    from clover_jax.convert import convert

    if args.checkpoint is not None:
        hf_dir = args.checkpoint
        hf = transformers.Qwen3MoeForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").float().eval()
    else:
        hf = random_hf(args)
        hf_dir = tmp / "hf"
        hf.save_pretrained(hf_dir, safe_serialization=True)
    native = tmp / "native"
    convert(str(hf_dir), str(native), progress=False, mask_token_id=args.mask_token_id)
    cfg, weights = checkpoint.load_model(str(native))
    return hf, cfg, weights


def make_prompts(args: argparse.Namespace, cfg: Any, n: int) -> list[list[int]]:
    if args.prompt is not None and args.checkpoint is not None:
        import transformers

        ids = transformers.AutoTokenizer.from_pretrained(args.checkpoint)(args.prompt)["input_ids"]
        return [list(ids)] * n
    rng = np.random.default_rng(args.seed + 1)
    high = min(cfg.vocab_size, cfg.mask_token_id) - 2  # never the mask id (the converter's: the last id)
    return rng.integers(2, high, (n, args.prompt_len)).tolist()


def probe_threads(hf: Any, width: int, tries: int = 3) -> tuple[int, dict[int, float]]:
    """Seconds of one bidirectional forward pass (batch 1, `width` tokens) with 1 thread and with all cores,
    best of `tries` taken in turns; returns the faster count and both times."""
    import torch

    from benchmarks.reference_harness import LLaDAPredictor

    cores = os.cpu_count() or 1
    pred = LLaDAPredictor(hf, keep_logits=False)
    x = torch.randint(2, hf.config.vocab_size - 2, (1, width))
    best: dict[int, float] = {1: float("inf"), cores: float("inf")}
    with torch.no_grad():
        for _ in range(tries):
            for n in best:
                torch.set_num_threads(n)
                pred(x)
                t0 = time.perf_counter()
                pred(x)
                best[n] = min(best[n], time.perf_counter() - t0)
    pick = min(best, key=best.__getitem__)
    torch.set_num_threads(pick)
    return pick, best


# ---- one comparison row ---------------------------------------------------------------------------------


@dataclass
class Side:
    """One side of a row: the call, and what its runs gave."""

    run: Callable[[], tuple[np.ndarray, int]]  # -> (generated tokens [n, gen], forward passes)
    times: list[float] = field(default_factory=list)
    tokens: np.ndarray | None = None
    nfe: list[int] = field(default_factory=list)

    def tokens_per_s(self) -> list[float]:
        assert self.tokens is not None
        return [self.tokens.size / t for t in self.times]


def timed_pair(ours: Side, theirs: Side, runs: int) -> None:
    """Warm-up call of each, then `runs` interleaved timed calls (ours, theirs, ours, ...)."""
    for side in (ours, theirs):
        side.tokens, _ = side.run()
    for _ in range(runs):
        for side in (ours, theirs):
            t0 = time.perf_counter()
            toks, nfe = side.run()
            side.times.append(time.perf_counter() - t0)
            side.nfe.append(nfe)
            if not np.array_equal(toks, side.tokens):
                print("  warning: a rerun of the same greedy call changed its tokens", flush=True)


def med(xs: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def equal(a: np.ndarray | None, b: np.ndarray | None) -> float:
    assert a is not None and b is not None
    return float((a == b).mean())


# ---- the sides ------------------------------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace, hf: Any, cfg: Any, weights: Any, llada: Any, fast: Any) -> None:
        self.args, self.hf, self.cfg, self.weights, self.llada, self.fast = args, hf, cfg, weights, llada, fast

    def ours(self, prompts: list[list[int]], gen: int, steps: int, cache: str, threshold: float) -> Side:
        from clover_jax.sampler import SamplerConfig, generate

        sc = SamplerConfig(gen_length=gen, block_length=self.args.block_length, steps=steps, threshold=threshold,
                           cache=cache, eos_stop=False)

        def run() -> tuple[np.ndarray, int]:
            out = generate(self.weights, self.cfg, prompts, sc, dispatch=self.args.dispatch)
            return np.asarray(out.raw), out.stats.nfe

        return Side(run)

    def llada_side(self, prompts: list[list[int]], gen: int, steps: int) -> Side:
        import torch

        from benchmarks.reference_harness import LLaDAPredictor

        ids = torch.tensor(prompts, dtype=torch.long)
        pred = LLaDAPredictor(self.hf, keep_logits=False)

        def run() -> tuple[np.ndarray, int]:
            pred.n_calls = 0
            out = self.llada.generate(pred, ids, steps=steps, gen_length=gen, block_length=self.args.block_length,
                                      temperature=0.0, cfg_scale=0.0, remasking="low_confidence",
                                      mask_id=self.cfg.mask_token_id)
            return out[:, ids.shape[1]:].numpy(), pred.n_calls

        return Side(run)

    def fast_side(self, prompt: list[int], gen: int, kind: str, threshold: float | None) -> Side:
        import torch

        from benchmarks.reference_harness import FastDllmPredictor

        fn = {"none": self.fast.generate, "prefix": self.fast.generate_with_prefix_cache,
              "dual": self.fast.generate_with_dual_cache}[kind]
        ids = torch.tensor([prompt], dtype=torch.long)
        pred = FastDllmPredictor(self.hf)

        def run() -> tuple[np.ndarray, int]:
            x, nfe = fn(pred, ids, steps=gen, gen_length=gen, block_length=self.args.block_length, temperature=0.0,
                        remasking="low_confidence", mask_id=self.cfg.mask_token_id, threshold=threshold)
            return x[:, ids.shape[1]:].numpy(), int(nfe)

        return Side(run)


HEAD = (f"{'setting':48} {'equal':>6} {'passes ours/theirs':>19} {'tok/pass o/t':>13} {'ours tok/s':>21} "
        f"{'theirs tok/s':>21} {'ours/theirs':>19}")


def row(label: str, ours: Side, theirs: Side) -> str:
    assert ours.tokens is not None and theirs.tokens is not None
    rows = ours.tokens.shape[0]
    gen = ours.tokens.size
    o_nfe, t_nfe = statistics.median(ours.nfe), statistics.median(theirs.nfe)
    ratio = [t / o for o, t in zip(ours.times, theirs.times, strict=True)]  # tok/s ours over theirs, per pair
    passes = f"{o_nfe:g}/{t_nfe:g}"
    tpp = f"{gen / rows / o_nfe:.2f}/{gen / rows / t_nfe:.2f}"
    return (f"{label:48} {equal(ours.tokens, theirs.tokens):6.3f} {passes:>19} {tpp:>13} "
            f"{med(ours.tokens_per_s()):>21} {med(theirs.tokens_per_s()):>21} {med(ratio, '.2f'):>19}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for flag, path, file in (("--llada-repo", args.llada_repo, "generate.py"),
                             ("--fastdllm-repo", args.fastdllm_repo, None)):
        ok = path.is_dir() and ((path / file).is_file() if file else
                                (path / "llada" / "generate.py").is_file() or (path / "generate.py").is_file())
        if not ok:
            want = file or "llada/generate.py or generate.py"
            print(f"vs_reference: {flag} {path}: {'no ' + want if path.is_dir() else 'no such directory'}",
                  file=sys.stderr)
            return 2
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        print(f"vs_reference: --checkpoint {args.checkpoint}: no config.json", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    import jax
    import torch
    import transformers

    from benchmarks.reference_harness import ReferenceNotFound, import_fastdllm, import_llada

    try:
        llada, fast = import_llada(args.llada_repo), import_fastdllm(args.fastdllm_repo)
    except ReferenceNotFound as e:
        print(f"vs_reference: {e}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="vs_reference_") as tmp:
        hf, cfg, weights = load_both(args, Path(tmp))
    src = str(args.checkpoint) if args.checkpoint else f"random weights (seed {args.seed}, init {args.init_range})"
    print(f"{cfg.n_layers} layers, d {cfg.d_model}, {cfg.n_heads}x{cfg.head_dim} heads ({cfg.n_kv_heads} kv), "
          f"{cfg.n_experts} experts top-{cfg.n_experts_per_tok} width {cfg.expert_mlp_dim}, vocab {cfg.vocab_size}, "
          f"{cfg.dtype}; {src}; mask id {cfg.mask_token_id}")
    cores = os.cpu_count() or 1
    width = args.prompt_len + args.llada_gen
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
        print(f"torch threads: {args.torch_threads} (--torch-threads)")
    else:
        pick, best = probe_threads(hf, width)
        print("torch threads: " + ", ".join(f"{n} thread{'s' * (n > 1)} {t * 1e3:.0f} ms" for n, t in best.items())
              + f" per forward pass (batch 1, {width} tokens) -> using {pick}")
    print(f"ours: jax {jax.__version__} on {jax.default_backend()}, dispatch {args.dispatch or cfg.moe_dispatch}; "
          f"theirs: torch {torch.__version__}, transformers {transformers.__version__}, experts "
          f"{getattr(hf.config, '_experts_implementation', '?')}; {cores} cores")
    print(f"{args.runs} interleaved runs after one warm-up each; median [min-max]; times: wall clock of the whole "
          "generate call; tok/s = generated tokens (all rows) / s; ours/theirs = tok/s ratio per pair of runs")
    r = Runner(args, hf, cfg, weights, llada, fast)
    bl, thr = args.block_length, args.threshold
    prompts = make_prompts(args, cfg, max(args.llada_batch))

    if "llada" in args.parts or "fastdllm" in args.parts:
        print(f"\n(a) equal settings and passes, greedy\n{HEAD}", flush=True)
    if "llada" in args.parts:
        g = args.llada_gen
        for b in args.llada_batch:
            ours, theirs = r.ours(prompts[:b], g, g, "none", 0.0), r.llada_side(prompts[:b], g, g)
            timed_pair(ours, theirs, args.runs)
            print(row(f"LLaDA generate vs none, B={b} g{g} b{bl} s{g}", ours, theirs), flush=True)
    uncached: dict[str, np.ndarray | None] = {}
    g = args.fast_gen
    if "fastdllm" in args.parts or "best" in args.parts:
        names = {"none": "generate", "prefix": "prefix_cache", "dual": "dual_cache"}
        for kind in ("none", "prefix", "dual") if "fastdllm" in args.parts else ("none",):
            ours, theirs = r.ours(prompts[:1], g, g, kind, 0.0), r.fast_side(prompts[0], g, kind, None)
            if "fastdllm" in args.parts:
                timed_pair(ours, theirs, args.runs)
                print(row(f"Fast-dLLM {names[kind]} vs {kind}, B=1 g{g} b{bl}", ours, theirs), flush=True)
            else:  # only the uncached outputs, for table (b)
                ours.tokens, theirs.tokens = ours.run()[0], theirs.run()[0]
            if kind == "none":
                uncached = {"ours": ours.tokens, "theirs": theirs.tokens}
    if "best" in args.parts:
        print(f"\n(b) fastest modes, threshold {thr} on both sides, B=1 g{g} b{bl}; agreement of each with the "
              f"uncached greedy run of its own side\n{HEAD} {'ours vs own':>11} {'theirs vs own':>13}", flush=True)
        for kind in args.best_modes:
            ours, theirs = r.ours(prompts[:1], g, g, kind, thr), r.fast_side(prompts[0], g, kind, thr)
            timed_pair(ours, theirs, args.runs)
            print(row(f"Fast-dLLM {kind} + thr {thr} vs {kind} + thr {thr}", ours, theirs)
                  + f" {equal(ours.tokens, uncached['ours']):11.3f} {equal(theirs.tokens, uncached['theirs']):13.3f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
