"""`clover train`: masked-diffusion pretraining on a text file, or SFT on prompt/response jsonl.

Resumes from the latest checkpoint in --out; with --export writes a native model directory (weights,
config, tokenizer, MODEL_CARD.md) that `clover generate --checkpoint` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from clover_jax.checkpoint import (
    check_destination,
    expected_leaves,
    load_checkpoint_config,
    load_model,
    save_model,
)
from clover_jax.commands.model_card import model_card
from clover_jax.config import ModelConfig, load_config
from clover_jax.errors import UsageError
from clover_jax.mesh.layouts import mesh_from_arg
from clover_jax.model import params
from clover_jax.model.moe import get_dispatch
from clover_jax.tokenizer import load_tokenizer
from clover_jax.training import (
    EvalProtocol,
    PairDataset,
    TokenStream,
    TrainConfig,
    evaluate,
    read_text,
    split_text,
    train,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `train` subcommand (--data or --sft, --out and the training flags) to `sub`; it dispatches
    to `run`."""
    p = sub.add_parser("train", help="train a model with the masked-diffusion objective (resumable)")
    p.add_argument("--config", default="clover-tiny", help="preset name or config.json path")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="UTF-8 text file for pretraining (random windows of --seq-len tokens)")
    src.add_argument("--sft", help='jsonl of {"prompt": ..., "response": ...}: loss on the response only')
    p.add_argument("--no-eos-padding", action="store_true",
                   help="--sft: end rows in invisible padding instead of scored end tokens (LLaDA's recipe, default)")
    p.add_argument("--block-grid", default="auto", choices=("auto", "prompt", "absolute"),
                   help="where a response's diffusion blocks start in --sft rows: right after the prompt (prompt) or "
                        "at multiples of the block size (absolute); auto: the grid the model family generates on")
    p.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.model / tokenizer.json (default: byte-level, vocab >= 260)")
    p.add_argument("--holdout", type=float, default=0.05, help="last fraction of the data kept for eval")
    p.add_argument("--out", required=True, help="run directory: Orbax training checkpoints (resumed if present)")
    p.add_argument("--export", default=None,
                   help="write the final model here (native checkpoint + MODEL_CARD.md; must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="let --export replace an existing directory (atomically)")
    p.add_argument("--init-from", default=None, help="start from the weights of a native checkpoint (e.g. for SFT)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (divides --batch-size)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lb-coef", type=float, default=0.01, help="MoE load-balancing loss weight")
    p.add_argument("--z-coef", type=float, default=1e-3, help="router z-loss weight")
    p.add_argument("--causal-coef", type=float, default=0.0,
                   help="weight of the clean half's next-token loss (causal-prefix models: trains the causal path "
                        "that commits blocks, scores likelihoods and checks self-speculative drafts); 0: off")
    p.add_argument("--noise-range", type=float, nargs=2, default=(1e-3, 1.0), metavar=("LO", "HI"),
                   help="noise levels t ~ U(LO, HI); e.g. 0.3 0.8 clips the schedule (BD3-LM) for lower variance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dispatch", default=None,
                   help="MoE dispatch for training (differentiable): default tiled on one device, dense on a mesh")
    p.add_argument("--remat", action="store_true", help="recompute layer activations in the backward pass")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-seqs", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--mesh", default=None, help="mesh layout (sharding/NAME.toml or a path); default one device")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop (checkpoint, eval, export) after this step; the schedule still spans --steps")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def init_changes(init: ModelConfig, cfg: ModelConfig, where: str) -> str:
    """The fields `cfg` changes from the --init-from checkpoint's config `init`, in words ("" when none), when every
    weight keeps its name, shape and dtype (a model fine-tuned into another reading of the same tensors, e.g.
    bd_gdn reconstructed -> causal_prefix, or renamed); UsageError naming the fields when the weights would not fit."""
    a, b = init.to_dict(), cfg.to_dict()
    fields = [k for k in a if a[k] != b[k]]
    if not fields:
        return ""
    said = ", ".join(f"{k} {a[k]!r} -> {b[k]!r}" for k in fields)
    if _leaf_shapes(init) != _leaf_shapes(cfg):
        raise UsageError(f"--init-from {where} holds config {init.name!r}, whose weights do not fit --config: {said}")
    return said


def _leaf_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    return {name: (spec.shape, str(spec.dtype)) for name, spec in expected_leaves(cfg).items()}


def run(args: argparse.Namespace) -> int:
    """Check every flag, the data and the mesh, then train (resuming from --out) and export."""
    # Everything that can be wrong with the input is checked here, before JAX compiles anything.
    cfg = load_config(args.config)
    if args.causal_coef > 0 and not cfg.causal_prefix:
        raise UsageError(f"--causal-coef {args.causal_coef}: --config {args.config} runs no causal path "
                         f"(bd_gdn={cfg.bd_gdn!r}); the next-token loss needs bd_gdn='causal_prefix'")
    if cfg.quantization != "none":  # before any data is read or weights loaded
        raise UsageError(f"--config {args.config} has {cfg.quantization} weights: training needs float weights "
                         "(train the float model, then clover convert --quantize)")
    try:
        tc = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
            lr=args.lr, warmup_steps=args.warmup, weight_decay=args.weight_decay, clip_norm=args.clip,
            lb_coef=args.lb_coef, z_coef=args.z_coef, causal_coef=args.causal_coef, seed=args.seed,
            noise_eps=args.noise_range[0], noise_max=args.noise_range[1], block_grid=args.block_grid,
            dispatch=args.dispatch or ("dense" if args.mesh else "tiled"), remat=args.remat,
            eval_every=args.eval_every, eval_seqs=args.eval_seqs, ckpt_every=args.ckpt_every,
            log_every=args.log_every)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if not 0.0 < args.holdout < 1.0:
        raise UsageError(f"--holdout must be in (0, 1), got {args.holdout}")
    for flag, path in (("--data", args.data), ("--sft", args.sft)):
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"{flag} {path!r} does not exist")
    if args.export:  # refused now, not after the training run
        check_destination(args.export, args.force, sources=(args.out,), what="--export")
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        raise UsageError(f"--tokenizer {args.tokenizer!r} is not a directory")
    try:
        get_dispatch(tc.dispatch)
    except ValueError as e:
        raise UsageError(f"--dispatch: {e}") from e
    if tc.seq_len > cfg.max_seq_len:
        raise UsageError(f"--seq-len {tc.seq_len} exceeds the config's max_seq_len {cfg.max_seq_len}")
    tok = load_tokenizer(args.tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        raise UsageError(f"the tokenizer has {tok.vocab_size} ids but config {cfg.name!r} has vocab_size "
                        f"{cfg.vocab_size}")
    mesh = mesh_from_arg(args.mesh)
    if mesh is not None:
        params.weight_shardings(cfg, mesh.mesh, mesh.rules)  # divisibility errors name the weight
    if args.data:
        train_text, eval_text = split_text(read_text(args.data), args.holdout)
        train_ids = np.asarray(tok.encode(train_text), np.int32)
        eval_ids = np.asarray(tok.encode(eval_text), np.int32)
        train_data = TokenStream(train_ids, tc.seq_len, tc.seed)
        eval_data = TokenStream(eval_ids, tc.seq_len, tc.seed)
        n_train_tokens = len(train_ids)
    else:
        eos = cfg.eos_token_id
        full = PairDataset(args.sft, tok.encode, tc.seq_len, eos, cfg.filler_id, tc.seed,
                           eos_padding=not args.no_eos_padding)
        train_data, eval_data = full.split(args.holdout)
        n_train_tokens = int(train_data.loss_mask.sum())
    init_weights = None
    if args.init_from:
        if load_checkpoint_config(args.init_from).quantization != "none":
            raise UsageError(f"--init-from {args.init_from} holds quantized weights: training needs float weights")
        icfg, init_weights = load_model(args.init_from)
        changed = init_changes(icfg, cfg, args.init_from)
        if changed:
            print(f"clover train: --init-from {args.init_from}: --config changes {changed} (the weights keep their "
                  "shapes)", file=sys.stderr)

    res = train(cfg, tc, train_data, eval_data, ckpt_dir=args.out, mesh=mesh, stop_at=args.stop_at,
                progress=not args.no_progress, init_weights=init_weights, eval_at_end=False)
    proto = EvalProtocol(block_grid=tc.block_grid)
    print("final evaluation ...", file=sys.stderr, flush=True)
    final = evaluate(res.state.weights, cfg, eval_data.eval_batches(proto.n_seqs), proto, tc.dispatch)
    print(json.dumps({"step": int(res.state.step), **final, "tokens_seen": res.total_tokens,
                      "wall_s": round(res.total_wall_s, 1)}))
    if args.export:
        card = model_card(cfg, tc, args.data or args.sft, args.holdout, res, final, proto, n_train_tokens,
                          sys.argv[1:])
        print(f"exporting the final model to {args.export} ...", file=sys.stderr, flush=True)
        save_model(args.export, cfg, res.state.weights, tokenizer_dir=args.tokenizer,
                   extra_files={"MODEL_CARD.md": card}, force=args.force)
        print(f"wrote {args.export}")
    return 0
