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
    """float64 when x64 is enabled (LLaDA draws its sampling noise in float64), else float32."""
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def guide(cond: Array, uncond: Array, scale: Array) -> Array:
    """Classifier-free guidance as LLaDA writes it: un + (scale + 1) * (cond - un)."""
    return uncond + (scale + 1.0) * (cond - uncond)


def _order_keys(x: Array) -> Array:
    """uint32 keys that order like the float32 values of `x` (-inf lowest; NaN is not expected)."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _least_key(keys: Array, below: Callable[[Array], Array]) -> Array:
    """The least key t [..., 1] with `below(t)` true, for `below` monotone (false, then true, as t
    grows) and true at the row's largest key: 32 halvings of [smallest key, largest key], each one
    reduction over the row (no sort: XLA's CPU sort of a 32k vocabulary costs ~10 ms a row)."""
    lo = jnp.min(keys, axis=-1, keepdims=True)
    hi = jnp.max(keys, axis=-1, keepdims=True)
    done = below(lo)

    def halve(_: int, bounds: tuple[Array, Array]) -> tuple[Array, Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = below(mid)
        moving = hi - lo > 1
        return jnp.where(moving & ~ok, mid, lo), jnp.where(moving & ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jnp.where(done, lo, hi)


def filter_logits(logits: Array, top_k: Array, top_p: Array) -> Array:
    """Set logits outside the top-k and then the nucleus top-p to -inf.

    top_k <= 0 and top_p >= 1 turn each filter off; with both off nothing runs. A token stays in the
    top-k when fewer than k tokens are strictly more likely, and in the nucleus when the tokens strictly
    more likely than it (renormalised over the top-k) hold less than top_p: the sorted-cumsum rule of
    transformers and LLaDA2, with ties at the cut-off kept. The most likely token is always kept. The
    cut-offs are found by bisection on the values' bit patterns, exact and without sorting the vocabulary.
    """

    def apply(x: Array) -> Array:
        x = x.astype(jnp.float32)
        keys = _order_keys(x)
        k = jnp.where(top_k > 0, top_k, x.shape[-1])
        cut_k = _least_key(keys, lambda t: jnp.sum(keys > t, axis=-1, keepdims=True) < k)
        x = jnp.where(keys >= cut_k, x, -jnp.inf)
        p = jax.nn.softmax(x, axis=-1)

        def nucleus(x: Array) -> Array:
            cut_p = _least_key(keys, lambda t: jnp.sum(jnp.where(keys > t, p, 0.0), axis=-1, keepdims=True) < top_p)
            return jnp.where(keys >= cut_p, x, -jnp.inf)

        return jax.lax.cond(top_p < 1.0, nucleus, lambda x: x, x)

    active = (top_k > 0) | (top_p < 1.0)
    return jax.lax.cond(active, apply, lambda x: x.astype(jnp.float32), logits)


_CHUNK = 128  # the inverse-CDF draw's inner width: one pass over the vocabulary, then one chunk


def _inverse_cdf(x: Array, u: Array) -> Array:
    """The token whose cumulative mass (in vocabulary order) first exceeds u * total, for logits x
    [..., V] and u [...] uniform in [0, 1): an exact draw from softmax(x) from one uniform per position.
    Two levels (chunk masses, then one chunk's cumulative sum), so the vocabulary is read once. A draw
    that rounding would put on a zero-probability token falls back to the argmax."""
    dt = x.dtype
    v = x.shape[-1]
    n_chunks = -(-v // _CHUNK)
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, n_chunks * _CHUNK - v)]).reshape(*x.shape[:-1], n_chunks, _CHUNK)
    mass = jnp.sum(e, axis=-1)  # [..., n_chunks]
    cum = jnp.cumsum(mass, axis=-1)
    target = u.astype(dt) * cum[..., -1]
    chunk = jnp.minimum(jnp.sum(cum <= target[..., None], axis=-1), n_chunks - 1)
    inside = jnp.take_along_axis(e, chunk[..., None, None], axis=-2)[..., 0, :]  # [..., CHUNK]
    before = jnp.take_along_axis(cum - mass, chunk[..., None], axis=-1)[..., 0]
    offset = jnp.minimum(jnp.sum(jnp.cumsum(inside, axis=-1) <= (target - before)[..., None], axis=-1), _CHUNK - 1)
    token = chunk * _CHUNK + offset
    hit = jnp.take_along_axis(inside, offset[..., None], axis=-1)[..., 0] > 0
    return jnp.where(hit, token, jnp.argmax(x, axis=-1)).astype(jnp.int32)


def draw_tokens(logits: Array, key: Array, temperature: Array) -> Array:
    """Greedy argmax at temperature 0, else a draw from softmax(logits / T).

    The draw is by inverse CDF, one uniform per position (the same distribution as LLaDA's Gumbel-max
    exp(logits) / (-log u)^T, without a noise draw and two logarithms per logit: 8x faster at a 32k
    vocabulary on CPU). In float64 when x64 is on, as LLaDA draws.
    """

    def sample(x: Array) -> Array:
        dt = float_dtype()
        u = jax.random.uniform(key, x.shape[:-1], dt)
        return _inverse_cdf(x.astype(dt) / temperature.astype(dt), u)

    greedy = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    return jax.lax.cond(temperature > 0, sample, greedy, logits)


def _without(x: Array, token: int) -> Array:
    """`x` with `token`'s logit at -inf (a select XLA fuses into what reads it, not a copy)."""
    return jnp.where(jnp.arange(x.shape[-1]) == token, -jnp.inf, x)


def _hot(x: Array, key: Array, temperature: Array, top_k: Array, top_p: Array, mask_id: int,
         sampled_confidence: Array) -> tuple[Array, Array]:
    scaled = filter_logits(_without(x, mask_id) / temperature, top_k, top_p)
    return draw_tokens(scaled, key, jnp.float32(1.0)), jnp.where(sampled_confidence, scaled, x)


def sample(logits: Array, key: Array, temperature: Array, top_k: Array, top_p: Array, mask_id: int,
           sampled_confidence: Array) -> tuple[Array, Array]:
    """Draw one token per position of `logits` [B, L, V]; returns (tokens [B, L], the logits the scores
    are computed from [B, L, V]).

    The mask token is never drawn (a committed mask would be no token at all). Its logit still counts
    in the scores' normaliser, so a confidence is the model's own probability of the drawn token.
    Temperature 0: the argmax; top-k / top-p are ignored (they never remove the argmax) and the scores
    come from the unfiltered logits, as in every reference generator. Temperature T > 0: logits / T,
    then top-k, then top-p (transformers' order), then a draw (`draw_tokens`); the scores come from the raw
    logits at temperature 1 (`sampled_confidence` False: LLaDA, Fast-dLLM) or from the tempered,
    filtered distribution the token was drawn from (True: LLaDA2).
    """
    x = logits.astype(jnp.float32)

    def cold(x: Array) -> tuple[Array, Array]:
        return jnp.argmax(_without(x, mask_id), axis=-1).astype(jnp.int32), x

    return jax.lax.cond(temperature > 0, lambda x: _hot(x, key, temperature, top_k, top_p, mask_id,
                                                        sampled_confidence), cold, x)


def sample_and_score(logits: Array, k_draw: Array, k_score: Array, temperature: Array, top_k: Array,
                     top_p: Array, mask_id: int, sampled_confidence: Array, strategy: Array,
                     need_entropy: Array | bool = True) -> tuple[Array, Scores]:
    """`sample` then `score_tokens` in one: (tokens [B, L], Scores), with only [B, L] arrays leaving
    the temperature branch (the sampling program's per-step work; at temperature 0 it reads the logits
    a few times in fused reductions and writes no [B, L, V] array). k_draw / k_score: the keys of
    `sample` and `score_tokens`."""
    x = logits.astype(jnp.float32)

    def hot(x: Array) -> tuple[Array, Scores]:
        tokens, dist = _hot(x, k_draw, temperature, top_k, top_p, mask_id, sampled_confidence)
        return tokens, score_tokens(dist, tokens, strategy, k_score, need_entropy)

    def cold(x: Array) -> tuple[Array, Scores]:
        tokens = jnp.argmax(_without(x, mask_id), axis=-1).astype(jnp.int32)
        return tokens, score_tokens(x, tokens, strategy, k_score, need_entropy)

    return jax.lax.cond(temperature > 0, hot, cold, x)


class Scores(NamedTuple):
    """One block's scores, each [B, L]: what `select_commits` decides from."""

    rank_score: Array  # [B, L] higher = commit first (the chosen remasking strategy)
    confidence: Array  # [B, L] probability of the drawn token (what the threshold compares)
    entropy: Array  # [B, L] entropy of the filtered distribution, nats (zeros when not asked for)


class Distribution(NamedTuple):
    """What a remasking strategy may rank by, for one block."""

    logits: Array  # [B, L, V] the logits the scores come from (-inf = filtered out)
    lse: Array  # [B, L] their log-sum-exp
    confidence: Array  # [B, L] probability of the drawn token
    entropy: Array  # [B, L] nats


def _margin(d: Distribution, key: Array) -> Array:
    # top-1 minus top-2 probability, by two max-reductions over the logits (lax.top_k inside a while
    # loop costs ~20x more on CPU); a tie for the top gives 0
    first = jnp.argmax(d.logits, axis=-1)
    x1 = jnp.max(d.logits, axis=-1)
    x2 = jnp.max(jnp.where(jnp.arange(d.logits.shape[-1]) == first[..., None], -jnp.inf, d.logits), axis=-1)
    return jnp.exp(x1 - d.lse) - jnp.exp(x2 - d.lse)


# The remasking strategies by name: each ranks a block's positions, higher = commit first.
REMASKING: dict[str, Callable[[Distribution, Array], Array]] = {
    "low_confidence": lambda d, key: d.confidence,  # probability of the drawn token (LLaDA)
    "random": lambda d, key: jax.random.uniform(key, d.confidence.shape, jnp.float32),
    "margin": _margin,  # top-1 minus top-2 probability
    "entropy": lambda d, key: -d.entropy,  # lowest entropy first
}
ENTROPY = list(REMASKING).index("entropy")


def remasking_index(name: str) -> int:
    """The traced switch value of a remasking strategy (its place in REMASKING)."""
    if name not in REMASKING:
        raise SamplerError(f"unknown remasking strategy {name!r}; choose one of {tuple(REMASKING)}")
    return list(REMASKING).index(name)


def _entropy(x: Array, m: Array, lse: Array) -> Array:
    # H = lse - E_p[x], with filtered (-inf) entries contributing nothing
    e = jnp.exp(x - m[..., None])
    ex = jnp.sum(jnp.where(e > 0, e * x, 0.0), axis=-1) / jnp.sum(e, axis=-1)
    return lse - ex


def score_tokens(logits: Array, tokens: Array, strategy: Array, key: Array,
                 need_entropy: Array | bool = True) -> Scores:
    """Scores of a block from `logits` (what `sample` returns for them); `strategy` is a traced
    `remasking_index`. Confidence is softmax(logits) at the drawn token. The entropy is computed when
    `need_entropy` (a traced bool: the entropy strategy or the entropy bound is in use) and is zeros
    otherwise; the entropy strategy always gets it. Only reductions over the vocabulary: no [B, L, V]
    array is written."""
    x = logits.astype(jnp.float32)
    m = jnp.max(x, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = m + jnp.log(jnp.sum(jnp.exp(x - m[..., None]), axis=-1))
    conf = jnp.exp(jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0] - lse)
    want = jnp.asarray(need_entropy) | (strategy == ENTROPY)
    entropy = jax.lax.cond(want, _entropy, lambda x, m, lse: jnp.zeros_like(lse), x, m, lse)
    d = Distribution(x, lse, conf, entropy)
    rank = jax.lax.switch(strategy, list(REMASKING.values()), d, key)
    return Scores(rank, conf, entropy)


def fill_after_end(tokens: Array, eos_id: int | None, mask_id: int, eos_stop: Array) -> Array:
    """tokens [B, W] with every column after a row's first end token set to the end token, for rows
    where `eos_stop` ([B] or scalar) holds and nothing before that end token is still masked (the row
    has stopped). A model without an end token (None) never stops early."""
    if eos_id is None:
        return tokens
    w = tokens.shape[1]
    col = jnp.arange(w)[None]
    is_eos = tokens == eos_id
    first = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), w)
    open_before = jnp.any((tokens == mask_id) & (col < first[:, None]), axis=1)
    stop = eos_stop & (first < w) & ~open_before
    return jnp.where(stop[:, None] & (col > first[:, None]), eos_id, tokens)


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


def penalize(logits: Array, seen: Array, counted: Array, presence: Array, frequency: Array,
             repetition: Array) -> Array:
    """Logits [B, L, V] with the response penalties applied: for each token with count c > 0 among `seen` [B, H]
    where `counted` [B, H] (the response's committed tokens), a positive logit divided by `repetition` and a
    negative one multiplied by it (transformers' RepetitionPenaltyLogitsProcessor), then `presence` and
    `frequency` * c subtracted (OpenAI's presence and frequency penalties). The penalties are scalars or [B]
    (per row); all off (0, 0, 1) leaves the logits as they are without building the counts."""
    b, v = logits.shape[0], logits.shape[-1]

    def per_row(a: Array) -> Array:
        return jnp.reshape(jnp.broadcast_to(a, (b,)), (b, 1, 1)).astype(jnp.float32)

    def apply(x: Array) -> Array:
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], seen.shape)
        counts = jnp.zeros((b, v), jnp.float32).at[rows, seen].add(counted.astype(jnp.float32))[:, None, :]
        hit = counts > 0
        rep = per_row(repetition)
        x = jnp.where(hit, jnp.where(x > 0, x / rep, x * rep), x)
        return x - per_row(presence) * hit - per_row(frequency) * counts

    on = jnp.any(presence != 0) | jnp.any(frequency != 0) | jnp.any(repetition != 1)
    x = logits.astype(jnp.float32)
    return jax.lax.cond(on, apply, lambda x: x, x)
