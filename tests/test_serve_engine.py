"""The serving engine (`clover_jax.serving.engine`): rows that join and leave at block boundaries give
every request exactly the tokens it gets alone from `sampler.generate`, whatever shares its batch."""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import pytest

from clover_jax import shipped
from clover_jax.checkpoint import load_model
from clover_jax.config import get_config
from clover_jax.model import params
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.serving.engine import Engine
from clover_jax.serving.requests import BadRequest, Draining, Event, QueueFull, Request, ServingError
from clover_jax.tokenizer import load_tokenizer

L = 32


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


def alone(weights, cfg, prompt: list[int], req: Request) -> list[int]:
    """The same request through `generate` on its own (block-aligned length, then cut at max_tokens)."""
    n_blocks = -(-req.max_tokens // L)
    steps = (req.steps or L) * n_blocks
    sc = SamplerConfig(gen_length=n_blocks * L, block_length=L, steps=steps, threshold=req.threshold,
                       temperature=req.temperature, seed=req.seed, cache="prefix")
    return generate(weights, cfg, [prompt], sc).tokens[0][:req.max_tokens]


@pytest.fixture(scope="module")
def shipped_engine():
    cfg, weights = load_model(str(shipped.MODEL_DIR))
    tok = load_tokenizer(str(shipped.MODEL_DIR))
    eng = Engine(weights, cfg, max_prompt=32, max_tokens=64, batch_sizes=(1, 4), queue_size=8)
    lines: list[str] = []
    eng.warm_up(lines.append)
    eng.start()
    yield eng, tok, lines
    eng.drain(timeout=120)


def test_warm_up_lists_every_program(shipped_engine):
    _, _, lines = shipped_engine
    assert [line.split(":")[0] for line in lines] == [
        "block program for 1 row x 96 columns (prefix cache)", "block program for 4 rows x 96 columns (prefix cache)",
        "prefill program for prompts up to 32 tokens", "prefill program for prompts up to 64 tokens"]


def test_mixed_requests_equal_each_run_alone(shipped_engine):
    """Six requests of different prompt lengths, lengths and settings arrive while others run (more than
    the 4 rows, so some wait for a free row); each gets what it gets alone. No program compiles while
    serving."""
    eng, tok, _ = shipped_engine
    texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo! wherefore art thou", "KING", "First Citizen:\nBefore we proceed",
             "MENENIUS:\nWhat work's, my countrymen,", "Second Servant:"]
    settings = zip([40, 64, 7, 33, 64, 20], [0, 0, 0.5, 0, 0.3, 0], [None, 16, None, 8, None, 4], strict=True)
    reqs = [Request(tuple(tok.encode(t)), m, threshold=th, steps=st)
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
        assert got == alone(eng.weights, eng.cfg, list(r.prompt), r), f"request {i} ({texts[i]!r}) differs"
        assert len(got) <= r.max_tokens
        assert col.reason(i) == ("length" if len(got) == r.max_tokens else "stop")
    assert after.tokens_generated - before.tokens_generated == sum(len(col.tokens(i)) for i in range(len(reqs)))


def test_seeded_sampling_does_not_depend_on_batch_mates(shipped_engine):
    eng, tok, _ = shipped_engine
    req = Request(tuple(tok.encode("ROMEO:")), 40, temperature=0.9, seed=1234)
    col = Collector()
    eng.submit(req, col.sink(0))
    col.wait([0])
    others = [Request(tuple(tok.encode(t)), 64, temperature=t2, seed=s) for t, t2, s in
              [("KING", 0.0, 0), ("JULIET:", 1.2, 7), ("First Citizen:", 0.5, 99)]]
    for i, r in enumerate(others, start=1):
        eng.submit(r, col.sink(i))
    eng.submit(req, col.sink(9))
    eng.submit(dataclasses.replace(req, seed=4321), col.sink(10))
    col.wait([1, 2, 3, 9, 10])
    assert col.tokens(9) == col.tokens(0), "the same seed gave other text next to other requests"
    assert col.tokens(10) != col.tokens(0), "another seed gave the same text"


def test_cancel_frees_the_row_and_spares_the_others(shipped_engine):
    eng, tok, _ = shipped_engine
    col = Collector()
    slow = eng.submit(Request(tuple(tok.encode("KING RICHARD:")), 64, steps=32), col.sink(0))
    keep = Request(tuple(tok.encode("QUEEN:")), 64)
    eng.submit(keep, col.sink(1))
    deadline = time.monotonic() + 120
    while not col.events.get(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    eng.cancel(slow)
    col.wait([0, 1])
    assert col.reason(0) == "cancelled"
    assert len(col.tokens(0)) < 64
    assert col.tokens(1) == alone(eng.weights, eng.cfg, list(keep.prompt), keep)
    assert eng.stats().active_rows == 0


def test_bad_requests_are_refused_before_queueing(shipped_engine):
    eng, _, _ = shipped_engine
    with pytest.raises(BadRequest, match="at most 32"):
        eng.submit(Request(tuple(range(5, 45)), 8), lambda ev: None)
    with pytest.raises(BadRequest, match="max_tokens"):
        eng.submit(Request((5, 6), 65), lambda ev: None)
    with pytest.raises(BadRequest, match="temperature"):
        eng.submit(Request((5, 6), 8, temperature=-1.0), lambda ev: None)
    with pytest.raises(BadRequest, match="outside"):
        eng.submit(Request((5, 99999), 8), lambda ev: None)
    with pytest.raises(BadRequest, match="steps"):
        eng.submit(Request((5, 6), 8, steps=33), lambda ev: None)


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
    reqs = [Request((5 + i, 6, 7), 32) for i in range(2)]
    ids = [eng.submit(r, col.sink(i)) for i, r in enumerate(reqs)]  # not started: both wait in the queue
    with pytest.raises(QueueFull):
        eng.submit(Request((5,), 8), lambda ev: None)
    eng.start()
    eng.drain(timeout=120)
    assert len(ids) == 2 and all(col.reason(i) in ("length", "stop") for i in range(2))
    for i, r in enumerate(reqs):
        assert col.tokens(i) == alone(weights, cfg, list(r.prompt), r)
    with pytest.raises(Draining):
        eng.submit(Request((5,), 8), lambda ev: None)
