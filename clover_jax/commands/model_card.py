"""The model card `clover train --export` writes next to the weights (MODEL_CARD.md)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence

from clover_jax.config import LINEAR_ATTENTION, ModelConfig
from clover_jax.model.params import count_params
from clover_jax.training import EvalProtocol, TrainConfig, TrainResult


def _mixers(cfg: ModelConfig) -> str:
    group = cfg.layer_group
    lin = group.count(LINEAR_ATTENTION)
    bd = (f"block diffusion `bd_gdn: {cfg.bd_gdn}`, right conv of {cfg.bd_conv_right_kernel}"
          if cfg.has_bd_weights else "causal")
    return (f"| sequence mixers | {cfg.n_layers // len(group)} x ({lin} Gated DeltaNet + {len(group) - lin} gated "
            f"attention); Gated DeltaNet {cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} value heads x "
            f"{cfg.linear_key_head_dim}, conv {cfg.linear_conv_kernel_dim}, {bd} |")


def model_card(cfg: ModelConfig, tc: TrainConfig, data: str, holdout: float, res: TrainResult, final_eval: dict,
               proto: EvalProtocol, n_train_tokens: int, command: Sequence[str]) -> str:
    """The MODEL_CARD.md text of a trained model: its shape, data, training, eval figures and the
    command that reproduces it (`command`: the argv after `clover`)."""
    c = count_params(cfg)
    cmd = "clover " + " ".join(shlex.quote(a) for a in command)
    lines = [
        f"# {cfg.name}",
        "",
        "A masked-diffusion mixture-of-experts language model trained by `clover train` "
        "(block diffusion: each block denoised given the clean blocks before it).",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {c.total:,} total, {c.active:,} active per token |",
        f"| layers / d_model / heads | {cfg.n_layers} / {cfg.d_model} / {cfg.n_heads} q, {cfg.n_kv_heads} kv x "
        f"{cfg.head_dim} |",
        f"| experts | {cfg.n_experts} routed (top-{cfg.n_experts_per_tok}, width {cfg.expert_mlp_dim}), "
        f"{cfg.n_shared_experts} shared (width {cfg.shared_mlp_dim}) |",
        f"| attention | {cfg.attention}, blocks of {cfg.block_size} |",
        *([_mixers(cfg)] if cfg.is_hybrid else []),
        f"| vocabulary | {cfg.vocab_size} (SentencePiece; pad 0, bos 1, eos 2, mask {cfg.mask_token_id}) |",
        f"| data | `{data}` minus its last {holdout:.0%} (held out for eval); "
        f"{n_train_tokens:,} training tokens |",
        f"| steps | {int(res.state.step)} (cosine schedule over {tc.steps}) x {tc.batch_size} sequences x "
        f"{tc.seq_len} tokens |",
        f"| tokens seen | {res.total_tokens:,} |",
        f"| wall time | {res.total_wall_s / 60:.1f} min of training incl. periodic evals (2 shared CPU cores) |",
        f"| eval loss (held out) | **{final_eval['eval_loss']:.4f}** nats/token (diffusion bound; see protocol) |",
        f"| eval masked CE / accuracy | {final_eval['eval_masked_ce']:.4f} / {final_eval['eval_masked_acc']:.3f} |",
        "",
        "## Reproduce",
        "",
        "```",
        cmd,
        "```",
        "",
        "## Eval protocol",
        "",
        "The held-out split is the last "
        f"{holdout:.0%} of the characters of the data file, tokenized on its own; the eval takes "
        f"the first {proto.n_seqs} consecutive windows of {tc.seq_len} tokens, masks every block at each noise "
        "level t of the grid with a fixed seed, and reports the 1/t-weighted masked cross-entropy per token "
        "averaged over the grid (`clover_jax.training.evaluate`):",
        "",
        "```json",
        json.dumps({**proto.to_dict(), "seq_len": tc.seq_len, "holdout": holdout}, indent=2),
        "```",
        "",
        "## Training config",
        "",
        "```json",
        json.dumps(dataclasses.asdict(tc), indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)
