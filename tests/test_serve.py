"""The serving engine (`clover_jax.serving.engine`): rows that join and leave at block boundaries give
every request exactly the tokens it gets alone from `sampler.generate`, whatever shares its batch."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from clover_jax import shipped
from clover_jax.checkpoint import load_model
from clover_jax.config import get_config
from clover_jax.model import params
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.sampler.settings import knobs
from clover_jax.serving.admission import NewRow
from clover_jax.serving.engine import Engine
from clover_jax.serving.requests import BadRequest, Draining, Event, QueueFull, Request, ServingError
from clover_jax.tokenizer import load_tokenizer

L = 32
# one worker runs this module, so its engine (a minute of compiling) is built once (`--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("serve")


class Collector:
    """Events per request id; `wait` blocks until every submitted request has finished."""

    def __init__(self) -> None:
        self.events: dict[int, list[Event]] = {}
        self._cv = threading.Condition()

    def sink(self, key: int):
        def on_event(ev: Event) -> None:
            with self._cv:
                self.events.setdefault(key, []).append(ev)
                self._cv.notify_all()
        return on_event

    def wait(self, keys: list[int], timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        with self._cv:
            while not all(self.events.get(k) and self.events[k][-1].finish_reason for k in keys):
                left = end - time.monotonic()
                assert left > 0, f"requests {keys} did not finish: {self.events}"
                self._cv.wait(left)

    def tokens(self, key: int) -> list[int]:
        return [t for ev in self.events[key] for t in ev.tokens]

    def reason(self, key: int) -> str | None:
        return self.events[key][-1].finish_reason


def request_of(prompt: tuple[int, ...], max_tokens: int, **settings) -> Request:
    """A serving request with these sampler settings (`steps_per_block` counts per block)."""
    return Request(prompt, max_tokens, SamplerConfig(**settings))


def alone_run(weights, cfg, prompt: list[int], r: Request):
    """The same request through `generate` on its own (block-aligned length)."""
    return generate(weights, cfg, [prompt], r.row_settings(L).replace(cache="prefix"))


def alone(weights, cfg, prompt: list[int], r: Request) -> list[int]:
    """The tokens `generate` gives the request on its own, cut at max_tokens."""
    return alone_run(weights, cfg, prompt, r).tokens[0][:r.max_tokens]


@pytest.fixture(scope="module")
def shipped_engine():
    cfg, weights = load_model(str(shipped.MODEL_DIR))
    tok = load_tokenizer(str(shipped.MODEL_DIR))
    # the prefix cache on: every test of this module then also checks that reusing a saved prompt changes no token
    eng = Engine(weights, cfg, max_prompt=32, max_tokens=64, batch_sizes=(1, 4), queue_size=64, prefix_cache_gb=1.0)
    lines: list[str] = []
    eng.warm_up(lines.append)
    eng.start()
    yield eng, tok, lines
    eng.drain(timeout=120)


def test_warm_up_lists_every_program(shipped_engine):
    _, _, lines = shipped_engine
    assert [line.split(":")[0] for line in lines] == [
        "block program for 1 row x 96 columns (prefix cache)", "block program for 4 rows x 96 columns (prefix cache)",
        "prefill program for prompts up to 32 tokens", "prefill program for prompts up to 32 tokens, 2 at a time",
        "prefill program for prompts up to 32 tokens, 4 at a time", "prefill program for prompts up to 64 tokens",
        "prefill program for prompts up to 64 tokens, 2 at a time",
        "prefill program for prompts up to 64 tokens, 4 at a time",
        "prefix-cache program for up to 32 new prompt tokens", "prefix-cache program for up to 64 new prompt tokens"]
    # each says how far the start-up is: i of the 12 programs (the prefix cache's save and the row move are silent)
    assert [re.search(r"\[(\d+)/12 programs", line).group(1) for line in lines] == [str(i) for i in range(1, 11)]
    assert all("s left]" in line for line in lines)


def test_mixed_requests_equal_each_run_alone(shipped_engine):
    """Six requests of different prompt lengths, lengths and settings arrive while others run (more than
    the 4 rows, so some wait for a free row); each gets what it gets alone. No program compiles while
    serving."""
    eng, tok, _ = shipped_engine
    texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo! wherefore art thou", "KING", "First Citizen:\nBefore we proceed",
             "MENENIUS:\nWhat work's, my countrymen,", "Second Servant:"]
    settings = zip([40, 64, 7, 33, 64, 20], [0, 0, 0.5, 0, 0.3, 0], [None, 16, None, 8, None, 4], strict=True)
    reqs = [request_of(tuple(tok.encode(t)), m, threshold=th, steps_per_block=st)
            for t, (m, th, st) in zip(texts, settings, strict=True)]
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None)
    before = eng.stats()
    col = Collector()
    for i, r in enumerate(reqs):
        eng.submit(r, col.sink(i))
        time.sleep(0.15)
    col.wait(list(range(len(reqs))))
    assert compiles == [], f"programs compiled while serving: {compiles}"
    after = eng.stats()
    assert after.requests_finished - before.requests_finished == len(reqs)
    assert after.active_rows == 0 and after.queue_depth == 0
    assert after.mean_rows_per_block > 1, "rows never shared a block call"
    for i, r in enumerate(reqs):
        got = col.tokens(i)
        ref = alone_run(eng.weights, eng.cfg, list(r.prompt), r)
        assert got == ref.tokens[0][:r.max_tokens], f"request {i} ({texts[i]!r}) differs"
        if len(ref.tokens[0]) >= r.max_tokens:  # it ran every block it asked for: the same passes, bar the prefill
            assert col.events[i][-1].passes == ref.stats.nfe - 1, f"request {i}"
        assert len(got) <= r.max_tokens
        assert col.reason(i) == ("length" if len(got) == r.max_tokens else "stop")
    assert after.tokens_generated - before.tokens_generated == sum(len(col.tokens(i)) for i in range(len(reqs)))


def test_queued_requests_are_prefilled_together(shipped_engine):
    """Three requests queued at once (prompts of different lengths, different settings) are admitted by one call
    whose prefill runs their prompts as one batch (padded to the 4-row program); each gets its tokens alone."""
    eng, tok, _ = shipped_engine
    # prompts no other test sends (a saved prompt they began with would be admitted on its own, reusing it)
    texts = ["BENVOLIO:", "NURSE:\nNow, by my maidenhead at twelve year old", "TYBALT:\nWhat, drawn, and talk"]
    reqs = [request_of(tuple(tok.encode(t)), m, threshold=th, temperature=temp, seed=7)
            for t, m, th, temp in zip(texts, [40, 64, 33], [0, 0.5, 0], [0, 0, 0.7], strict=True)]
    col = Collector()
    before = eng.stats()
    with eng._lock:  # (the scheduler's condition, reentrant): it sees the three only once all are queued
        for i, r in enumerate(reqs):
            eng.submit(r, col.sink(i))
    col.wait([0, 1, 2])
    after = eng.stats()
    assert (after.prefill_calls - before.prefill_calls, after.rows_prefilled - before.rows_prefilled) == (1, 3)
    for i, r in enumerate(reqs[:2]):  # greedy: `generate`'s tokens
        assert col.tokens(i) == alone(eng.weights, eng.cfg, list(r.prompt), r), f"request {i} ({texts[i]!r})"
    eng.submit(reqs[2], col.sink(3))  # seeded sampling: its tokens when the engine admits it alone
    col.wait([3])
    assert col.tokens(2) == col.tokens(3) and eng.stats().prefill_calls == after.prefill_calls + 1


def _run_one(eng, r: Request, key: int, col: Collector | None = None) -> tuple[list[int], Event]:
    col = col or Collector()
    eng.submit(r, col.sink(key))
    col.wait([key])
    return col.tokens(key), col.events[key][-1]


def test_a_prompt_that_begins_with_an_earlier_one_reuses_its_cache(shipped_engine):
    """The prefix cache: a prompt that extends an earlier request's prompt prefills only its new tokens, from the
    saved K/V and Gated DeltaNet state, and gets the tokens it gets alone; the same prompt again reuses all of it;
    a seeded sampled request gives the same text reusing as not."""
    eng, tok, _ = shipped_engine
    first = tuple(tok.encode("KING HENRY V:\nOnce more unto the breach"))
    longer = first + tuple(tok.encode(", dear friends, once more"))
    before = eng.stats()
    toks1, ev1 = _run_one(eng, request_of(first, 40), 0)
    # (a shorter prompt another test sent, such as "KING", may begin it: then it reuses that much)
    assert ev1.cached_tokens < len(first)
    r2 = request_of(longer, 40)
    toks2, ev2 = _run_one(eng, r2, 1)
    assert ev2.cached_tokens == len(first)
    assert toks2 == alone(eng.weights, eng.cfg, list(longer), r2)
    toks3, ev3 = _run_one(eng, request_of(first, 40), 2)  # the whole prompt saved: nothing left to prefill
    assert ev3.cached_tokens == len(first) and toks3 == toks1
    after = eng.stats()
    assert (after.prefix_hits - before.prefix_hits, after.prefix_tokens_reused - before.prefix_tokens_reused) == (
        2 + (ev1.cached_tokens > 0), 2 * len(first) + ev1.cached_tokens)
    assert after.prefix_entries >= 2 and after.prefix_bytes == after.prefix_entries * eng.admission.row_bytes

    sampled = request_of(tuple(tok.encode("PRINCE:\nRebellious subjects")), 40, temperature=0.9, seed=11)
    miss, ev_miss = _run_one(eng, sampled, 3)
    hit, ev_hit = _run_one(eng, sampled, 4)
    assert ev_miss.cached_tokens < len(sampled.prompt) == ev_hit.cached_tokens and hit == miss


def test_a_chat_turn_saves_its_conversation_for_the_next(shipped_engine):
    """A request that says which of its first tokens the next turn begins with (`Request.keep`: a chat's
    conversation before the assistant's opening) is admitted in two calls, the conversation saved on the way, and
    gets its tokens alone; the next turn, which begins with the conversation but not with the whole prompt, reuses
    it."""
    eng, tok, _ = shipped_engine
    conversation = tuple(tok.encode("user: Speak, Hamlet.\n"))
    turn = dataclasses.replace(request_of(conversation + tuple(tok.encode("assistant:")), 40), keep=len(conversation))
    before = eng.stats()
    got, ev = _run_one(eng, turn, 0)
    assert ev.cached_tokens < len(conversation) and got == alone(eng.weights, eng.cfg, list(turn.prompt), turn)
    mid = eng.stats()
    assert (mid.prefill_calls - before.prefill_calls, mid.rows_prefilled - before.rows_prefilled) == (2, 1)
    nxt = request_of(conversation + tuple(tok.encode("OPHELIA: Good my lord.\nassistant:")), 40)
    got, ev = _run_one(eng, nxt, 1)
    assert ev.cached_tokens == len(conversation) and eng.stats().prefix_hits == mid.prefix_hits + 1
    assert got == alone(eng.weights, eng.cfg, list(nxt.prompt), nxt)


def test_concurrent_prompts_that_share_a_saved_prefix(shipped_engine):
    eng, tok, _ = shipped_engine
    stem = tuple(tok.encode("CHORUS:\nTwo households, both alike"))
    _run_one(eng, request_of(stem, 8), 0)  # saved
    reqs = [request_of(stem + tuple(tok.encode(t)), 40, **kw) for t, kw in
            [(" in dignity", {}), (",", {"threshold": 0.5}), (" in fair Verona", {"steps_per_block": 16})]]
    col = Collector()
    before = eng.stats()
    with eng._lock:  # admitted together, each reusing the stem
        for i, r in enumerate(reqs):
            eng.submit(r, col.sink(i))
    col.wait([0, 1, 2])
    assert eng.stats().prefix_hits - before.prefix_hits == 3
    for i, r in enumerate(reqs):
        assert col.events[i][-1].cached_tokens == len(stem)
        assert col.tokens(i) == alone(eng.weights, eng.cfg, list(r.prompt), r), f"request {i}"


def test_the_prefix_cache_evicts_the_least_recently_used(shipped_engine):
    eng, tok, _ = shipped_engine
    budget = eng.admission.store.budget_bytes
    eng.admission.store.budget_bytes = int(1.5 * eng.admission.row_bytes)  # room for one saved prompt
    try:
        a, b = (tuple(tok.encode(t)) for t in ("GLOUCESTER:\nNow is the winter", "LEAR:\nBlow, winds"))
        _run_one(eng, request_of(a, 8), 0)
        _run_one(eng, request_of(b, 8), 1)  # evicts a
        assert eng.stats().prefix_entries == 1
        before = eng.stats()
        r = request_of(a + tuple(tok.encode(" of our discontent")), 40)
        got, ev = _run_one(eng, r, 2)
        after = eng.stats()
        assert ev.cached_tokens == 0 and after.prefix_hits == before.prefix_hits
        assert after.prefix_lookups == before.prefix_lookups + 1 and after.prefix_entries == 1
        assert got == alone(eng.weights, eng.cfg, list(r.prompt), r)
    finally:
        eng.admission.store.budget_bytes = budget


def test_admissions_group_by_prompt_width():
    cfg = get_config("clover-tiny")
    eng = Engine(None, cfg, max_prompt=100, max_tokens=32, batch_sizes=(1, 8), prefill_rows=4)
    adm = eng.admission
    assert (adm.widths, adm.admit_rows) == ((32, 64, 128), (1, 2, 4))
    assert [adm.width(n) for n in (0, 1, 32, 33, 128)] == [32, 32, 32, 64, 128]
    lengths = [10, 70, 20, 5, 30, 90, 8]  # widths 32, 128, 32, 32, 32, 128, 32
    admitted = [NewRow(slot, (3,) * n, 0, SamplerConfig()) for slot, n in enumerate(lengths)]
    groups = [[r.slot for r in g] for g in adm.groups(admitted)]
    assert groups == [[0, 2, 3, 4], [6], [1, 5]]  # at most 4 to a call, queue order within a width
    assert Engine(None, cfg, batch_sizes=(1, 8), prefill_rows=6).admission.admit_rows == (1, 2, 4, 6)
    assert Engine(None, cfg, batch_sizes=(1, 2), prefill_rows=6).admission.admit_rows == (1, 2)  # at most the rows
    with pytest.raises(ServingError, match="prefill_rows must be a positive integer"):
        Engine(None, cfg, prefill_rows=0)


def test_the_prefix_cache_is_off_where_a_prompt_cannot_be_cut():
    """Exact reuse needs the state after the saved tokens: any cut of a causal-prefix model's prompt, whole prompt
    blocks of a block-causal attention-only model; a hybrid read in longer clean blocks cannot be cut."""
    on = Engine(None, get_config("clover-tiny"), prefix_cache_gb=1)
    on = on.admission
    assert (on.prefix_cache, on.reuse_grain, on.prefix_cache_note) == (True, 1, None)
    attention = Engine(None, get_config("clover-tiny-attention"), prefix_cache_gb=1).admission
    assert attention.prefix_cache and attention.reuse_grain == attention.cfg.block_size > 1
    earlier = Engine(None, get_config("clover-tiny").replace(bd_gdn="reconstructed"), prefix_cache_gb=1).admission
    assert not earlier.prefix_cache and "cannot be cut inside a block" in earlier.prefix_cache_note
    assert Engine(None, get_config("clover-tiny"), cache="none", prefix_cache_gb=1).admission.prefix_cache_note
    assert Engine(None, get_config("clover-tiny")).admission.prefix_cache_note is None  # not asked for: nothing to say
    small = Engine(None, get_config("clover-tiny"), prefix_cache_gb=1e-6).admission  # 1 kB: not one saved prompt
    assert not small.prefix_cache and "more than prefix_cache_gb 1e-06" in small.prefix_cache_note
    with pytest.raises(ServingError, match="prefix_cache_gb must be >= 0"):
        Engine(None, get_config("clover-tiny"), prefix_cache_gb=-1)


def test_a_padding_row_of_an_admission_writes_nothing():
    """`program.admit` with a slot past the state's rows (the engine's padding) leaves every row but the real
    ones as they were: canvas, activity, settings and cache."""
    from clover_jax.model import ModelForward
    from clover_jax.serving import program

    cfg = get_config("test-clover")
    weights = params.init(cfg, jax.random.key(0))
    fwd = ModelForward(cfg)
    eng = Engine(weights, cfg, block_length=8, max_prompt=8, max_tokens=8, batch_sizes=(3,))
    state = program.empty_state(cfg, fwd, 3, eng.columns, 8, "prefix")
    job = Request((5, 6, 7), 8, SamplerConfig(temperature=0.5, seed=3))
    row = eng.admission.row(job.prompt)
    kn = jax.tree.map(lambda *x: np.stack(x), *[knobs(job.row_settings(8), cfg)] * 2)
    got = program.admit(cfg, fwd, 8, "prefix", 8, weights, state, np.array([1, 3], np.int32),
                        *(np.stack([x, x]) for x in row), kn, np.array([1, 1], np.int32))
    assert np.asarray(got.active).tolist() == [False, True, False]
    for name in ("canvas", "valid", "blocks"):
        new, old = np.asarray(getattr(got, name)), np.asarray(getattr(state, name))
        np.testing.assert_array_equal(new[1], row[("canvas", "valid", "blocks").index(name)])
        np.testing.assert_array_equal(new[[0, 2]], old[[0, 2]], err_msg=name)
    assert float(got.knobs.temperature[1]) == 0.5 and float(got.knobs.temperature[2]) != 0.5
    for new, old in zip(jax.tree.leaves(got.cache), jax.tree.leaves(state.cache), strict=True):
        assert np.abs(np.asarray(new[:, 1], np.float32)).max() > 0  # the prompt's K/V and states were written
        np.testing.assert_array_equal(np.asarray(new[:, [0, 2]]), np.asarray(old[:, [0, 2]]))


def test_seeded_sampling_does_not_depend_on_batch_mates(shipped_engine):
    # A batch picks its sampling program from its rows (greedy / unfiltered draws / top-k, top-p
    # filters): a row's tokens must not depend on which one its batch mates made it run.
    eng, tok, _ = shipped_engine
    # eos_stop=False: every request runs all its blocks, so the batches below are known exactly
    req = request_of(tuple(tok.encode("ROMEO:")), 40, temperature=0.9, seed=1234, eos_stop=False)
    nucleus = request_of(tuple(tok.encode("KING:")), 40, temperature=0.9, top_p=0.8, top_k=40, seed=5,
                         eos_stop=False)
    col = Collector()
    plain = dataclasses.replace(nucleus, sampling=nucleus.sampling.replace(top_p=1.0, top_k=0))
    for i, r in enumerate([req, nucleus, plain]):
        eng.submit(r, col.sink(i if i < 2 else 12))  # each alone: the plain, filtered, plain program
        col.wait([i if i < 2 else 12])
    assert col.tokens(1) != col.tokens(12), "top-p / top-k changed nothing"

    # A greedy request runs alone for one block; the three submitted meanwhile join it together at the
    # block boundary, so req and the greedy one run inside the filtered program nucleus needs.
    before = eng.stats()
    blocker = request_of(tuple(tok.encode("KING RICHARD:")), 64, eos_stop=False)
    greedy = request_of(tuple(tok.encode("QUEEN:")), 64, eos_stop=False)
    eng.submit(blocker, col.sink(20))
    deadline = time.monotonic() + 120
    while not eng.stats().active_rows and time.monotonic() < deadline:
        time.sleep(0.005)
    for r, key in ((nucleus, 11), (req, 9), (greedy, 2)):
        eng.submit(r, col.sink(key))
    col.wait([20, 11, 9, 2])
    after = eng.stats()
    assert (after.blocks_run - before.blocks_run, after.rows_in_blocks - before.rows_in_blocks) == (3, 1 + 4 + 3)
    assert col.tokens(9) == col.tokens(0), "the same seed gave other text next to a top-p row"
    assert col.tokens(11) == col.tokens(1), "top-p / top-k sampling gave other text next to other requests"
    assert col.tokens(2) == alone(eng.weights, eng.cfg, list(greedy.prompt), greedy)

    others = [request_of(tuple(tok.encode(t)), 64, temperature=t2, seed=s) for t, t2, s in
              [("KING", 0.0, 0), ("JULIET:", 1.2, 7), ("First Citizen:", 0.5, 99)]]
    for i, r in enumerate(others, start=3):
        eng.submit(r, col.sink(i))
    eng.submit(req, col.sink(13))
    eng.submit(dataclasses.replace(req, sampling=req.sampling.replace(seed=4321)), col.sink(10))
    col.wait([3, 4, 5, 13, 10])
    assert col.tokens(13) == col.tokens(0), "the same seed gave other text next to other requests"
    assert col.tokens(10) != col.tokens(0), "another seed gave the same text"


def test_cancel_frees_the_row_and_spares_the_others(shipped_engine):
    eng, tok, _ = shipped_engine
    col = Collector()
    slow = eng.submit(request_of(tuple(tok.encode("KING RICHARD:")), 64, steps_per_block=32), col.sink(0))
    keep = request_of(tuple(tok.encode("QUEEN:")), 64)
    eng.submit(keep, col.sink(1))
    deadline = time.monotonic() + 120
    while not eng.stats().active_rows and time.monotonic() < deadline:  # admitted: its first block runs
        time.sleep(0.005)
    eng.cancel(slow)  # dropped before its second block
    col.wait([0, 1])
    assert col.reason(0) == "cancelled"
    assert len(col.tokens(0)) < 64
    assert col.tokens(1) == alone(eng.weights, eng.cfg, list(keep.prompt), keep)
    assert eng.stats().active_rows == 0


def test_queued_cancel_and_a_raising_callback(shipped_engine):
    """A request cancelled while it waits for a row ends at once; a callback that raises hurts nobody else
    (its batch mates get their tokens, the scheduler goes on)."""
    eng, tok, _ = shipped_engine
    col = Collector()
    prompt = tuple(tok.encode("ROMEO:"))
    for i in range(4):  # fill the 4 rows
        eng.submit(request_of(prompt, 64, steps_per_block=32, seed=i, temperature=0.5), col.sink(i))
    waiting = eng.submit(request_of(prompt, 64), col.sink(4))
    eng.cancel(waiting)
    assert col.reason(4) == "cancelled" and col.tokens(4) == []

    def boom(ev: Event) -> None:
        raise RuntimeError("a client bug")

    eng.submit(request_of(prompt, 40), boom)
    good = request_of(tuple(tok.encode("KING:")), 40)
    eng.submit(good, col.sink(5))
    col.wait([0, 1, 2, 3, 5])
    assert all(col.reason(i) in ("length", "stop") for i in range(4))
    assert col.tokens(5) == alone(eng.weights, eng.cfg, list(good.prompt), good)
    after = Collector()
    eng.submit(good, after.sink(0))
    after.wait([0])
    assert after.tokens(0) == col.tokens(5)


def test_bad_requests_are_refused_before_queueing(shipped_engine):
    eng, _, _ = shipped_engine
    with pytest.raises(BadRequest, match="at most 32"):
        eng.submit(Request(tuple(range(5, 45)), 8), lambda ev: None)
    with pytest.raises(BadRequest, match="max_tokens"):
        eng.submit(request_of((5, 6), 65), lambda ev: None)
    with pytest.raises(BadRequest, match="temperature"):
        eng.submit(request_of((5, 6), 8, temperature=-1.0), lambda ev: None)
    with pytest.raises(BadRequest, match="outside"):
        eng.submit(request_of((5, 99999), 8), lambda ev: None)
    with pytest.raises(BadRequest, match="steps"):
        eng.submit(request_of((5, 6), 8, steps_per_block=33), lambda ev: None)


def test_engine_refuses_what_it_cannot_run():
    with pytest.raises(ServingError, match="bidirectional"):
        Engine(None, get_config("clover-tiny-attention").replace(attention="bidirectional"))
    cfg = get_config("clover-tiny")
    with pytest.raises(ServingError, match="max_seq_len"):
        Engine(None, cfg, max_prompt=1000, max_tokens=100)
    with pytest.raises(ServingError, match="longer than the model's blocks"):
        Engine(None, cfg, block_length=64)


def test_queue_full_and_draining():
    """A tiny random attention-only model (the non-hybrid path): a full queue answers QueueFull, drain
    lets queued requests finish and then refuses new ones."""
    cfg = get_config("clover-tiny-attention").replace(n_layers=2)
    weights = params.init(cfg, jax.random.key(0))
    eng = Engine(weights, cfg, max_prompt=32, max_tokens=32, batch_sizes=(2,), queue_size=2)
    eng.warm_up()
    col = Collector()
    reqs = [request_of((5 + i, 6, 7), 32) for i in range(2)]
    ids = [eng.submit(r, col.sink(i)) for i, r in enumerate(reqs)]  # not started: both wait in the queue
    with pytest.raises(QueueFull):
        eng.submit(request_of((5,), 8), lambda ev: None)
    eng.start()
    eng.drain(timeout=120)
    assert len(ids) == 2 and all(col.reason(i) in ("length", "stop") for i in range(2))
    for i, r in enumerate(reqs):
        assert col.tokens(i) == alone(weights, cfg, list(r.prompt), r)
    with pytest.raises(Draining):
        eng.submit(request_of((5,), 8), lambda ev: None)


# ---- the HTTP server, through the real openai client ---------------------------------------------------

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server(shipped_engine):
    """The shipped engine behind `make_app`, served on a free loopback port in a thread."""
    from clover_jax.serving.background import serve_in_background

    eng, tok, _ = shipped_engine
    with serve_in_background(eng, tok, eng.cfg.name) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
        yield client, eng, tok, srv.port


def test_the_background_server_gives_a_request_the_checkpoints_defaults(shipped_engine, monkeypatch):
    """`serve_in_background(defaults=...)` serves what `clover serve` takes from a generation_config.json: a
    request that leaves max_tokens and the order out gets the defaults' (8 tokens, random order: what a request
    that names them gets), one that sets them gets its own."""
    from clover_jax.serving.background import serve_in_background

    eng, tok, _ = shipped_engine
    monkeypatch.setattr(eng, "drain", lambda timeout=None: None)  # the module's engine serves the tests after this
    with serve_in_background(eng, tok, eng.cfg.name, defaults={"max_tokens": 8, "remasking": "random"}) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
        out = client.completions.create(model=eng.cfg.name, prompt="ROMEO:")
        named = client.completions.create(model=eng.cfg.name, prompt="ROMEO:", max_tokens=8,
                                          extra_body={"diffusion": {"remasking": "random"}})
        own = client.completions.create(model=eng.cfg.name, prompt="ROMEO:", max_tokens=40,
                                        extra_body={"diffusion": {"remasking": "low_confidence"}})
    assert out.usage.completion_tokens <= 8
    assert out.choices[0].text == named.choices[0].text
    assert out.choices[0].text != _alone_text(eng, tok, "ROMEO:", 8)  # the order reached the sampler
    assert own.choices[0].text == _alone_text(eng, tok, "ROMEO:", 40)


def _alone_text(eng, tok, prompt: str, max_tokens: int, **kw) -> str:
    return tok.decode(alone(eng.weights, eng.cfg, tok.encode(prompt), request_of((0,), max_tokens, **kw)))


def test_completion_and_chat(server):
    client, eng, tok, _ = server
    out = client.completions.create(model=eng.cfg.name, prompt="ROMEO:", max_tokens=40)
    assert out.choices[0].text == _alone_text(eng, tok, "ROMEO:", 40)
    assert out.usage.prompt_tokens == len(tok.encode("ROMEO:"))
    again = client.completions.create(model=eng.cfg.name, prompt="ROMEO:", max_tokens=40)
    assert again.choices[0].text == out.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens  # the prompt was saved
    assert out.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(model=eng.cfg.name, messages=[{"role": "user", "content": "Speak."}],
                                          max_tokens=32)
    # the content is what the sampler gives the conversation's prompt (rendered as the server renders it) greedily
    from clover_jax.serving.chat import Message, render_messages

    want = _alone_text(eng, tok, render_messages(tok, [Message("user", "Speak.")]), 32)
    assert want.strip() and "<think>" not in want  # nothing for the reasoning split to take away
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == want
    assert [m.id for m in client.models.list().data] == [eng.cfg.name]


def test_streaming_sends_each_block_as_it_is_committed(server):
    client, eng, _, _ = server
    whole = client.completions.create(model=eng.cfg.name, prompt="JULIET:", max_tokens=64).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(model=eng.cfg.name, prompt="JULIET:",
                                                                    max_tokens=64, stream=True)]
    assert "".join(chunks) == whole
    assert sum(bool(c) for c in chunks) >= 2, f"64 tokens in blocks of 32 came as {chunks}"


def test_stop_sequence_and_seed(server):
    client, eng, tok, _ = server
    full = _alone_text(eng, tok, "KING:", 64)
    assert "\n" in full
    out = client.completions.create(model=eng.cfg.name, prompt="KING:", max_tokens=64, stop=["\n"])
    assert out.choices[0].text == full[:full.index("\n")] and out.choices[0].finish_reason == "stop"
    a = client.completions.create(model=eng.cfg.name, prompt="KING:", max_tokens=40, temperature=0.9, seed=7)
    b = client.completions.create(model=eng.cfg.name, prompt="KING:", max_tokens=40, temperature=0.9, seed=7, n=2)
    assert b.choices[0].text == a.choices[0].text  # choice 0 has seed 7 whatever shares the batch
    assert b.choices[1].text != a.choices[0].text  # choice 1 has seed 8


def test_concurrent_clients_each_equal_their_request_alone(server):
    """32 clients at once with mixed prompts and lengths (4 rows, so most wait for a row)."""
    client, eng, tok, _ = server
    prompts = ["ROMEO:", "JULIET:", "KING:", "First Citizen:", "QUEEN MARGARET:", "MENENIUS:\nWhat work's"]
    jobs = [(prompts[i % len(prompts)], (16, 40, 64)[i % 3]) for i in range(32)]
    results: dict[int, str] = {}

    def one(i: int) -> None:
        p, m = jobs[i]
        results[i] = client.completions.create(model=eng.cfg.name, prompt=p, max_tokens=m).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(results) == len(jobs)
    expected = {job: _alone_text(eng, tok, *job) for job in set(jobs)}
    for i, job in enumerate(jobs):
        assert results[i] == expected[job], f"client {i} {job}"


def test_disconnect_frees_the_row(server):
    import httpx

    client, eng, tok, port = server
    cancelled: list[int] = []
    cancel = eng.cancel
    eng.cancel = lambda rid: (cancelled.append(rid), cancel(rid))  # type: ignore[method-assign]
    try:
        body = {"prompt": "ROMEO:", "max_tokens": 64, "stream": True, "diffusion": {"steps": 32}}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # the first block arrived: hang up
        deadline = time.monotonic() + 120
        while not cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        eng.cancel = cancel  # type: ignore[method-assign]
    assert len(cancelled) == 1, "the server did not cancel the request of a client that hung up"

    def gauge(name: str) -> float:  # what /metrics says: the row count an operator sees
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))

    while (gauge("clover_active_rows") or gauge("clover_generations_in_flight")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.stats().active_rows == 0
    assert gauge("clover_active_rows") == 0 and gauge("clover_generations_in_flight") == 0
    out = client.completions.create(model=eng.cfg.name, prompt="ROMEO:", max_tokens=16)
    assert out.choices[0].text == _alone_text(eng, tok, "ROMEO:", 16)


def test_bad_requests_get_openai_errors(server):
    client, eng, _, _ = server
    with pytest.raises(openai.BadRequestError, match="at most 32"):
        client.completions.create(model=eng.cfg.name, prompt="ROMEO: " * 40, max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=eng.cfg.name, prompt="ROMEO:", max_tokens=8, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="ROMEO:", max_tokens=8)
    assert client.completions.create(model=eng.cfg.name, prompt="ROMEO:", max_tokens=8).choices[0].text


def test_sigterm_drains_in_flight_requests(tmp_path):
    """`clover serve` in a subprocess on a tiny random model: SIGTERM mid-stream lets the stream finish,
    new requests get 503, and the process exits 0 with "drained"."""
    import httpx

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CLOVER_COMPILE_CACHE": "off"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "clover_jax.cli", "serve", "--model", "clover-tiny-attention", "--port", "0",
         "--batch-sizes", "2", "--max-prompt", "32", "--max-tokens", "64", "--log-level", "warning"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        for line in proc.stderr:
            if "listening on" in line:
                port = int(line.rsplit(":", 1)[1])
                break
        assert port, "the server never listened"
        base = f"http://127.0.0.1:{port}/v1"
        # 8 choices on 2 rows: four rounds of two blocks of 32 passes each are still running at the signal
        body = {"prompt": "abc", "max_tokens": 64, "stream": True, "n": 8, "diffusion": {"steps": 32}}
        got: list[str] = []
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    got.append(line)
                    break
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            late = httpx.post(f"{base}/completions", json={"prompt": "x", "max_tokens": 8}, timeout=30)
            got += [line for line in lines if line.startswith("data:")]
        assert late.status_code == 503
        assert got[-1] == "data: [DONE]"
        finals = {c["index"]: c["finish_reason"] for x in got[:-1] for c in json.loads(x[5:])["choices"]
                  if c["finish_reason"]}
        assert finals == dict.fromkeys(range(8), "length"), got
        assert proc.wait(120) == 0
        assert "drained" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_on_a_mesh_gives_the_single_device_tokens(devices):
    """The shipped model sharded on 8 fake devices (cpu-8: 2-way data x 4-way expert), rows over the data
    axis: two requests that run together get what `generate` gives each alone on one device."""
    from clover_jax.mesh import layouts

    mesh = layouts.mesh_from_arg("cpu-8")
    cfg, one_device = load_model(str(shipped.MODEL_DIR))
    _, sharded = load_model(str(shipped.MODEL_DIR), params.weight_shardings(cfg, mesh.mesh, mesh.rules))
    with pytest.raises(ServingError, match="multiples of the mesh's data axis"):
        Engine(sharded, cfg, batch_sizes=(1, 2), mesh=mesh)
    eng = Engine(sharded, cfg, max_prompt=32, max_tokens=64, batch_sizes=(2,), mesh=mesh)
    eng.start()
    col = Collector()
    reqs = [request_of((5, 9, 17, 33), 64, steps_per_block=16), request_of((7, 11), 40, threshold=0.5)]
    for i, r in enumerate(reqs):
        eng.submit(r, col.sink(i))
    col.wait([0, 1])
    eng.drain(timeout=60)
    assert eng._state.canvas.sharding.spec[0] == "data"
    for i, r in enumerate(reqs):
        assert col.tokens(i) == alone(one_device, cfg, list(r.prompt), r)
