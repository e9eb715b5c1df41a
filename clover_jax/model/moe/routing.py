"""MoE routing in float32: which experts each token visits, with which weights, and the per-layer
statistics that the load-balancing and z-losses read."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.model.params import MoEWeights

Array = jax.Array


class Routing(NamedTuple):
    """Top-k routing of N tokens over E experts (`route`)."""

    experts: Array  # [N, k] int32 chosen experts
    weights: Array  # [N, k] float32 combine weights
    logits: Array  # [N, E] float32 router logits (z-loss)
    probs: Array  # [N, E] float32 router scores (load-balancing loss)


class MoEStats(NamedTuple):
    """Per-layer statistics for load balancing and monitoring."""

    load: Array  # [E] fraction of routed token copies each expert received
    importance: Array  # [E] mean router probability per expert
    z_loss: Array  # [] mean squared logsumexp of router logits
    dropped: Array  # [] token copies dropped by capacity-limited strategies (0 when dropless)


class Coreset(NamedTuple):
    """Which token rows form which block of a block expert coreset (`route`): rows with the same `segment` and
    `member` True are one block (they share its coreset); other rows route over every expert."""

    member: Array  # [N] bool: the row belongs to a block being denoised
    segment: Array  # [N] int32 in [0, N): its block


def coreset_mask(probs: Array, coreset: Coreset, size: int) -> Array:
    """[N, E] bool: the experts each row may route to. A block's coreset is the `size` experts with the largest
    router probability summed over its rows (the first phase: every row routed); rows outside a block may route
    anywhere."""
    n = probs.shape[0]
    total = jax.ops.segment_sum(jnp.where(coreset.member[:, None], probs, 0.0), coreset.segment, num_segments=n)
    _, top = jax.lax.top_k(total, size)  # [N segments, size]
    keep = jnp.zeros(total.shape, bool).at[jnp.arange(n)[:, None], top].set(True)[coreset.segment]
    return keep | ~coreset.member[:, None]


def route(x: Array, w: MoEWeights, cfg: ModelConfig, coreset: Coreset | None = None) -> Routing:
    """Top-k routing for tokens x [N, D]. With `coreset` (and `cfg.moe_block_coreset` > 0) the rows of a block
    being denoised take their top-k among their block's coreset experts only (`coreset_mask`; the second phase),
    their weights renormalised over it as the router's rule does over all experts."""
    logits = x.astype(jnp.float32) @ w.router.astype(jnp.float32)
    if coreset is not None and cfg.moe_block_coreset:
        first = jax.nn.softmax(logits, axis=-1) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
        logits = jnp.where(coreset_mask(first, coreset, cfg.moe_block_coreset), logits, -jnp.inf)
    k = cfg.n_experts_per_tok
    if cfg.router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        # LLaDA-MoE adds its optional bias to the probabilities and keeps it in the weights.
        top_w, top_e = jax.lax.top_k(probs + w.expert_bias if w.expert_bias is not None else probs, k)
    else:
        # LLaDA2 / DeepSeek-V3: select on sigmoid + bias inside the best groups, weight by unbiased sigmoid.
        probs = jax.nn.sigmoid(logits)
        choice = probs + w.expert_bias if w.expert_bias is not None else probs
        if cfg.n_expert_groups > 1:
            n, g = choice.shape[0], cfg.n_expert_groups
            grouped = choice.reshape(n, g, -1)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
            _, top_groups = jax.lax.top_k(group_score, cfg.topk_groups)
            keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, -1)
        _, top_e = jax.lax.top_k(choice, k)
        top_w = jnp.take_along_axis(probs, top_e, axis=-1)
    if cfg.norm_topk_prob:
        top_w = top_w / (top_w.sum(-1, keepdims=True) + (1e-20 if cfg.router == "sigmoid" else 0.0))
    top_w = top_w * cfg.routed_scaling_factor
    return Routing(top_e.astype(jnp.int32), top_w, logits, probs)


def stats(r: Routing, n_experts: int, dropped: Array | None = None) -> MoEStats:
    """One layer's MoEStats from its routing; `dropped` as float32 (0 when None)."""
    counts = jnp.zeros((n_experts,), jnp.float32).at[r.experts.reshape(-1)].add(1.0)
    return MoEStats(
        load=counts / r.experts.size,
        importance=r.probs.mean(0),
        z_loss=jnp.mean(jax.nn.logsumexp(r.logits, axis=-1) ** 2),
        dropped=jnp.zeros((), jnp.float32) if dropped is None else dropped.astype(jnp.float32),
    )
