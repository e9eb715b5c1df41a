"""Mixture-of-experts layer: routing and interchangeable dispatch strategies.

Routing is always float32. A dispatch strategy takes the routed token copies and returns the
weighted sum of expert outputs per token; every strategy computes the same function (the `dense`
one is the test oracle), they differ only in how the work is laid out:

- `dense`:  every expert on every token, weighted by the (mostly zero) routing weights.
- `ragged`: sort token copies by expert, `jax.lax.ragged_dot` grouped matmuls, unsort.
- `tiled`:  sort token copies by expert; for each expert, walk its contiguous group in tiles of
            `m` rows with a dynamic trip count, multiplying each tile by that expert's weights in
            place. Dropless, never gathers a weight matrix per tile, and does ~N*k*D*F work, so
            it is the fast path where `ragged_dot` has no real kernel (the CPU).
Expert-parallel strategies (`ep_*`, under `shard_map`) register themselves from `expert_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.layers import swiglu
from clover_jax.params import MoEWeights

Array = jax.Array


class Routing(NamedTuple):
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


def route(x: Array, w: MoEWeights, cfg: ModelConfig) -> Routing:
    """Top-k routing for tokens x [N, D]."""
    logits = x.astype(jnp.float32) @ w.router.astype(jnp.float32)
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
    counts = jnp.zeros((n_experts,), jnp.float32).at[r.experts.reshape(-1)].add(1.0)
    return MoEStats(
        load=counts / r.experts.size,
        importance=r.probs.mean(0),
        z_loss=jnp.mean(jax.nn.logsumexp(r.logits, axis=-1) ** 2),
        dropped=jnp.zeros((), jnp.float32) if dropped is None else dropped.astype(jnp.float32),
    )


# ---- dispatch strategies ----------------------------------------------------------------------
# Signature: (x [N, D], routing, weights, cfg) -> (y [N, D], dropped token copies [])

Dispatch = Callable[[Array, Routing, MoEWeights, ModelConfig], tuple[Array, Array]]
DISPATCH: dict[str, Dispatch] = {}


def register(name: str) -> Callable[[Dispatch], Dispatch]:
    def deco(fn: Dispatch) -> Dispatch:
        DISPATCH[name] = fn
        return fn

    return deco


def _no_drops() -> Array:
    return jnp.zeros((), jnp.int32)


@register("dense")
def dispatch_dense(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig) -> tuple[Array, Array]:
    combine = jnp.zeros((x.shape[0], cfg.n_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], r.experts].add(r.weights)
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, w.gate)) * jnp.einsum("nd,edf->enf", x, w.up)
    y = jnp.einsum("enf,efd->end", h, w.down)
    out = jnp.einsum("end,ne->nd", y.astype(jnp.float32), combine)
    return out.astype(x.dtype), _no_drops()


class SortedCopies(NamedTuple):
    rows: Array  # [N*k, D] token copies ordered by expert
    order: Array  # [N*k] index into the flattened (token, slot) copies
    group_sizes: Array  # [E] int32 copies per expert
    group_starts: Array  # [E] int32 first row of each expert's group


def sort_by_expert(x: Array, r: Routing, n_experts: int) -> SortedCopies:
    flat_e = r.experts.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    rows = x[order // r.experts.shape[1]]
    sizes = jnp.zeros((n_experts,), jnp.int32).at[flat_e].add(1)
    starts = jnp.cumsum(sizes) - sizes
    return SortedCopies(rows, order, sizes, starts)


def combine_sorted(y_sorted: Array, s: SortedCopies, r: Routing, dtype: jnp.dtype) -> Array:
    """Undo the sort and sum each token's k expert outputs with its routing weights."""
    n, k = r.experts.shape
    y = jnp.zeros_like(y_sorted).at[s.order].set(y_sorted).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), r.weights).astype(dtype)


@register("ragged")
def dispatch_ragged(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig) -> tuple[Array, Array]:
    s = sort_by_expert(x, r, cfg.n_experts)
    g = jax.lax.ragged_dot(s.rows, w.gate, s.group_sizes)
    u = jax.lax.ragged_dot(s.rows, w.up, s.group_sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, w.down, s.group_sizes)
    return combine_sorted(y, s, r, x.dtype), _no_drops()


def tile_rows(n_copies: int, n_experts: int) -> int:
    """Tile height for `tiled`: about the mean group size, a power of two in [8, 128]."""
    mean = max(1, n_copies // n_experts)
    m = 8
    while m < mean and m < 128:
        m *= 2
    return m


@register("tiled")
def dispatch_tiled(x: Array, r: Routing, w: MoEWeights, cfg: ModelConfig) -> tuple[Array, Array]:
    s = sort_by_expert(x, r, cfg.n_experts)
    n_rows, d = s.rows.shape
    m = tile_rows(n_rows, cfg.n_experts)
    # m spare rows so the last tile of the last group never reads or writes out of bounds.
    rows = jnp.concatenate([s.rows, jnp.zeros((m, d), s.rows.dtype)])

    def expert_body(e: int, out: Array) -> Array:
        wg, wu, wd = w.gate[e], w.up[e], w.down[e]
        start, size = s.group_starts[e], s.group_sizes[e]

        def tile_body(t: Array, out: Array) -> Array:
            row = start + t * m
            tile = jax.lax.dynamic_slice_in_dim(rows, row, m)
            y = (jax.nn.silu(tile @ wg) * (tile @ wu)) @ wd
            # Rows past this group belong to the next expert, which writes them after us.
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), row, 0)

        return jax.lax.fori_loop(0, (size + m - 1) // m, tile_body, out)

    y = jax.lax.fori_loop(0, cfg.n_experts, expert_body, jnp.zeros_like(rows))
    return combine_sorted(y[:n_rows], s, r, x.dtype), _no_drops()


def moe_block(x: Array, w: MoEWeights, cfg: ModelConfig, dispatch: str | None = None) -> tuple[Array, MoEStats]:
    """x [B, T, D] -> [B, T, D]: routed experts plus the (ungated) shared expert."""
    name = dispatch or cfg.moe_dispatch
    if name not in DISPATCH and name.startswith("ep_"):
        import clover_jax.expert_parallel  # noqa: F401  (registers the ep_* strategies)
    if name not in DISPATCH:
        raise ValueError(f"unknown MoE dispatch {name!r}; known: {', '.join(sorted(DISPATCH))}")
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    r = route(flat, w, cfg)
    y, dropped = DISPATCH[name](flat, r, w, cfg)
    if w.shared is not None:
        y = y + swiglu(flat, w.shared)
    return y.reshape(b, t, d), stats(r, cfg.n_experts, dropped)
