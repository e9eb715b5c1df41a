"""The serving engine's scaffolds (`requests.Scaffold`): tokens fixed in a response before the model runs their block,
and columns whose tokens are restricted to a class; a scaffolded request shares the batch with plain ones, which
still get what `generate` gives them alone."""

from __future__ import annotations

import json

import pytest

from clover_jax import shipped
from clover_jax.checkpoint import load_model
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.serving.engine import Engine
from clover_jax.serving.requests import BadRequest, Event, Request, Scaffold
from clover_jax.tokenizer import load_tokenizer
from tests.engine_requests import serve, tokens

L = 32
pytestmark = pytest.mark.xdist_group("scaffold")


@pytest.fixture(scope="module")
def engine():
    cfg, weights = load_model(str(shipped.MODEL_DIR))
    tok = load_tokenizer(str(shipped.MODEL_DIR))
    eng = Engine(weights, cfg, max_prompt=32, max_tokens=96, batch_sizes=(2,), prefill_rows=2, scaffold_classes=2)
    eng.start()
    yield eng, tok
    eng.drain(timeout=120)


def _run(eng: Engine, reqs: list[Request]) -> list[tuple[list[int], Event]]:
    """Each request's tokens and last event, the requests admitted together (one batch)."""
    return [(tokens(evs), evs[-1]) for evs in serve(eng, reqs, together=True, timeout=300)]


def test_fixed_tokens_and_classes_hold_and_a_plain_row_beside_is_unchanged(engine):
    eng, tok = engine
    cfg = eng.cfg
    prompt = tuple(tok.encode("KING HENRY:\nOnce more unto the breach"))
    digits = tuple(sorted({t for d in "0123456789" for t in tok.encode(d) if tok.decode([t]).strip() == d}))
    frame = tok.encode(" dear friends, once more")
    tokens = [-1] * 70
    tokens[3:3 + len(frame)] = frame  # inside the first block
    tokens[40] = frame[0]  # inside the second
    tokens[66] = cfg.eos_token_id  # the end, in the third
    classes = [0] * 70
    classes[50:56] = [1] * 6  # digits only
    scaffolded = Request(prompt, 96, SamplerConfig(), scaffold=Scaffold(tuple(tokens), tuple(classes), (digits,)))
    plain = Request(prompt, 96, SamplerConfig())
    (got, ev), (got_plain, _) = _run(eng, [scaffolded, plain])
    assert got[3:3 + len(frame)] == frame and got[40] == frame[0]
    assert all(t in digits for t in got[50:56]), [tok.decode([t]) for t in got[50:56]]
    assert ev.finish_reason == "stop" and len(got) == 66  # the fixed end token ended it there
    want = generate(eng.weights, cfg, [list(prompt)], plain.row_settings(L).replace(cache="prefix")).tokens[0][:96]
    assert got_plain == want
    free = _run(eng, [plain])[0][0]
    assert free[3:3 + len(frame)] != frame  # (so the fixed tokens above were the scaffold's, not the model's own)


def test_a_block_fixed_whole_still_commits_the_block_before(engine):
    """A block whose every column is fixed runs no refinement, but the pass that commits the block before it must
    still run (with the prefix cache it writes that block's K/V and the Gated DeltaNet state over it): fixed to what
    the model writes there anyway, the tokens after it are the model's own."""
    eng, tok = engine
    prompt = tuple(tok.encode("ROMEO:\nBut soft, what light"))
    sampled = SamplerConfig(temperature=1.0, seed=3)  # (sampled tokens notice a small change in the logits)
    free, ev_free = _run(eng, [Request(prompt, 96, sampled)])[0]
    whole = tuple([-1] * L + free[L:2 * L])  # block 2 fixed to what the model wrote there
    got, ev = _run(eng, [Request(prompt, 96, sampled, scaffold=Scaffold(whole))])[0]
    assert got == free
    assert ev.passes == ev_free.passes - L + 1  # block 2 ran its one committing pass, no refinement


def test_scaffolds_are_checked_before_they_are_queued(engine):
    eng, _ = engine
    prompt = (5, 6, 7)
    bad = [(Scaffold((-1,) * 200), "more than max_tokens"), (Scaffold((5000,)), "outside"),
           (Scaffold((), (3,), ((5,),)), "does not define"), (Scaffold((), (1,), ((),)), "empty"),
           (Scaffold((), (), ((5,), (6,), (7,))), "at most 2")]
    for sc, msg in bad:
        with pytest.raises(BadRequest, match=msg):
            eng.submit(Request(prompt, 96, SamplerConfig(), scaffold=sc), lambda ev: None)
    cfg = eng.cfg
    plain = Engine(None, cfg, max_prompt=32, max_tokens=96)
    with pytest.raises(BadRequest, match="takes no scaffolds"):
        plain.submit(Request(prompt, 96, SamplerConfig(), scaffold=Scaffold((5,))), lambda ev: None)


def test_the_tool_model_writes_a_required_call_it_would_not_have_made():
    """Through `clover serve`'s HTTP layer on the shipped tool model: asked about a capital but made to call
    `square` (`tool_choice` names it), the answer is a valid `square` call, its integer written by the model into
    the canvas (its draft names another tool, so the frame is rewritten with `square`'s keys)."""
    from starlette.testclient import TestClient

    from clover_jax import loading
    from clover_jax.serving.api import make_app
    from clover_jax.serving.http_request import request_defaults
    from examples.toy_agent.task import TOOLS

    model = shipped.TOOLS_MODEL_DIR
    cfg, weights = load_model(str(model))
    tok = load_tokenizer(str(model))
    eng = Engine(weights, cfg, max_prompt=256, max_tokens=96, batch_sizes=(1,), prefill_rows=1, scaffold_classes=8)
    eng.start()
    try:
        defaults = request_defaults(loading.sampler_defaults(str(model)))  # as `clover serve` serves it
        http = TestClient(make_app(eng, tok, cfg.name, defaults=defaults))
        body = {"messages": [{"role": "user", "content": "What is the capital of Peru?"}], "tools": list(TOOLS),
                "max_tokens": 96, "temperature": 0}
        free = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert free["tool_calls"][0]["function"]["name"] == "capital"  # what the model calls by itself
        forced = http.post("/v1/chat/completions", json={
            **body, "tool_choice": {"type": "function", "function": {"name": "square"}}}).json()["choices"][0]
        (call,) = forced["message"]["tool_calls"]
        assert forced["finish_reason"] == "tool_calls" and call["function"]["name"] == "square"
        assert isinstance(json.loads(call["function"]["arguments"])["x"], int)
        assert 'clover_tool_calls_total{written="scaffold",result="valid"} 1' in http.get("/metrics").text
    finally:
        eng.drain(timeout=120)
