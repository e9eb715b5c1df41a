"""The sampling loop with a scripted model (known logits): commit order, schedule, threshold, entropy
bound, guidance, EOS, seeds, recompilation and input errors."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.sampler import CanvasRecorder, SamplerConfig, SamplerError, compile_count, generate

CFG = get_config("test-clover")  # mask 255, eos 1, pad 0, vocab 256
V, MASK, EOS = CFG.vocab_size, CFG.mask_token_id, CFG.eos_token_id
L, G, BL = 4, 16, 8  # prompt length, gen length, block length
PROMPTS = [[10, 11, 12, 13], [20, 21, 22, 23]]


@dataclass(frozen=True)
class Scripted:
    """A fake model: logits[row, t] = table[row, position[t]], from `uncond` when the row's prompt is masked
    (the last prompt column holds the mask token), else from `cond`. Runs with cache="none" only."""

    def __call__(self, weights, tokens, positions, mask, cache, cache_offset, logits_start, logits_len):
        b = weights["cond"].shape[0]
        rows = jnp.arange(tokens.shape[0]) % b
        pos = jax.lax.dynamic_slice_in_dim(positions, logits_start, logits_len, axis=1)
        uncond = tokens[:, tokens.shape[1] - G - 1] == MASK  # column P-1 (the window is the whole canvas)
        table = jnp.where(uncond[:, None, None], weights["uncond"][rows[:, None], pos],
                          weights["cond"][rows[:, None], pos])
        return table, cache


def peaked(token: int, p: float) -> np.ndarray:
    """Logits of a distribution with probability p on `token`, the rest spread evenly."""
    probs = np.full(V, (1 - p) / (V - 1))
    probs[token] = p
    return np.log(probs).astype(np.float32)


def table_from(rows: list[list[np.ndarray]]) -> np.ndarray:
    """[B=len(rows), L+G, V] with the given logits at the G generated positions."""
    t = np.zeros((len(rows), L + G, V), np.float32)
    for b, row in enumerate(rows):
        for i, lg in enumerate(row):
            t[b, L + i] = lg
    return t


def run(cond, sc: SamplerConfig, uncond=None, prompts=PROMPTS, record=False):
    frames: list[np.ndarray] = []
    weights = {"cond": jnp.asarray(cond), "uncond": jnp.asarray(cond if uncond is None else uncond)}
    res = generate(weights, CFG, prompts, sc, forward_fn=Scripted(), record_logits=record,
                   progress=lambda toks, block, nfe: frames.append(toks.copy()))
    return res, frames


def commit_steps(frames: list[np.ndarray], row: int) -> list[list[int]]:
    """Per step, the generated columns newly committed in `row`."""
    prev = np.full(G, MASK)
    out = []
    for f in frames:
        out.append(sorted(np.flatnonzero((prev == MASK) & (f[row] != MASK)).tolist()))
        prev = f[row]
    return out


def sc(**kw) -> SamplerConfig:
    return SamplerConfig(**{"gen_length": G, "block_length": BL, "steps": G, "cache": "none", **kw})


def _probs(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def random_table():
    rng = np.random.default_rng(0)
    t = (rng.normal(size=(2, L + G, V)) * 3).astype(np.float32)
    t[..., [EOS, MASK]] = -50  # keep the stream free of EOS and mask ids
    return t


def test_commit_order_of_each_strategy(random_table):
    p = _probs(random_table[0, L:].astype(np.float64))
    top2 = -np.sort(-p, -1)[:, :2]
    expected_scores = {"low_confidence": p.max(-1), "margin": top2[:, 0] - top2[:, 1],
                       "entropy": (p * np.log(p)).sum(-1)}
    orders = {}
    for name, score in expected_scores.items():
        res, frames = run(random_table, sc(remasking=name))
        got = [c[0] for c in commit_steps(frames, 0)]
        want = [int(i) for blk in (0, 1) for i in blk * BL + np.argsort(-score[blk * BL:(blk + 1) * BL], kind="stable")]
        assert got == want, name
        orders[name] = got
        assert res.raw[0].tolist() == random_table[0, L:].argmax(-1).tolist()  # greedy tokens
    assert len({tuple(o) for o in orders.values()}) == 3  # the strategies really disagree on this table
    rnd = [[c[0] for c in commit_steps(run(random_table, sc(remasking="random", seed=s))[1], 0)] for s in (0, 1)]
    for o in rnd:
        assert sorted(o[:BL]) == list(range(BL)) and sorted(o[BL:]) == list(range(BL, G))  # blocks in order
    assert rnd[0] != rnd[1] and rnd[0] not in orders.values()


@pytest.mark.parametrize("steps", [16, 5])
def test_canvas_recorder_gives_the_pass_that_committed_each_position(random_table, steps):
    """`CanvasRecorder` as the progress callback: for the row it watches, each position's commit pass is the pass
    count of the step whose snapshot first shows it (several positions per step with fewer steps)."""
    _, frames = run(random_table, sc(steps=steps))
    rec = CanvasRecorder(row=1)
    weights = {"cond": jnp.asarray(random_table), "uncond": jnp.asarray(random_table)}
    res = generate(weights, CFG, PROMPTS, sc(steps=steps), forward_fn=Scripted(), progress=rec)
    passes = rec.commit_pass(MASK)
    want = np.zeros(G, int)
    for (nfe, _), cols in zip(rec.frames, commit_steps(frames, 1), strict=True):
        want[cols] = nfe
    assert len(rec.frames) == len(frames) and (passes > 0).all() and passes.max() == res.stats.nfe
    np.testing.assert_array_equal(passes, want)
    assert len(set(passes.tolist())) == len(frames)  # one pass count per step
    with pytest.raises(ValueError, match="progress=recorder"):
        CanvasRecorder().commit_pass(MASK)


@pytest.mark.parametrize("steps,per_block", [(6, [3, 3, 2]), (5, [4, 4]), (2, [8]), (16, [1] * 8)])
def test_committed_per_step_follows_the_schedule(random_table, steps, per_block):
    res, frames = run(random_table, sc(steps=steps))
    for row in (0, 1):
        assert [len(c) for c in commit_steps(frames, row)] == per_block * 2
    assert res.stats.nfe == len(frames) == 2 * len(per_block)
    assert res.stats.tokens == 2 * G and res.stats.tokens_per_pass == G / res.stats.nfe


def test_threshold_commits_all_above_it_and_at_least_one():
    confs = [0.99, 0.97, 0.5, 0.4, 0.3, 0.2, 0.6, 0.7]
    row = [peaked(40 + i, c) for i, c in enumerate(confs)] + [peaked(60 + i, 0.99) for i in range(BL)]
    cond = table_from([row, row])
    res, frames = run(cond, sc(threshold=0.9))
    steps = commit_steps(frames, 0)
    # block 0: both positions above 0.9 at once, then one a step by confidence; block 1: all in one step
    assert steps == [[0, 1], [7], [6], [2], [3], [4], [5], list(range(BL, G))]
    assert res.stats.nfe == 8  # block 1 ended as soon as it had no mask left
    assert res.raw[0].tolist() == [40 + i for i in range(BL)] + [60 + i for i in range(BL)]
    # the threshold is dynamic: without it the same program takes one token a step
    res, frames = run(cond, sc(threshold=0.0))
    assert res.stats.nfe == G and all(len(c) == 1 for c in commit_steps(frames, 0))


def test_entropy_bound_commits_the_lowest_entropy_prefix():
    ps = [0.999, 0.99, 0.9, 0.5, 0.3, 0.998, 0.95, 0.2]
    row = [peaked(40 + i, p) for i, p in enumerate(ps)] * 2
    cond = table_from([row, row])
    ent = np.array([-(q * np.log(q)).sum() for q in (_probs(x.astype(np.float64)) for x in row[:BL])])
    bound = 0.4
    # numpy reference: each step commits max(1, EB prefix) of the remaining positions, lowest entropy first
    want, left = [], sorted(range(BL), key=lambda i: ent[i])
    while left:
        hs = ent[left]
        k = max(1, int(((np.cumsum(hs) - np.maximum.accumulate(hs)) <= bound).sum()))
        want.append(sorted(left[:k]))
        left = left[k:]
    assert len(want[0]) > 1  # the bound really lets several through
    res, frames = run(cond, sc(entropy_bound=bound))
    assert commit_steps(frames, 0) == want + [[BL + i for i in blk] for blk in want]
    assert res.stats.nfe == 2 * len(want)


def test_guidance_formula_and_unconditional_rows():
    cond_row = np.zeros(V, np.float32)
    cond_row[[20, 30]] = [1.0, 0.9]
    un_row = np.zeros(V, np.float32)
    un_row[[20, 30]] = [1.0, 0.0]
    cond = table_from([[cond_row] * G] * 2)
    uncond = table_from([[un_row] * G] * 2)
    res, _ = run(cond, sc(), uncond=uncond)
    assert set(res.raw.ravel().tolist()) == {20}  # no guidance: the conditional favourite
    for scale in (1.0, 3.0):  # one program for any scale > 0
        res, _ = run(cond, sc(cfg_scale=scale), uncond=uncond, record=True)
        assert set(res.raw.ravel().tolist()) == {30}
        want = un_row + (scale + 1) * (cond_row - un_row)
        np.testing.assert_allclose(res.logits[0, 0], want, rtol=1e-6)
        np.testing.assert_allclose(res.logits[1, G - 1], want, rtol=1e-6)


def _eos_row(eos_at: int | None, order: list[int]) -> list[np.ndarray]:
    """Confidence falls along `order` (first = most confident); EOS at position eos_at."""
    conf = np.zeros(G)
    conf[order] = np.linspace(0.99, 0.5, len(order))
    return [peaked(EOS if i == eos_at else 50 + i, conf[i]) for i in range(G)]


def test_eos_stops_a_row_and_fills_the_rest():
    r0 = _eos_row(2, [2, 0, 1, *range(3, G)])  # EOS first, then the two before it
    r1 = _eos_row(None, list(range(G)))
    res, frames = run(table_from([r0, r1]), sc())
    assert res.raw[0].tolist() == [50, 51] + [EOS] * (G - 2)
    assert res.tokens[0] == [50, 51] and res.finished == [True, False]
    assert res.tokens[1] == [50 + i for i in range(G)]
    steps0 = commit_steps(frames, 0)  # the third step commits position 1 and fills the rest at once
    assert steps0[:3] == [[2], [0], [1, *range(3, G)]] and all(c == [] for c in steps0[3:])
    assert res.stats.nfe == G and res.stats.tokens == 3 + G  # row 0 committed 3, the fill is not counted
    # every row stopped -> the loop ends early
    r1_eos = _eos_row(0, list(range(G)))
    res, _ = run(table_from([r0, r1_eos]), sc())
    assert res.stats.nfe == 3 and res.tokens == [[50, 51], []]
    # eos_stop off (dynamic): nothing is filled, the row runs to the end
    res, _ = run(table_from([r0, r1]), sc(eos_stop=False))
    assert res.raw[0].tolist()[3:] == [50 + i for i in range(3, G)] and res.stats.nfe == G
    assert res.tokens[0] == [50, 51]


def test_same_seed_same_tokens_other_seed_other_tokens(random_table):
    soft = random_table / 3  # flatter: temperature sampling has room to differ
    a = run(soft, sc(temperature=1.0, seed=5, top_k=50, top_p=0.95))[0].raw
    b = run(soft, sc(temperature=1.0, seed=5, top_k=50, top_p=0.95))[0].raw
    c = run(soft, sc(temperature=1.0, seed=6, top_k=50, top_p=0.95))[0].raw
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    greedy = run(soft, sc())[0].raw
    assert not np.array_equal(a, greedy)


class CompileCounter:
    def __init__(self):
        self.n = 0

    def __call__(self, event, duration, **kw):
        if "backend_compile" in event:
            self.n += 1


def test_changing_dynamic_settings_never_recompiles(random_table):
    base = sc(cfg_scale=1.0)
    run(random_table, base)  # compile once
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    before = compile_count()
    try:
        for change in [dict(steps=4), dict(temperature=0.7), dict(threshold=0.5), dict(top_p=0.9),
                       dict(top_k=5), dict(cfg_scale=2.5), dict(seed=9), dict(remasking="margin"),
                       dict(entropy_bound=0.3), dict(eos_stop=False), dict(steps=2, temperature=1.0, top_k=3)]:
            run(random_table, base.replace(**change))
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.n == 0 and compile_count() == before
    run(random_table, base.replace(gen_length=8))  # a static change does compile
    assert compile_count() == before + 1


@pytest.mark.parametrize("change,prompts,msg", [
    (dict(gen_length=12), PROMPTS, "multiple of block_length"),
    (dict(steps=1), PROMPTS, "at least the number of blocks"),
    (dict(gen_length=CFG.max_seq_len, steps=CFG.max_seq_len), PROMPTS, "max_seq_len"),
    (dict(), [[1, 2, V]], "outside the vocabulary"),
    (dict(), [[1, -1]], "outside the vocabulary"),
    (dict(), [[]], "empty"),
    (dict(remasking="lowest"), PROMPTS,
     "remasking must be one of low_confidence, random, margin, entropy, got 'lowest'"),
    (dict(cache="full"), PROMPTS, "cache must be one of auto, none, prefix, dual, got 'full'"),
    (dict(cache="prefix"), PROMPTS, "init_cache"),  # a scripted model has no cache
    (dict(threshold=1.5), PROMPTS, r"threshold must be a number in \(0, 1\] \(or 0 = off\), got 1.5"),
    (dict(threshold=-0.1), PROMPTS, "threshold must be"),
    (dict(temperature=-1.0), PROMPTS, "temperature must be a number >= 0, got -1.0"),
    (dict(top_p=0.0), PROMPTS, r"top_p must be a number in \(0, 1\], got 0.0"),
    (dict(top_k=-2), PROMPTS, r"top_k must be an integer in \[0, 2147483647\], got -2"),
    (dict(top_k=2**31), PROMPTS, "top_k must be"),  # an int32 on the device
    (dict(entropy_bound=-1.0), PROMPTS, "entropy_bound must be a number >= 0"),
    (dict(cfg_scale=float("nan")), PROMPTS, "cfg_scale must be"),
    (dict(steps=8, steps_per_block=2), PROMPTS, "give steps or steps_per_block, not both"),
    (dict(steps=None, steps_per_block=9), PROMPTS, r"steps_per_block must be an integer in \[1, 8\], got 9"),
    (dict(seed=2**64), PROMPTS, "seed must be"),
    (dict(eos_stop="yes"), PROMPTS, "eos_stop must be true or false"),
])
def test_bad_input_fails_before_compiling(change, prompts, msg):
    before = compile_count()
    with pytest.raises(SamplerError, match=msg):
        generate({"cond": None, "uncond": None}, CFG, prompts, sc(**change), forward_fn=Scripted())
    assert compile_count() == before


def test_impossible_hybrid_settings_are_refused_before_compiling():
    before = compile_count()
    with pytest.raises(SamplerError, match="bidirectional attention"):  # hybrids run block-causally only
        generate(None, get_config("test-clover-hybrid").replace(bd_gdn="none", attention="bidirectional"),
                 [[5, 6, 7]], SamplerConfig(gen_length=8, block_length=8))
    with pytest.raises(SamplerError, match="longer than the model's blocks"):  # block-diffusion GDN: <= 8
        generate(None, get_config("test-clover-hybrid"), [[5, 6, 7]], SamplerConfig(gen_length=16, block_length=16))
    assert compile_count() == before


def test_the_mask_token_is_never_committed_even_as_the_top_prediction():
    """Every generated position's top prediction is the mask token (p = 0.6); the runner-up (token 40 + i,
    p 0.3) is what gets committed, one per step as scheduled, with the model's own probability as its
    confidence: the mask's mass stays in the normaliser, so a threshold of 0.5 commits nothing extra."""
    rows = []
    for _ in PROMPTS:
        row = []
        for i in range(G):
            probs = np.full(V, 0.1 / (V - 2))
            probs[MASK], probs[40 + i] = 0.6, 0.3
            row.append(np.log(probs).astype(np.float32))
        rows.append(row)
    res, frames = run(table_from(rows), sc(threshold=0.5, eos_stop=False))
    np.testing.assert_array_equal(res.raw, np.broadcast_to(np.arange(40, 40 + G), (2, G)))
    assert res.stats.nfe == G and all(len(s) == 1 for s in commit_steps(frames, 0))
