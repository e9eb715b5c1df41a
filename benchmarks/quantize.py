"""What weight-only quantization costs in quality: logit error, held-out eval loss and greedy infill
agreement of int8 and fp8 weights against bfloat16, as a markdown table per model for the README.

    python benchmarks/quantize.py                                          # the shipped clover-tiny
    python benchmarks/quantize.py --model /work/runs/q3-shakespeare-native # a converted Qwen3-MoE model
    (--data PATH, default ../shared/data/tinyshakespeare-train.txt next to the repository;
     --seqs N eval windows, --examples N infill windows, --seed S for the logit-error masks)

Variants of each model, all from its stored (float32) weights:

    float32         as stored
    bfloat16        matmul weights and activations in bf16 (`dtype="bfloat16"`; routers, norms and the
                    small per-head vectors stay float32, as the config's weight specs say)
    int8, fp8       the matmul weights quantized per output channel (`params.quantize_weights`) from
                    the float32 weights on the bfloat16 config: bf16 activations, the deployment setting
    int8 (f32 act)  int8 weights on the float32 config

Figures, against the bfloat16 variant (the baseline of "within 1%"):

    logit error     relative RMS ||l - l_bf16|| / ||l_bf16|| and max |l - l_bf16| of the logits at the
                    masked positions of held-out windows with every scored token masked with
                    probability 0.5 (one draw, `--seed`, the same inputs for every variant), as the
                    model sees them when denoising (block-causal models: next to the clean sequence);
                    top-1: the fraction of those positions whose argmax equals bf16's
    eval loss       the training's own held-out eval (`training.evaluate`, `EvalProtocol`: the last
                    `--holdout` of the data file's characters, tokenized alone, the first `--seqs`
                    windows of 256 tokens, the fixed mask seed and t grid), so the float32 row is the
                    model card's figure; the difference to bf16 in %
    infill          greedy low-confidence sampling (one token a step) of `--span` masked tokens after
                    `--prompt` tokens of context in `--examples` held-out windows: the fraction of
                    filled tokens equal to bf16's fill (and float32's), and each variant's exact-match
                    accuracy against the original text. After a first differing token the two fills
                    continue from different text, so agreement counts every later token too.

Runs on whatever JAX finds (JAX_PLATFORMS=cpu for the CPU; fp8 is emulated there). Prints figures,
asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare-train.txt"
BASE = "bfloat16"  # the baseline every figure is measured against


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=None,
                   help="native checkpoint directories (default: the shipped clover-tiny)")
    p.add_argument("--data", default=None, help=f"the text the models were trained on (default: {DEFAULT_DATA})")
    p.add_argument("--holdout", type=float, default=0.05, help="the eval split: the last fraction of the file")
    p.add_argument("--seq-len", type=int, default=256, help="eval window length (the training's)")
    p.add_argument("--seqs", type=int, default=16, help="held-out eval windows (16: the model card's eval)")
    p.add_argument("--logit-seqs", type=int, default=8, help="held-out windows for the logit error")
    p.add_argument("--mask-frac", type=float, default=0.5, help="masking probability of the logit-error inputs")
    p.add_argument("--examples", type=int, default=16, help="held-out windows to infill")
    p.add_argument("--prompt", type=int, default=64, help="context tokens before each infilled span")
    p.add_argument("--span", type=int, default=64, help="masked tokens to fill (a multiple of --block)")
    p.add_argument("--block", type=int, default=32, help="the sampler's block length")
    p.add_argument("--seed", type=int, default=0, help="seed of the logit-error masks")
    args = p.parse_args(argv)
    if not 0.0 < args.holdout < 1.0 or not 0.0 < args.mask_frac <= 1.0:
        p.error("--holdout must be in (0, 1) and --mask-frac in (0, 1]")
    if min(args.seq_len, args.seqs, args.logit_seqs, args.examples, args.prompt, args.span, args.block) <= 0:
        p.error("lengths and counts must be positive")
    if args.span % args.block:
        p.error(f"--span ({args.span}) must be a multiple of --block ({args.block})")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the variants ------------------------------------------------------------------------------


def _cast(cfg, weights, keep_matmul: bool = False):
    """`weights` in the dtypes of `cfg`'s weight specs; keep_matmul: the matmul weights (the ones that
    get quantized) stay as they are, so they are quantized from the stored float32 values."""
    import jax

    from clover_jax.model import params

    return jax.tree.map(lambda s, a: a if keep_matmul and s.contract else a.astype(s.dtype),
                        params.abstract(cfg), weights, is_leaf=params.is_spec)


def variants(cfg, weights):
    """[(label, config, weights)] of the five variants, from the stored weights (a quantized checkpoint's
    dequantized first: its rounding is then in every variant)."""
    from clover_jax.model import params

    if cfg.quantization != "none":
        cfg, weights = params.dequantize_weights(cfg, weights)
    fcfg = cfg.replace(dtype="float32", quantization="none")
    fw = _cast(fcfg, weights)
    bcfg = fcfg.replace(dtype="bfloat16")
    out = [("float32", fcfg, fw), ("bfloat16", bcfg, _cast(bcfg, fw))]
    mixed = _cast(bcfg, fw, keep_matmul=True)  # non-matmul weights as in bf16, matmul ones still float32
    for scheme in ("int8", "fp8"):
        out.append((scheme, *params.quantize_weights(bcfg, mixed, scheme)))
    out.append(("int8 (f32 act)", *params.quantize_weights(fcfg, fw, "int8")))
    return out


# ---- the measures ------------------------------------------------------------------------------


def masked_logits(cfg, weights, tokens: np.ndarray, masked: np.ndarray) -> np.ndarray:
    """Float32 logits [n_masked, V] at the masked positions of `tokens` (masked there, clean elsewhere),
    from the denoising forward the training and eval use."""
    import jax
    import jax.numpy as jnp

    from clover_jax.training import losses

    @jax.jit
    def run(w, noisy, clean, valid):
        return losses.denoising_forward(w, cfg, noisy, clean, valid).logits.astype(jnp.float32)

    noisy = np.where(masked, cfg.mask_token_id, tokens).astype(np.int32)
    logits = np.asarray(run(weights, noisy, tokens, np.ones(tokens.shape, bool)))
    return logits[masked]


def logit_error(out: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """(relative RMS, max |diff|, top-1 agreement) of logits `out` against `ref`, both [n, V]."""
    d = out.astype(np.float64) - ref
    rel = float(np.sqrt(np.sum(d * d) / np.sum(ref.astype(np.float64) ** 2)))
    top1 = float(np.mean(np.argmax(out, -1) == np.argmax(ref, -1)))
    return rel, float(np.max(np.abs(d))), top1


def infill(cfg, weights, prompts: list[list[int]], span: int, block: int) -> np.ndarray:
    """Greedy fills [n, span]: low-confidence remasking, one token a step (the sampler's default)."""
    from clover_jax.sampler import SamplerConfig, generate

    sc = SamplerConfig(gen_length=span, block_length=block, steps=span, remasking="low_confidence",
                       temperature=0.0)
    return np.asarray(generate(weights, cfg, prompts, sc).raw[:, :span])


def measure_model(path: str, args: argparse.Namespace, text: str) -> tuple[str, list[str], float]:
    """(table header, table lines, wall seconds) for the model in `path`."""
    from clover_jax.checkpoint import load_model
    from clover_jax.sampler import SamplerError, check_model
    from clover_jax.tokenizer import load_tokenizer
    from clover_jax.training import EvalProtocol, TokenStream, evaluate, split_text

    t_model = time.perf_counter()
    path = os.path.abspath(path)  # orbax metadata reads want an absolute path
    cfg, weights = load_model(path)
    tok = load_tokenizer(path)
    _, held_out = split_text(text, args.holdout)
    ids = np.asarray(tok.encode(held_out), np.int32)
    notes = []

    # eval windows: the training's own held-out batches
    proto = EvalProtocol(n_seqs=args.seqs)
    eval_batch = TokenStream(ids, args.seq_len, seed=0).eval_batches(args.seqs)
    n_eval = eval_batch.tokens.shape[0]
    n_eval_used = n_eval // min(proto.micro_batch, n_eval) * min(proto.micro_batch, n_eval)

    # logit-error inputs: the first --logit-seqs of those windows, each token masked with prob --mask-frac
    lt = eval_batch.tokens[: args.logit_seqs]
    rng = np.random.default_rng(args.seed)
    lmask = rng.random(lt.shape) < args.mask_frac
    if not lmask.any():
        lmask[:, 0] = True

    # infill windows: spread over the held-out text
    win = args.prompt + args.span
    starts = np.linspace(0, len(ids) - win, args.examples).astype(int)
    prompts = [ids[s: s + args.prompt].tolist() for s in starts]
    truth = np.stack([ids[s + args.prompt: s + win] for s in starts])
    try:
        check_model(cfg)
        can_infill = True
    except SamplerError as e:
        can_infill = False
        notes.append(f"infill: not measured, the sampler cannot run this model ({e})")

    rows: dict[str, dict] = {}
    logits: dict[str, np.ndarray] = {}
    fills: dict[str, np.ndarray] = {}
    for label, vcfg, vw in variants(cfg, weights):
        t0 = time.perf_counter()
        logits[label] = masked_logits(vcfg, vw, lt, lmask)
        t1 = time.perf_counter()
        ev = evaluate(vw, vcfg, eval_batch, proto, dispatch=None)
        t2 = time.perf_counter()
        if can_infill:
            fills[label] = infill(vcfg, vw, prompts, args.span, args.block)
        t3 = time.perf_counter()
        rows[label] = ev
        log(f"{cfg.name} {label}: eval loss {ev['eval_loss']:.4f}; logits {t1 - t0:.1f} s, eval {t2 - t1:.1f} s, "
            f"infill {t3 - t2:.1f} s (incl. compiles)")
        del vw

    ref, f32 = logits[BASE], logits["float32"]
    base_loss = rows[BASE]["eval_loss"]
    head = ("| variant | rel. logit RMS vs bf16 | max abs logit diff | top-1 agree vs bf16 | "
            "rel. logit RMS vs f32 | eval loss | Δ vs bf16 | masked acc | "
            + ("infill agree vs bf16 | infill agree vs f32 | infill exact |" if can_infill else "")
            + "\n|---|---|---|---|---|---|---|---|" + ("---|---|---|" if can_infill else ""))
    lines = []
    for label, ev in rows.items():
        rel, mx, top1 = logit_error(logits[label], ref)
        rel32 = logit_error(logits[label], f32)[0]
        loss = ev["eval_loss"]
        delta = 100.0 * (loss - base_loss) / base_loss
        cells = [label, f"{rel:.4f}", f"{mx:.3f}", f"{top1:.4f}", f"{rel32:.4f}", f"{loss:.4f}",
                 "(baseline)" if label == BASE else f"{delta:+.3f}%", f"{ev['eval_masked_acc']:.4f}"]
        if can_infill:
            cells += [f"{np.mean(fills[label] == fills[BASE]):.3f}", f"{np.mean(fills[label] == fills['float32']):.3f}",
                      f"{np.mean(fills[label] == truth):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    wall = time.perf_counter() - t_model
    attn = "block-causal" if cfg.is_block_causal else "bidirectional"
    desc = (f"{cfg.name} ({cfg.family}, {attn}, stored {cfg.dtype}): logit error on {lt.shape[0]} held-out "
            f"windows of {lt.shape[1]} tokens, {int(lmask.sum())} positions masked (p = {args.mask_frac}, seed "
            f"{args.seed}); eval loss (nats/token, diffusion bound) on the first {n_eval_used} held-out windows of "
            f"{args.seq_len} tokens (the last {args.holdout:g} of the data file), t grid {list(proto.t_grid)}, mask "
            f"seed {proto.seed}")
    if can_infill:
        desc += (f"; infill: {args.examples} held-out windows, {args.prompt} context tokens, {args.span} masked "
                 f"tokens in blocks of {args.block}, greedy, one token a step")
    if notes:
        desc += "\n\n" + "\n".join(notes)
    return desc, [head, *lines], wall


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = Path(args.data) if args.data else DEFAULT_DATA
    if not data.is_file():
        print(f"error: data file {data} not found; pass --data PATH (the text the models were trained on: "
              f"tinyshakespeare-train.txt)", file=sys.stderr)
        return 2
    from clover_jax import shipped
    from clover_jax.training import read_text

    text = read_text(str(data))
    models = args.model or [str(shipped.MODEL_DIR)]
    command = "python benchmarks/quantize.py" + "".join(f" {shlex.quote(a)}" for a in
                                                        (sys.argv[1:] if argv is None else argv))
    for m in models:
        desc, table, wall = measure_model(m, args, text)
        print(f"\n`{command}`\n\n{desc}\n")
        print("\n".join(table))
        print(f"\n({wall:.0f} s for this model, including compiles)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
