"""The sampler's per-step arithmetic: guidance, temperature and top-k/top-p filtering, token draws,
scores and the commit rule. Pure functions over one block's logits [B, L, V]; every knob is a traced array so that
changing it never recompiles the sampling program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.errors import SamplerError

Array = jax.Array


def float_dtype() -> jnp.dtype:
    """float64 when x64 is enabled (LLaDA draws its Gumbel noise in float64), else float32."""
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def guide(cond: Array, uncond: Array, scale: Array) -> Array:
    """Classifier-free guidance as LLaDA writes it: un + (scale + 1) * (cond - un)."""
    return uncond + (scale + 1.0) * (cond - uncond)


def filter_logits(logits: Array, top_k: Array, top_p: Array) -> Array:
    """Set logits outside the top-k and then the nucleus top-p to -inf.

    top_k <= 0 and top_p >= 1 turn each filter off; with both off the sort is skipped at run time.
    The most likely token is always kept. Ties with the cut-off value are kept.
    """

    def apply(x: Array) -> Array:
        v = x.shape[-1]
        srt = -jnp.sort(-x, axis=-1)  # descending
        idx = jnp.arange(v)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
        srt_k = jnp.where(idx < k, srt, -jnp.inf)
        p = jax.nn.softmax(srt_k, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # probability mass of the strictly better tokens
        keep = (idx < k) & ((before < top_p) | (idx == 0))
        n_keep = jnp.sum(keep, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
        return jnp.where(x >= cutoff, x, -jnp.inf)

    active = (top_k > 0) | (top_p < 1.0)
    return jax.lax.cond(active, apply, lambda x: x, logits)


def draw_tokens(logits: Array, key: Array, temperature: Array) -> Array:
    """Greedy argmax at temperature 0, else a Gumbel-max draw from softmax(logits / T).

    argmax(logits / T + g) with g ~ Gumbel is LLaDA's exp(logits) / (-log u)^T in log space.
    """

    def sample(x: Array) -> Array:
        dt = float_dtype()
        g = jax.random.gumbel(key, x.shape, dt)
        return jnp.argmax(x.astype(dt) / temperature.astype(dt) + g, axis=-1).astype(jnp.int32)

    greedy = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    return jax.lax.cond(temperature > 0, sample, greedy, logits)


def sample(logits: Array, key: Array, temperature: Array, top_k: Array, top_p: Array, mask_id: int,
           sampled_confidence: Array) -> tuple[Array, Array]:
    """Draw one token per position of `logits` [B, L, V]; returns (tokens [B, L], the logits the scores
    are computed from [B, L, V]).

    The mask token is never drawn (a committed mask would be no token at all). Its logit still counts
    in the scores' normaliser, so a confidence is the model's own probability of the drawn token.
    Temperature 0: the argmax; top-k / top-p are ignored (they never remove the argmax) and the scores
    come from the unfiltered logits, as in every reference generator. Temperature T > 0: logits / T,
    then top-k, then top-p (transformers' order), then a Gumbel-max draw; the scores come from the raw
    logits at temperature 1 (`sampled_confidence` False: LLaDA, Fast-dLLM) or from the tempered,
    filtered distribution the token was drawn from (True: LLaDA2).
    """
    x = logits.astype(jnp.float32)
    drawable = x.at[..., mask_id].set(-jnp.inf)

    def hot(d: Array) -> tuple[Array, Array]:
        scaled = filter_logits(d / temperature, top_k, top_p)
        return draw_tokens(scaled, key, jnp.float32(1.0)), scaled

    def cold(d: Array) -> tuple[Array, Array]:
        return jnp.argmax(d, axis=-1).astype(jnp.int32), d

    tokens, dist = jax.lax.cond(temperature > 0, hot, cold, drawable)
    return tokens, jnp.where(sampled_confidence & (temperature > 0), dist, x)


class Scores(NamedTuple):
    """One block's scores, each [B, L]: what `select_commits` decides from."""

    rank_score: Array  # [B, L] higher = commit first (the chosen remasking strategy)
    confidence: Array  # [B, L] probability of the drawn token (what the threshold compares)
    entropy: Array  # [B, L] entropy of the filtered distribution, nats


class Distribution(NamedTuple):
    """What a remasking strategy may rank by, for one block."""

    p: Array  # [B, L, V] softmax of the filtered logits
    confidence: Array  # [B, L] probability of the drawn token
    entropy: Array  # [B, L] nats


def _margin(d: Distribution, key: Array) -> Array:
    # top-1 minus top-2 with two max-reductions: lax.top_k inside a while loop costs ~20x more on CPU
    first = jnp.argmax(d.p, axis=-1)
    p1 = jnp.max(d.p, axis=-1)
    p2 = jnp.max(jnp.where(jnp.arange(d.p.shape[-1]) == first[..., None], -1.0, d.p), axis=-1)
    return p1 - p2


# The remasking strategies by name: each ranks a block's positions, higher = commit first.
REMASKING: dict[str, Callable[[Distribution, Array], Array]] = {
    "low_confidence": lambda d, key: d.confidence,  # probability of the drawn token (LLaDA)
    "random": lambda d, key: jax.random.uniform(key, d.confidence.shape, jnp.float32),
    "margin": _margin,  # top-1 minus top-2 probability
    "entropy": lambda d, key: -d.entropy,  # lowest entropy first
}


def remasking_index(name: str) -> int:
    """The traced switch value of a remasking strategy (its place in REMASKING)."""
    if name not in REMASKING:
        raise SamplerError(f"unknown remasking strategy {name!r}; choose one of {tuple(REMASKING)}")
    return list(REMASKING).index(name)


def score_tokens(logits: Array, tokens: Array, strategy: Array, key: Array) -> Scores:
    """Scores of a block from `logits` (what `sample` returns for them); `strategy` is a traced
    `remasking_index`. Confidence is softmax(logits) at the drawn token."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    conf = jnp.take_along_axis(p, tokens[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    d = Distribution(p, conf, entropy)
    rank = jax.lax.switch(strategy, list(REMASKING.values()), d, key)
    return Scores(rank, conf, entropy)


def transfer_count(n_masked: Array, steps: Array, step: Array) -> Array:
    """LLaDA's linear schedule: n // steps per step, the first n % steps steps one more."""
    steps = jnp.maximum(steps, 1)
    return n_masked // steps + (step < n_masked % steps).astype(n_masked.dtype)


def _rank_desc(x: Array) -> Array:
    """Rank of each entry in its row, 0 = largest; ties go to the lower index."""
    order = jnp.argsort(-x, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def entropy_bound_count(entropy: Array, masked: Array, bound: Array) -> tuple[Array, Array]:
    """EB-sampler: the longest lowest-entropy-first prefix whose entropy sum minus its largest entry
    stays within `bound`. Returns (rank by ascending entropy [B, L], prefix length [B], at least 1)."""
    h = jnp.where(masked, entropy, jnp.inf)
    order = jnp.argsort(h, axis=-1, stable=True)
    hs = jnp.take_along_axis(h, order, axis=-1)
    finite = jnp.isfinite(hs)
    total = jnp.cumsum(jnp.where(finite, hs, 0.0), axis=-1)
    worst = jax.lax.cummax(jnp.where(finite, hs, 0.0), axis=hs.ndim - 1)
    n = jnp.sum(finite & (total - worst <= bound), axis=-1)
    return jnp.argsort(order, axis=-1, stable=True), jnp.maximum(n, 1)


def select_commits(
    scores: Scores, masked: Array, n_scheduled: Array, threshold: Array, entropy_bound: Array
) -> Array:
    """Which masked positions to commit this step [B, L].

    Always the `n_scheduled` best by the strategy's score (the linear schedule), and always at
    least one while masks remain. On top of that, when enabled (> 0):
      threshold      every position whose confidence > threshold (with low_confidence ranking this
                     is exactly LLaDA2's rule: all above threshold if at least the scheduled number
                     qualify, else the scheduled top-k; with one token a step it is Fast-dLLM's);
      entropy_bound  the EB-sampler prefix of lowest-entropy positions.
    """
    s = jnp.where(masked, scores.rank_score, -jnp.inf)
    rank = _rank_desc(s)
    commit = rank < jnp.maximum(n_scheduled, 1)[:, None]
    commit |= (threshold > 0) & (scores.confidence > threshold)
    h_rank, n_eb = entropy_bound_count(scores.entropy, masked, entropy_bound)
    commit |= (entropy_bound > 0) & (h_rank < n_eb[:, None])
    return commit & masked
