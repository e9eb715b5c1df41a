"""Masked-diffusion training objective, the block-diffusion input arrangement and MoE auxiliary losses.

Objective (LLaDA / MDLM): draw a noise level t ~ U(eps, 1), replace each scored token by [MASK] with
probability t, and score the model's prediction of the original token at masked positions with
cross-entropy weighted by 1/t; normalised by the number of scored tokens this is an upper bound on
the negative log-likelihood per token.

Block diffusion (block-causal configs): every block draws its own t; the noisy sequence and the clean
one run side by side in one pass of 2L positions so that each noisy block sees exactly the context
it will have at inference: the committed, clean blocks before it (`model.masks.block_diffusion_mask`).
Both halves use the same positions. Logits are computed for the noisy half only. Gated DeltaNet layers
(hybrid configs) read the two halves as two streams: each noisy block starts from the recurrent state
and conv inputs of the clean blocks before it (`gated_deltanet.mixer`, two_stream).

Causal-prefix models (`cfg.causal_prefix`, Clover as its ports run it) run the clean half as a plain causal
language model: the path that commits every block, scores exact likelihoods and checks self-speculative drafts.
`diffusion_terms(..., causal=True)` also returns that path's next-token cross-entropy on the clean half
(`LossTerms.causal_ce`), the objective that trains it; a model converted from Qwen3.6 has it from pretraining.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import masks
from clover_jax.model.moe import MoEStats
from clover_jax.model.transformer import ForwardOut, forward

Array = jax.Array


class LossTerms(NamedTuple):
    """Sums over one batch (divide by the scored-token count for means)."""

    weighted_ce: Array  # [] sum over masked positions of CE / t
    ce: Array  # [] sum over masked positions of CE (unweighted)
    correct: Array  # [] masked positions whose argmax is the original token
    n_masked: Array  # [] masked positions
    moe: MoEStats | None  # stacked over MoE layers
    causal_ce: Array  # [] sum of the clean half's next-token CE (0 unless `causal`)
    n_causal: Array  # [] next-token predictions scored (0 unless `causal`)


def n_blocks(cfg: ModelConfig, seq_len: int, grid: str = "absolute") -> int:
    """Noise levels drawn per sequence: one per block for block-causal configs (one more on the prompt grid,
    whose response blocks start mid-grid), else one."""
    if not cfg.is_block_causal:
        return 1
    return -(-seq_len // cfg.block_size) + (grid == "prompt")


def sample_noise_levels(key: Array, shape: tuple[int, ...], eps: float, t_max: float = 1.0) -> Array:
    """t in [eps, t_max): stratified over all entries (one uniform offset, evenly spaced, shuffled), which
    lowers the variance of the batch loss at no cost (MDLM's low-discrepancy sampler)."""
    n = 1
    for s in shape:
        n *= s
    k_off, k_perm = jax.random.split(key)
    u = jnp.mod(jax.random.uniform(k_off, ()) + jnp.arange(n, dtype=jnp.float32) / n, 1.0)
    u = jax.random.permutation(k_perm, u)
    return (eps + (t_max - eps) * u).reshape(shape)


def block_noise_levels(key: Array, cfg: ModelConfig, rows: int, seq_len: int, grid: str, eps: float,
                       t_max: float = 1.0) -> Array:
    """Noise levels [rows, n_blocks(cfg, seq_len, grid)] for a batch: the absolute grid's from `key` (so plain
    text draws the same levels on both grids), the prompt grid's extra block from a key of its own."""
    n_abs = n_blocks(cfg, seq_len)
    t = sample_noise_levels(key, (rows, n_abs), eps, t_max)
    if n_blocks(cfg, seq_len, grid) > n_abs:
        t = jnp.concatenate([t, sample_noise_levels(jax.random.fold_in(key, 1), (rows, 1), eps, t_max)], axis=1)
    return t


def corrupt(key: Array, tokens: Array, loss_mask: Array, t_pos: Array, mask_id: int) -> tuple[Array, Array]:
    """Mask each scorable token with probability t_pos: (noisy tokens, masked positions)."""
    masked = (jax.random.uniform(key, tokens.shape) < t_pos) & loss_mask
    return jnp.where(masked, mask_id, tokens), masked


def denoising_forward(weights: Any, cfg: ModelConfig, noisy: Array, clean: Array, valid: Array,
                      dispatch: str | None = None, remat: bool = False, mesh: MeshRules | None = None,
                      blocks: Array | None = None, clean_logits: bool = False) -> ForwardOut:
    """Logits [B, L, V] for the noisy sequence: next to the clean one for block-causal configs
    (each noisy block sees the clean blocks before it), alone for bidirectional ones. blocks [B, L]: the
    block ids (default `masks.block_ids`, the absolute grid). clean_logits (block-causal configs): logits
    [B, 2L, V] for both halves, the clean half's after the noisy half's."""
    seq = noisy.shape[1]
    pos = masks.positions(valid)
    blk = masks.block_ids(cfg, valid) if blocks is None else blocks
    if cfg.is_block_causal:
        return forward(weights, cfg, jnp.concatenate([noisy, clean], axis=1), jnp.concatenate([pos, pos], axis=1),
                       masks.block_diffusion_mask(valid, blk, cfg.causal_prefix),
                       logits_len=None if clean_logits else seq, dispatch=dispatch,
                       remat=remat, mesh=mesh, valid=jnp.concatenate([valid, valid], axis=1),
                       blocks=jnp.concatenate([blk, blk], axis=1), two_stream=True)
    return forward(weights, cfg, noisy, pos, masks.full_mask(cfg, valid), dispatch=dispatch, remat=remat, mesh=mesh,
                   valid=valid)


def diffusion_terms(
    weights: Any, cfg: ModelConfig, tokens: Array, valid: Array, loss_mask: Array, t_blocks: Array, key: Array,
    dispatch: str | None = None, remat: bool = False, mesh: MeshRules | None = None, grid: str = "absolute",
    causal: bool = False,
) -> LossTerms:
    """Loss sums for one batch [B, L] at noise levels t_blocks [B, n_blocks(cfg, L, grid)] (n_blocks = 1 unless
    block-causal), blocks laid on `grid` (`masks.training_block_ids`). causal (causal-prefix configs only): also
    the clean half's next-token CE, over the scored tokens that follow a real one."""
    if causal and not cfg.causal_prefix:
        raise ValueError(f"a causal next-token loss needs a causal-prefix model; {cfg.name} runs no causal path")
    seq = tokens.shape[1]
    blk = masks.training_block_ids(cfg, valid, loss_mask, grid)
    t_pos = jnp.take_along_axis(t_blocks, blk if cfg.is_block_causal else jnp.zeros_like(blk), axis=1)
    noisy, masked = corrupt(key, tokens, loss_mask & valid, t_pos, cfg.mask_token_id)
    out = denoising_forward(weights, cfg, noisy, tokens, valid, dispatch, remat, mesh, blocks=blk, clean_logits=causal)
    logits = out.logits[:, :seq]
    ce = _token_ce(logits, tokens)
    m = masked.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == tokens).astype(jnp.float32) * m
    causal_ce = n_causal = jnp.zeros((), jnp.float32)
    if causal:  # the clean half's logits at i predict token i + 1
        nxt = (loss_mask & valid)[:, 1:] & valid[:, :-1]
        w = nxt.astype(jnp.float32)
        causal_ce = jnp.sum(_token_ce(out.logits[:, seq:-1], tokens[:, 1:]) * w)
        n_causal = w.sum()
    return LossTerms(jnp.sum(ce * m / t_pos), jnp.sum(ce * m), correct.sum(), m.sum(), out.moe_stats, causal_ce,
                     n_causal)


def _token_ce(logits: Array, targets: Array) -> Array:
    """Cross-entropy [B, L] of `targets` [B, L] under `logits` [B, L, V]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def load_balancing_loss(st: MoEStats, n_experts: int) -> Array:
    """Switch-Transformer auxiliary loss E * sum_e load_e * importance_e, averaged over layers (1.0 when uniform)."""
    return jnp.mean(n_experts * jnp.sum(st.load * st.importance, axis=-1))


def router_z_loss(st: MoEStats) -> Array:
    """Mean squared logsumexp of the router logits, averaged over layers (ST-MoE's z-loss)."""
    return jnp.mean(st.z_loss)
