"""Log-likelihood of an answer given a prompt, by the masked-diffusion Monte-Carlo estimator.

A masked-diffusion model has no exact likelihood; its evidence lower bound is estimated as LLaDA does it
(`get_log_likelihood` in github.com/ML-GSAI/LLaDA): for each Monte-Carlo sample draw a number of masked
answer tokens k in 1..L (L = answer length), mask exactly k answer positions chosen at random, leave the
prompt clean, and score

    loss = sum over masked positions of -log p(original token) / (k / L)

The estimate of log p(answer | prompt) is -mean(loss), a lower bound in expectation. Draws come in batches
of `batch_size` rows as LLaDA draws them: one k uniform in 1..L per batch, the batch's counts spread evenly
from it (stratified: `round(linspace(k, k + (b-1) L/b, b))`, wrapped into 1..L), each row masking its count
at a fresh random permutation (`llada_draws`). The Monte-Carlo standard error is the per-sample one,
std(loss, ddof=1) / sqrt(n); the stratified draw usually makes the true error smaller, so it is a
conservative figure.

Block-causal models (LLaDA2, Clover) are scored in their training arrangement (`training.losses.
denoising_forward`): the masked sequence next to the clean one, each block seeing itself and the clean blocks
before it, blocks on the grid the family generates on (`masks.family_block_grid`: Clover's answer blocks start
where the prompt ends, LLaDA2's at multiples of the block size). The prompt is clean and visible to every
answer block; answer blocks see the earlier answer blocks clean. With one shared draw this is an unbiased
estimate of the sum of the blocks' own bounds (shared t, each block's term is its own bound), i.e. the
block-diffusion likelihood bound.
Bidirectional models see the whole masked sequence, exactly as in LLaDA.

A causal-prefix model (`cfg.causal_prefix`: Clover as its ports run it) is the causal model on clean text, so its
likelihood is exact: `exact`, one clean pass, sum of log p(token | the tokens before it).

Guidance (`cfg_scale` > 0): an unconditional pass with the prompt masked as well, logits combined as
`un + (scale + 1) (cond - un)` before the log-softmax (LLaDA's formula).

Shapes are fixed so that one compiled program serves many requests: `rows` samples per forward pass,
sequences left-padded to a power of two of at least `min_len` columns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.errors import EvaluationError
from clover_jax.model import masks
from clover_jax.model.transformer import forward
from clover_jax.sampler.scoring import guide
from clover_jax.training.losses import denoising_forward

Array = jax.Array


@dataclass(frozen=True)
class Estimate:
    """An estimated log-likelihood (nats) with its Monte-Carlo standard error over `samples` draws."""

    mean: float
    stderr: float
    samples: int
    greedy: bool = False  # the one-pass argmax fill of the fully masked answer is the answer (if checked)
    compute_s: float = 0.0  # seconds in the compiled passes (including any compile they triggered)


def llada_draws(rng: np.random.Generator, answer_len: int, mc_num: int, batch_size: int) -> np.ndarray:
    """Masked answer positions [mc_num, answer_len] bool, drawn batch by batch as LLaDA's `forward_process`:
    per batch one k uniform in 1..L, counts `round(linspace(k, k + (b-1) L / b, b))` wrapped into 1..L, each row
    masking its count at a random permutation. mc_num must be a multiple of batch_size."""
    if answer_len < 1:
        raise EvaluationError("the answer to score is empty")
    if batch_size < 1 or mc_num < batch_size or mc_num % batch_size:
        raise EvaluationError(f"mc_num ({mc_num}) must be a positive multiple of batch_size ({batch_size})")
    out = np.zeros((mc_num, answer_len), bool)
    for start in range(0, mc_num, batch_size):
        k = int(rng.integers(1, answer_len + 1))
        counts = np.round(np.linspace(float(k), k + (batch_size - 1) * (answer_len / batch_size), batch_size))
        counts = ((counts.astype(np.int64) - 1) % answer_len) + 1
        for i, c in enumerate(counts):
            out[start + i] = (np.arange(answer_len) < c)[rng.permutation(answer_len)]
    return out


def seq_bucket(n: int, min_len: int = 32) -> int:
    """Columns a sequence of `n` tokens is padded to: the next power of two, at least `min_len`."""
    return max(min_len, 1 << max(n - 1, 0).bit_length())


@partial(jax.jit, static_argnames=("cfg", "guidance", "dispatch"))
def sample_losses(weights: Any, cfg: ModelConfig, tokens: Array, valid: Array, prompt: Array, masked: Array,
                  ratio: Array, cfg_scale: Array, *, guidance: bool = False,
                  dispatch: str | None = None) -> tuple[Array, Array]:
    """Per-row (loss [R], greedy [R]) for R noisy copies of sequences [R, T] (left-padded).

    valid: real columns; prompt: prompt columns (clean, never scored); masked: the answer columns masked in
    this row; ratio [R]: k / L of the row. loss = sum over masked of -log p(token) / ratio; greedy: every masked
    column's argmax is its token. cfg_scale: the guidance scale, used only when `guidance` (static) is on."""
    mask_id = cfg.mask_token_id
    noisy = jnp.where(masked, mask_id, tokens)
    blocks = masks.training_block_ids(cfg, valid, valid & ~prompt, masks.family_block_grid(cfg))
    if guidance:  # unconditional rows: the prompt masked too, in the clean copy and the noisy one
        un_clean = jnp.where(prompt, mask_id, tokens)
        un_noisy = jnp.where(masked | prompt, mask_id, tokens)
        out = denoising_forward(weights, cfg, jnp.concatenate([noisy, un_noisy]), jnp.concatenate([tokens, un_clean]),
                                jnp.concatenate([valid, valid]), dispatch, blocks=jnp.concatenate([blocks, blocks]))
        cond, un = jnp.split(out.logits, 2)
        logits = guide(cond, un, cfg_scale)
    else:
        logits = denoising_forward(weights, cfg, noisy, tokens, valid, dispatch, blocks=blocks).logits
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    m = masked & valid
    loss = jnp.sum(jnp.where(m, nll, 0.0), axis=-1) / ratio
    greedy = jnp.all(jnp.where(m, jnp.argmax(logits, -1) == tokens, True), axis=-1)
    return loss, greedy


@dataclass(frozen=True)
class Layout:
    """One prompt + answer laid out for `sample_losses`: host arrays of one row, left-padded to `width`."""

    tokens: np.ndarray  # [T] int32
    valid: np.ndarray  # [T] bool
    prompt: np.ndarray  # [T] bool
    answer_start: int  # column of the first answer token
    answer_len: int


def layout(cfg: ModelConfig, prompt: Sequence[int], answer: Sequence[int], width: int) -> Layout:
    """Left-pad prompt + answer into `width` columns (EvaluationError if they do not fit)."""
    n = len(prompt) + len(answer)
    if not answer:
        raise EvaluationError("the answer to score is empty")
    if n > width:
        raise EvaluationError(f"prompt + answer ({n} tokens) do not fit {width} columns")
    pad = width - n
    tokens = np.full((width,), cfg.filler_id, np.int32)
    tokens[pad:] = np.asarray(list(prompt) + list(answer), np.int32)
    valid = np.arange(width) >= pad
    is_prompt = valid & (np.arange(width) < pad + len(prompt))
    return Layout(tokens, valid, is_prompt, pad + len(prompt), len(answer))


def estimate(weights: Any, cfg: ModelConfig, prompt: Sequence[int], answer: Sequence[int], *, mc_num: int = 128,
             batch_size: int = 16, cfg_scale: float = 0.0, seed: int = 0, draws: np.ndarray | None = None,
             check_greedy: bool = False, min_len: int = 32, dispatch: str | None = None) -> Estimate:
    """log p(answer | prompt) by the masked-diffusion estimator (module docstring), with its standard error.

    draws: masked answer positions [n, L] to use instead of `llada_draws(default_rng(seed), ...)` (n a multiple
    of batch_size). check_greedy: one more pass with the whole answer masked sets `Estimate.greedy`.
    Sequences are padded to `seq_bucket(len, min_len)` columns (at most the model's max_seq_len); one program per
    (rows, columns, guidance)."""
    n = len(prompt) + len(answer)
    width = min(seq_bucket(n, min_len), max(cfg.max_seq_len, n))
    if width > cfg.max_seq_len:
        raise EvaluationError(f"prompt + answer ({len(prompt) + len(answer)} tokens) exceed the model's "
                              f"max_seq_len ({cfg.max_seq_len})")
    lay = layout(cfg, prompt, answer, width)
    if draws is None:
        draws = llada_draws(np.random.default_rng(seed), lay.answer_len, mc_num, batch_size)
    draws = np.asarray(draws, bool)
    if draws.ndim != 2 or draws.shape[1] != lay.answer_len or draws.shape[0] % batch_size or not draws.any(1).all():
        raise EvaluationError(f"draws must be [n * {batch_size}, {lay.answer_len}] with a mask in every row")
    rows = np.broadcast_to(lay.tokens, (batch_size, width))
    valid = np.broadcast_to(lay.valid, (batch_size, width))
    prm = np.broadcast_to(lay.prompt, (batch_size, width))
    scale = jnp.float32(cfg_scale)
    guidance = cfg_scale > 0

    spent = [0.0]

    def run(chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        masked = np.zeros((batch_size, width), bool)
        masked[:, lay.answer_start:] = chunk
        ratio = (chunk.sum(1) / lay.answer_len).astype(np.float32)
        loss, greedy = sample_losses(weights, cfg, rows, valid, prm, masked, ratio, scale, guidance=guidance,
                                     dispatch=dispatch)
        out = np.asarray(loss, np.float64), np.asarray(greedy)
        spent[0] += time.perf_counter() - t0
        return out

    losses = np.concatenate([run(draws[i:i + batch_size])[0] for i in range(0, len(draws), batch_size)])
    greedy = False
    if check_greedy:
        _, g = run(np.ones((batch_size, lay.answer_len), bool))
        greedy = bool(g[0])
    n = len(losses)
    stderr = float(losses.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return Estimate(float(-losses.mean()), stderr, n, greedy, spent[0])


@partial(jax.jit, static_argnames=("cfg", "dispatch"))
def causal_logprob(weights: Any, cfg: ModelConfig, tokens: Array, valid: Array, answer: Array,
                   dispatch: str | None = None, next_token: Array | None = None) -> tuple[Array, Array]:
    """(sum over answer columns of log p(token | the tokens before it) [R], every answer column the argmax [R]) for
    rows [R, T] (left-padded), by one clean pass of a causal-prefix model (`cfg.causal_prefix`: clean text is the
    causal model, so this is its exact log-likelihood, the path Clover's ports score text by). `next_token` [R]: one
    more answer token after the last column, scored but never an input (a sequence one longer than the pass)."""
    logits = forward(weights, cfg, tokens, valid=valid, dispatch=dispatch).logits.astype(jnp.float32)
    if next_token is None:
        logits, nxt, scored = logits[:, :-1], tokens[:, 1:], answer[:, 1:]
    else:
        nxt = jnp.concatenate([tokens[:, 1:], next_token[:, None].astype(tokens.dtype)], axis=1)
        scored = jnp.concatenate([answer[:, 1:], jnp.ones_like(answer[:, :1])], axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    token_lp = jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
    greedy = jnp.all(jnp.where(scored, jnp.argmax(logits, -1) == nxt, True), axis=-1)
    return jnp.sum(jnp.where(scored, token_lp, 0.0), axis=-1), greedy


def exact(weights: Any, cfg: ModelConfig, prompt: Sequence[int], answer: Sequence[int], *, min_len: int = 32,
          dispatch: str | None = None) -> Estimate:
    """log p(answer | prompt) of a causal-prefix model, exactly (`causal_logprob`): standard error 0 from one pass;
    `greedy`: every answer token is the argmax after the tokens before it. The prompt needs at least one token (the
    first answer token is predicted from it). The last answer token is never an input, so prompt + answer may be
    one token longer than the model's max_seq_len (as a causal model scores lm-eval's rolling windows)."""
    if not prompt:
        raise EvaluationError("an exact causal likelihood needs a prompt of at least one token (e.g. the end token)")
    if not answer:
        raise EvaluationError("the answer to score is empty")
    seq = [*prompt, *answer]
    n = len(seq)
    if n - 1 > cfg.max_seq_len:
        raise EvaluationError(f"prompt + answer ({n} tokens) exceed the model's max_seq_len ({cfg.max_seq_len}) "
                              "by more than the last token")
    over = n > cfg.max_seq_len  # the last token only as a target
    inputs = seq[:-1] if over else seq
    width = min(seq_bucket(len(inputs), min_len), max(cfg.max_seq_len, len(inputs)))
    pad = width - len(inputs)
    tokens = np.full((width,), cfg.filler_id, np.int32)
    tokens[pad:] = inputs
    col = np.arange(width)
    valid = col >= pad
    answer_cols = col >= pad + len(prompt)
    t0 = time.perf_counter()
    lp, greedy = causal_logprob(weights, cfg, jnp.asarray(tokens[None]), jnp.asarray(valid[None]),
                                jnp.asarray(answer_cols[None]), dispatch=dispatch,
                                next_token=jnp.asarray([answer[-1]], jnp.int32) if over else None)
    return Estimate(float(lp[0]), 0.0, 1, bool(greedy[0]), time.perf_counter() - t0)
