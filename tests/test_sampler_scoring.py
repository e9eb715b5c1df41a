"""Unit tests of the sampler's per-step arithmetic against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.sampler.scoring import (
    REMASKING,
    Scores,
    draw_tokens,
    entropy_bound_count,
    filter_logits,
    guide,
    remasking_index,
    sample,
    sample_and_score,
    score_tokens,
    select_commits,
    transfer_count,
)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_guidance_formula_is_llada_s():
    cond, un = jnp.array([1.0, 0.9, 0.0]), jnp.array([1.0, 0.0, 0.5])
    np.testing.assert_allclose(guide(cond, un, jnp.float32(1.0)), [1.0, 1.8, -0.5])
    np.testing.assert_allclose(guide(cond, un, jnp.float32(0.0)), cond)


def test_top_k_and_top_p_filters():
    x = jnp.log(jnp.array([[0.5, 0.05, 0.3, 0.15]]))
    kept = lambda y: np.isfinite(np.asarray(y))[0].tolist()
    assert kept(filter_logits(x, jnp.int32(0), jnp.float32(1.0))) == [True] * 4
    assert kept(filter_logits(x, jnp.int32(2), jnp.float32(1.0))) == [True, False, True, False]
    # nucleus 0.7: 0.5 alone is < 0.7, so 0.3 joins; 0.8 >= 0.7 stops there
    assert kept(filter_logits(x, jnp.int32(0), jnp.float32(0.7))) == [True, False, True, False]
    assert kept(filter_logits(x, jnp.int32(0), jnp.float32(0.4))) == [True, False, False, False]
    # top-k first, then top-p renormalised over the k kept: 0.5/0.8 = 0.625 < 0.9 keeps the second
    assert kept(filter_logits(x, jnp.int32(2), jnp.float32(0.9))) == [True, False, True, False]
    assert kept(filter_logits(x, jnp.int32(3), jnp.float32(0.95))) == [True, False, True, True]


def test_greedy_and_temperature_draws():
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    assert int(draw_tokens(logits, jax.random.key(0), jnp.float32(0.0))[0]) == 1
    many = jnp.broadcast_to(logits, (20000, 3))
    draws = np.asarray(draw_tokens(many, jax.random.key(1), jnp.float32(1.0)))
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 20000, [0.1, 0.6, 0.3], atol=0.015)
    # temperature 0.5 sharpens: p^2 normalised
    draws = np.asarray(draw_tokens(many, jax.random.key(2), jnp.float32(0.5)))
    p2 = np.array([0.01, 0.36, 0.09]) / 0.46
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 20000, p2, atol=0.015)


def test_draws_across_chunks_follow_the_softmax_and_skip_filtered_tokens():
    # 300 tokens: three chunks of the inverse-CDF draw, the last one partial; mass in each of them
    rng = np.random.default_rng(0)
    x = np.full(300, -np.inf, np.float32)
    live = np.array([0, 5, 127, 128, 200, 255, 256, 299])
    x[live] = rng.normal(size=live.size).astype(np.float32)
    p = np.exp(x[live] - x[live].max())
    p /= p.sum()
    draws = np.asarray(draw_tokens(jnp.broadcast_to(jnp.asarray(x), (40000, 300)), jax.random.key(5),
                                   jnp.float32(1.0)))
    assert set(np.unique(draws)) <= set(live.tolist())  # never a filtered (-inf) token
    np.testing.assert_allclose(np.bincount(draws, minlength=300)[live] / 40000, p, atol=0.01)


def test_scores_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 2
    tokens = logits.argmax(-1).astype(np.int32)
    p = _softmax(logits.astype(np.float64))
    conf = np.take_along_axis(p, tokens[..., None], -1)[..., 0]
    top2 = -np.sort(-p, -1)[..., :2]
    ent = -(p * np.log(p)).sum(-1)
    expect = {"low_confidence": conf, "margin": top2[..., 0] - top2[..., 1], "entropy": -ent}
    assert set(REMASKING) == {*expect, "random"}  # every strategy of the table is checked here
    for name, want in expect.items():
        s = score_tokens(jnp.asarray(logits), jnp.asarray(tokens), jnp.int32(remasking_index(name)),
                         jax.random.key(0))
        np.testing.assert_allclose(s.rank_score, want, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(s.confidence, conf, rtol=1e-5)
        np.testing.assert_allclose(s.entropy, ent, rtol=1e-5)
    r = score_tokens(jnp.asarray(logits), jnp.asarray(tokens), jnp.int32(remasking_index("random")),
                     jax.random.key(0)).rank_score
    assert ((np.asarray(r) >= 0) & (np.asarray(r) < 1)).all() and len(np.unique(r)) == r.size


@pytest.mark.parametrize("n,steps", [(8, 3), (32, 32), (5, 8), (32, 4)])
def test_linear_schedule(n, steps):
    counts = [int(transfer_count(jnp.array([n]), jnp.int32(steps), jnp.int32(i))[0]) for i in range(steps)]
    assert sum(counts) == n and max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def _scores(conf, rank=None, ent=None):
    conf = jnp.asarray([conf], jnp.float32)
    return Scores(conf if rank is None else jnp.asarray([rank], jnp.float32), conf,
                  jnp.zeros_like(conf) if ent is None else jnp.asarray([ent], jnp.float32))


def test_commit_rule_schedule_threshold_and_at_least_one():
    conf = [0.99, 0.2, 0.96, 0.5, 0.97, 0.1]
    masked = jnp.array([[True, True, True, True, False, True]])  # 0.97 is already committed
    sel = lambda n, th: np.asarray(select_commits(_scores(conf), masked, jnp.array([n]), jnp.float32(th),
                                                  jnp.float32(0.0)))[0].tolist()
    assert sel(2, 0.0) == [True, False, True, False, False, False]  # the scheduled top-2 by confidence
    assert sel(1, 0.95) == [True, False, True, False, False, False]  # all masked above the threshold
    assert sel(3, 0.95) == [True, False, True, True, False, False]  # schedule wins when it asks for more
    assert sel(0, 0.999) == [True, False, False, False, False, False]  # nobody qualifies: still one
    # the threshold compares confidence even when another strategy ranks
    rank = [0.0, 0.9, 0.1, 0.2, 0.3, 0.8]
    got = np.asarray(select_commits(_scores(conf, rank=rank), masked, jnp.array([1]), jnp.float32(0.95),
                                    jnp.float32(0.0)))[0].tolist()
    assert got == [True, True, True, False, False, False]


def test_entropy_bound_prefix():
    ent = np.array([0.05, 2.0, 0.01, 0.3, 0.02, 1.0], np.float32)
    masked = jnp.ones((1, 6), bool)
    for bound in (0.001, 0.03, 0.1, 0.5, 10.0):
        # numpy reference: ascending entropies, largest prefix with sum - max <= bound
        hs = np.sort(ent)
        ok = (np.cumsum(hs) - np.maximum.accumulate(hs)) <= bound
        want_n = max(int(ok.sum()), 1)
        _, n = entropy_bound_count(jnp.asarray([ent]), masked, jnp.float32(bound))
        assert int(n[0]) == want_n, bound
        got = np.asarray(select_commits(_scores(np.zeros(6), rank=-ent, ent=ent), masked, jnp.array([1]),
                                        jnp.float32(0.0), jnp.float32(bound)))[0]
        assert got.sum() == want_n and set(np.flatnonzero(got)) == set(np.argsort(ent)[:want_n])


def _sorted_rule(x: np.ndarray, k: int, p: float) -> np.ndarray:
    """The sorted-cumsum rule of transformers / LLaDA2 in float64 (what `filter_logits` bisects for)."""
    keep = np.zeros(x.shape, bool)
    for r in np.ndindex(x.shape[:-1]):
        row = x[r].astype(np.float64)
        srt = -np.sort(-row)
        kk = len(row) if k <= 0 else min(k, len(row))
        cut = srt[kk - 1]  # ties with the k-th value stay
        row = np.where(row >= cut, row, -np.inf)
        if p < 1.0:
            q = np.exp(row - row.max())
            q /= q.sum()
            before = np.array([q[row > v].sum() for v in row])  # mass strictly more likely
            if np.min(np.abs(before[np.isfinite(row)] - p)) < 1e-4:
                return None  # too close to the cut-off for float32 sums to decide alike
            row = np.where(before < p, row, -np.inf)
        keep[r] = np.isfinite(row)
    return keep


@pytest.mark.parametrize("k,p", [(0, 0.9), (5, 1.0), (40, 0.6), (1, 0.3), (300, 0.95), (0, 0.05)])
def test_bisected_filters_match_the_sorted_rule(k, p):
    rng = np.random.default_rng(k * 100 + int(p * 100))
    tried = 0
    filt = jax.jit(filter_logits)  # one compile for every trial
    for _ in range(30):
        x = (rng.normal(size=(3, 257)) * 2).astype(np.float32)
        x[:, 10:20] = x[:, :10]  # ties, also across the cut-offs
        x[:, 30] = -np.inf  # an already filtered token
        want = _sorted_rule(x, k, p)
        if want is None:
            continue
        tried += 1
        got = np.isfinite(np.asarray(filt(jnp.asarray(x), jnp.int32(k), jnp.float32(p))))
        np.testing.assert_array_equal(got, want)
    assert tried >= 10


def test_entropy_is_computed_only_when_asked_for():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 4, 9)).astype(np.float32))
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    low = jnp.int32(remasking_index("low_confidence"))
    full = score_tokens(logits, tokens, low, jax.random.key(0), jnp.bool_(True))
    lazy = score_tokens(logits, tokens, low, jax.random.key(0), jnp.bool_(False))
    assert float(jnp.min(full.entropy)) > 0 and float(jnp.max(jnp.abs(lazy.entropy))) == 0.0
    np.testing.assert_allclose(lazy.confidence, full.confidence)
    # the entropy strategy always gets its entropy
    ent = score_tokens(logits, tokens, jnp.int32(remasking_index("entropy")), jax.random.key(0), jnp.bool_(False))
    np.testing.assert_allclose(ent.entropy, full.entropy, rtol=1e-6)
    np.testing.assert_allclose(ent.rank_score, -full.entropy, rtol=1e-6)


def test_sample_and_score_is_sample_then_score():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(2, 6, 50)).astype(np.float32) * 3)
    kd, ks = jax.random.key(3), jax.random.key(4)
    for t, k, p, sampled, strat in [(0.0, 0, 1.0, False, "margin"), (0.8, 10, 0.9, True, "low_confidence"),
                                    (1.0, 0, 0.7, False, "entropy")]:
        args = (jnp.float32(t), jnp.int32(k), jnp.float32(p), 7, jnp.bool_(sampled))
        tokens, dist = sample(logits, kd, *args)
        want = score_tokens(dist, tokens, jnp.int32(remasking_index(strat)), ks)
        got_tokens, got = sample_and_score(logits, kd, ks, *args, jnp.int32(remasking_index(strat)))
        np.testing.assert_array_equal(got_tokens, tokens)
        assert 7 not in np.asarray(tokens)  # the mask id is never drawn
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
