"""The recipe that teaches a model the toy task: block-diffusion SFT on `sft_rows` (`Recipe`, `finetune`,
resumable from a run directory), the digit-embedding lift it starts from (`lift_digit_embeddings`), and
`score_turns`, a check of the held-out turns through `clover_jax.generate` (no server) while training.

`scripts/train_tool_model.py` runs the recipe at length (the shipped `checkpoints/clover-tiny-tools` is its step
5,700, then fine-tuned into the causal-prefix reading); `tests/test_agent_e2e.py` runs a few steps of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

import clover_jax
from clover_jax.serving.chat import plain_prompt
from clover_jax.training import PairDataset, TrainConfig
from clover_jax.training import train as run_training
from examples.toy_agent.task import Task, sft_rows, specs, turns

if TYPE_CHECKING:
    from clover_jax import ModelConfig
    from clover_jax.model.params import Weights
    from clover_jax.tokenizer import Tokenizer


@dataclass(frozen=True)
class Recipe:
    """The fine-tuning recipe's settings (block-diffusion SFT on `sft_rows`): rows of `seq_len` tokens filled
    with end tokens, noise levels drawn from [noise_eps, 1], the response's blocks on the grid generation uses."""

    steps: int = 6000  # the cosine schedule's length (a run may stop earlier and resume)
    seq_len: int = 232  # the longest row (a chain's answer turn, after two calls) is 231 tokens
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 50
    noise_eps: float = 0.3
    lift_digits: bool = True  # start from `lift_digit_embeddings` (the shipped model's digits never trained)
    causal_coef: float = 0.0  # a causal-prefix model: the clean half's next-token loss too (`TrainConfig`)

    def train_config(self, seed: int = 0, ckpt_every: int = 200) -> TrainConfig:
        """The `TrainConfig` of this recipe."""
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr,
                           warmup_steps=self.warmup_steps, noise_eps=self.noise_eps, seed=seed, dispatch="tiled",
                           log_every=10**9, eval_every=10**9, ckpt_every=ckpt_every, causal_coef=self.causal_coef)


def lift_digit_embeddings(weights: Weights, tokenizer: Tokenizer) -> Weights:
    """`weights` with the input embeddings of the digits 0-9 scaled to the vocabulary's median norm (directions
    kept). Tiny Shakespeare has almost no digits, so the shipped model's digit embeddings never left their
    initialization (norm about 0.24 against a median 0.55): a digit's identity starts out weaker in the residual
    stream than any word's, and the task is mostly copying numbers."""
    table = np.asarray(weights.embed, np.float32).copy()
    norms = np.linalg.norm(table, axis=1)
    digits = sorted({tokenizer.encode(str(d))[-1] for d in range(10)})
    table[digits] *= (np.median(norms) / norms[digits])[:, None]
    return dataclasses.replace(weights, embed=jnp.asarray(table, weights.embed.dtype))


def sft_dataset(cfg: ModelConfig, tokenizer: Tokenizer, train: Sequence[Task], seq_len: int, workdir: str,
                seed: int = 0) -> PairDataset:
    """`sft_rows(train)` written to `workdir/tool_task.jsonl` and read back as a `PairDataset`."""
    path = os.path.join(workdir, "tool_task.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in sft_rows(train))
    return PairDataset(path, tokenizer.encode, seq_len, cfg.eos_token_id, cfg.filler_id, seed=seed)


def finetune(cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer, train: Sequence[Task],
             recipe: Recipe = Recipe(), *, stop_at: int | None = None, run_dir: str | None = None, seed: int = 0,
             on_step: Callable[[int, dict[str, float]], None] | None = None) -> Weights:
    """Block-diffusion SFT of `weights` on `sft_rows(train)` with `recipe`, up to step `stop_at` (default: the
    recipe's `steps`); the tuned weights. `run_dir`: keep training checkpoints there and resume from the latest
    (the run's data and schedule continue where it stopped); None trains in a scratch directory. `on_step`:
    `clover_jax.training.train`'s per-step callback."""
    workdir = run_dir or tempfile.mkdtemp(prefix="clover-tools-")
    os.makedirs(workdir, exist_ok=True)
    data = sft_dataset(cfg, tokenizer, train, recipe.seq_len, workdir, seed)
    start = lift_digit_embeddings(weights, tokenizer) if recipe.lift_digits else weights
    fresh = jax.tree.map(jnp.copy, start)  # the training step may donate its inputs
    res = run_training(cfg, recipe.train_config(seed), data, ckpt_dir=os.path.join(workdir, "checkpoints")
                       if run_dir else None, stop_at=stop_at, init_weights=fresh, progress=False,
                       eval_at_end=False, log=lambda line: None, on_step=on_step)
    return res.state.weights


def score_turns(weights: Weights, cfg: ModelConfig, tokenizer: Tokenizer, held: Sequence[Task],
                remasking: str = "low_confidence") -> tuple[tuple[int, int], tuple[int, int]]:
    """((call turns exactly the expected call, call turns), (answer turns exactly the answer, answer turns)) over
    every turn of `held` (`turns`, the conversation given up to it), generated greedily one token a pass in
    `remasking` order with `clover_jax.generate` from the prompts `clover serve` renders (no server: a quick
    check while training)."""
    tools, out = specs(), []
    every = [turn for task in held for turn in turns(task)]
    for is_call, length in ((True, 64), (False, 32)):
        group = [turn for turn in every if turn.is_call == is_call]
        sampler = clover_jax.SamplerConfig(gen_length=length, block_length=32, steps=length, temperature=0.0,
                                           remasking=remasking, seed=0)
        res = clover_jax.generate(weights, cfg, [tokenizer.encode(plain_prompt(t.messages, tools)) for t in group],
                                  sampler)
        out.append((sum(tokenizer.decode(ids).strip() == t.response for t, ids in zip(group, res.tokens, strict=True)),
                    len(group)))
    return out[0], out[1]
