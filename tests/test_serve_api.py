"""The HTTP layer of `clover serve` (clover_jax.serving.api, .http_request, .choices, .responses, .metrics,
.chat, commands/serve) against a FAKE engine: a thread that implements the Engine contract and echoes each
prompt's tokens back, block by block, so every response is known in advance. The real engine is tested in
test_serve.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from clover_jax import cli
from clover_jax.commands import serve as serve_cmd
from clover_jax.errors import UsageError
from clover_jax.sampler import SamplerConfig
from clover_jax.serving.api import make_app, set_draining
from clover_jax.serving.chat import plain_prompt
from clover_jax.serving.choices import find_stop
from clover_jax.serving.requests import BadRequest, Draining, Event, QueueFull, Request
from clover_jax.tokenizer import ByteTokenizer

MODEL = "fake-model"
TOK = ByteTokenizer()


@dataclass(frozen=True)
class FakeCfg:
    vocab_size: int = 260
    eos_token_id: int = 2
    mask_token_id: int = 3
    name: str = MODEL


@dataclass(frozen=True)
class FakeStats:
    requests_admitted: int
    requests_finished: int
    tokens_generated: int
    program_passes: int
    row_passes: int
    queue_depth: int
    active_rows: int
    capacity: int
    blocks_run: int
    rows_in_blocks: int
    prefill_calls: int = 0
    rows_prefilled: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    prefix_entries: int = 0
    prefix_bytes: int = 0


@dataclass
class _Row:
    rid: int
    req: Request
    on_event: Any
    made: int = 0
    passes: int = 0


@dataclass
class FakeEngine:
    """The Engine contract, deterministically: every block gives each running request the next
    `block_length` tokens of its prompt, cycled (cut at the end token: finish "stop"; at max_tokens:
    "length"); a cancelled request gets a final ((), "cancelled") event at the next block boundary.
    `fail` (raised by submit once `fail_after` requests were taken), `gate` (clear it to pause the
    blocks) and `delay` (seconds between blocks) let tests steer it; `submitted`, `rids`, `cancelled`
    and `finished` record what happened."""

    weights: Any = None
    cfg: Any = field(default_factory=FakeCfg)
    block_length: int = 4
    max_prompt: int = 64
    max_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    queue_size: int = 8
    prefill_rows: int = 4
    prefix_cache_gb: float = 0.0
    scaffold_classes: int = 0  # (taken, not used: it answers a scaffolded request like any other)
    cache: str = "prefix"
    delay: float = 0.0
    dispatch: Any = None
    mesh: Any = None
    self_speculative: bool = False
    fail: Exception | None = None
    fail_after: int = 0
    fail_blocks: bool = False  # end every running request with finish_reason "error" (a device failure)
    submitted: list[Request] = field(default_factory=list)
    rids: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    finished: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(self.batch_sizes)
        self.admission = SimpleNamespace(prefix_cache=False, prefix_cache_note=None, row_bytes=0)
        self._cond = threading.Condition()
        self._queue: list[_Row] = []
        self._rows: dict[int, _Row] = {}
        self._to_cancel: set[int] = set()
        self._draining = self._stop = False
        self._thread: threading.Thread | None = None
        self.gate = threading.Event()
        self.gate.set()
        self._n = {"admitted": 0, "finished": 0, "tokens": 0, "passes": 0, "row_passes": 0, "blocks": 0, "rows": 0}

    def warm_up(self, log: Any) -> None:
        for b in self.batch_sizes:
            log(f"block program for batch {b}")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, req: Request, on_event: Any) -> int:
        with self._cond:
            if self.fail is not None and len(self.submitted) >= self.fail_after:
                raise self.fail
            if self._draining:
                raise Draining("the engine is draining")
            req.check(self.block_length, self.cache, self.cfg.vocab_size, self.max_prompt, self.max_tokens)
            if len(self._queue) >= self.queue_size:
                raise QueueFull(f"{len(self._queue)} requests are waiting already")
            rid = 100 + len(self.submitted)
            self.submitted.append(req)
            self.rids.append(rid)
            self._queue.append(_Row(rid, req, on_event))
            self._n["admitted"] += 1
            self._cond.notify_all()
            return rid

    def cancel(self, rid: int) -> None:
        with self._cond:
            self.cancelled.append(rid)
            self._to_cancel.add(rid)

    def drain(self, timeout: float | None = None) -> None:
        with self._cond:
            self._draining = True
            self._cond.wait_for(lambda: not (self._queue or self._rows), timeout)
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> FakeStats:
        n = self._n
        with self._cond:
            return FakeStats(n["admitted"], n["finished"], n["tokens"], n["passes"], n["row_passes"],
                             len(self._queue), len(self._rows), max(self.batch_sizes), n["blocks"], n["rows"])

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._queue or self._rows)
                if self._stop and not (self._queue or self._rows):
                    return
                while self._queue and len(self._rows) < max(self.batch_sizes):
                    row = self._queue.pop(0)
                    self._rows[row.rid] = row
                rows = list(self._rows.values())
            self.gate.wait()
            self._block(rows)
            time.sleep(self.delay)

    def _block(self, rows: list[_Row]) -> None:
        steps = max(r.req.sampling.steps_per_block or self.block_length for r in rows)
        events = [(r, self._step(r)) for r in rows]
        with self._cond:
            self._n["blocks"] += 1
            self._n["rows"] += len(rows)
            self._n["passes"] += steps
            for r, ev in events:
                self._n["tokens"] += len(ev.tokens)
                self._n["row_passes"] += r.req.sampling.steps_per_block or self.block_length
                if ev.finish_reason is not None:
                    del self._rows[r.rid]
                    self.finished[r.rid] = ev.finish_reason
                    self._n["finished"] += 1
            self._cond.notify_all()
        for r, ev in events:
            with contextlib.suppress(Exception):  # a callback's error must not stop the engine
                r.on_event(ev)

    def _step(self, r: _Row) -> Event:
        with self._cond:
            if r.rid in self._to_cancel:
                return Event((), "cancelled", r.passes)
            if self.fail_blocks:
                return Event((), "error", r.passes)
        out, reason = [], None
        while len(out) < self.block_length and r.made < r.req.max_tokens:
            t = r.req.prompt[r.made % len(r.req.prompt)]
            if r.req.sampling.eos_stop and t == self.cfg.eos_token_id:
                reason = "stop"
                break
            out.append(t)
            r.made += 1
        r.passes += r.req.sampling.steps_per_block or self.block_length
        if reason is None and r.made >= r.req.max_tokens:
            reason = "length"
        return Event(tuple(out), reason, r.passes)


class TemplateTokenizer(ByteTokenizer):
    def apply_chat_template(self, prompt: str) -> str | None:
        return f"<|user|>{prompt}<|assistant|>"


def echo(text: str, n: int) -> str:
    """What the fake engine answers to prompt `text` (ASCII) with max_tokens `n`."""
    return (text * (n // len(text) + 1))[:n]


@pytest.fixture
def engine():
    e = FakeEngine()
    e.start()
    yield e
    e.drain(timeout=5)


@pytest.fixture
def logs() -> list[str]:
    return []


@pytest.fixture
def app(engine, logs):
    return make_app(engine, TOK, MODEL, log=logs.append)


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


def complete(client: TestClient, **body: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, **body})


def sse(resp: httpx.Response) -> list[Any]:
    """The data of every SSE event (JSON decoded; "[DONE]" as is), checking the framing on the way."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert "\r" not in resp.text and resp.text.endswith("data: [DONE]\n\n")
    out = []
    for event in resp.text.split("\n\n")[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        data = event[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_texts(events: list[Any], index: int = 0) -> list[str]:
    return [c["choices"][0]["text"] for c in events[:-1] if c["choices"] and c["choices"][0]["index"] == index]


# --- plain endpoints -------------------------------------------------------------------------------

def test_health_and_draining(client, app):
    assert client.get("/health").json() == {"status": "ok"}
    set_draining(app)
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "draining"}
    r = complete(client, prompt="abc")
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["owned_by"] == "clover-jax" and body["data"][0]["object"] == "model"
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/gpt-4").status_code == 404


def test_framework_errors_are_openai_errors(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]


# --- completions -----------------------------------------------------------------------------------

def test_completion_shape_and_usage(client, engine):
    r = complete(client, prompt="abcdefgh", max_tokens=10)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "abcdefghab", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 10, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    req = engine.submitted[0]
    assert req.prompt == tuple(TOK.encode("abcdefgh")) and req.max_tokens == 10 and req.sampling.temperature == 0.0


def test_completion_defaults_and_ignored_extras(client, engine):
    r = complete(client, prompt="xy", frequency_penalty=0.5, user="someone", logit_bias={})
    assert r.status_code == 200
    assert engine.submitted[0].max_tokens == 64  # min(128, the engine's max_tokens)
    assert r.json()["choices"][0]["text"] == echo("xy", 64)
    assert client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 4}).status_code == 200  # no model


def test_prompt_forms(client, engine):
    ids = TOK.encode("hello")
    for prompt in (["hello"], ids, [ids]):
        r = complete(client, prompt=prompt, max_tokens=5)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
    assert [q.prompt for q in engine.submitted] == [tuple(ids)] * 3
    r = complete(client, prompt=["a", "b"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_end_token_finishes_with_stop(client):
    r = complete(client, prompt=[10, 11, 2, 12], max_tokens=16)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == TOK.decode([10, 11])
    assert r.json()["usage"]["completion_tokens"] == 2


def test_diffusion_extension_reaches_the_request(client, engine):
    r = complete(client, prompt="abcd", max_tokens=4, temperature=0.5, top_p=0.9, seed=3,
                 diffusion={"steps": 2, "block_length": 4, "threshold": 0.9, "remasking": "margin",
                            "cache": "prefix", "top_k": 5})
    assert r.status_code == 200
    assert engine.submitted[0] == Request(prompt=tuple(TOK.encode("abcd")), max_tokens=4, sampling=SamplerConfig(
        temperature=0.5, top_p=0.9, top_k=5, threshold=0.9, steps_per_block=2, remasking="margin", seed=3,
        block_length=4, cache="prefix"))
    assert complete(client, prompt="abcd", max_tokens=4, diffusion={"cache": "auto"}).status_code == 200


def test_n_choices_and_seeds(client, engine):
    body = complete(client, prompt="abcd", max_tokens=6, n=3, seed=5, temperature=0.8).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "abcdab" for c in body["choices"])
    assert [q.sampling.seed for q in engine.submitted] == [5, 6, 7]
    assert body["usage"]["completion_tokens"] == 18 and body["usage"]["prompt_tokens"] == 4
    complete(client, prompt="abcd", max_tokens=4, n=2)  # greedy without a seed: seed 0 for all
    assert [q.sampling.seed for q in engine.submitted[3:]] == [0, 0]
    complete(client, prompt="abcd", max_tokens=4, n=4, temperature=1.0)  # sampled without a seed: random
    seeds = [q.sampling.seed for q in engine.submitted[5:]]
    assert len(set(seeds)) > 1 and all(0 <= s < 2**31 for s in seeds)


def test_stop_string_spanning_blocks(client, engine):
    # blocks of 4: "abcd" | "efgh"; "def" spans them. The pause between blocks keeps the fake engine
    # from running all 8 blocks to "length" before the server's cancel reaches it.
    engine.delay = 0.2
    r = complete(client, prompt="abcdefgh", max_tokens=32, stop="def")
    choice = r.json()["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "stop"
    assert engine.cancelled == [engine.rids[0]]  # its row is freed
    _wait(lambda: engine.finished.get(engine.rids[0]) == "cancelled")

    events = sse(complete(client, prompt="abcdefgh", max_tokens=32, stop=["zzzz", "def"], stream=True))
    texts = stream_texts(events)
    assert "".join(texts) == "abc" and not any("d" in t for t in texts)
    assert texts[0] == "a"  # the first block holds back len("zzzz") - 1 characters
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert engine.rids[1] in engine.cancelled


def test_stop_string_in_the_last_block_and_no_match(client, engine):
    body = complete(client, prompt="abcdefgh", max_tokens=8, stop=["gh"]).json()
    assert body["choices"][0]["text"] == "abcdef" and body["choices"][0]["finish_reason"] == "stop"
    events = sse(complete(client, prompt="abcdefgh", max_tokens=8, stop="xyz", stream=True))
    assert stream_texts(events) == ["ab", "cdefgh", ""]  # the held-back tail comes with the final block
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert find_stop("abcabc", ["ca", "b"]) == 1 and find_stop("abc", ["x"]) is None


def test_stream_chunks(client):
    events = sse(complete(client, prompt="abcdefgh", max_tokens=12, stream=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert stream_texts(events) == ["abcd", "efgh", "abcd", ""]  # one chunk per block, then the final one
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_stream_holds_back_half_a_utf8_character(client):
    events = sse(complete(client, prompt="aaaé", max_tokens=8, stream=True))  # blocks: a a a C3 | A9 a a a
    texts = stream_texts(events)
    assert texts[:2] == ["aaa", "éaaa"] and not any("\ufffd" in t for t in texts)


def test_stream_n_choices_carry_their_index(client):
    events = sse(complete(client, prompt="abcd", max_tokens=8, n=2, stream=True))
    for i in (0, 1):
        mine = [c["choices"][0] for c in events[:-1] if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == "abcdabcd" and mine[-1]["finish_reason"] == "length"


def test_stream_include_usage(client):
    events = sse(complete(client, prompt="abcd", max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4


# --- chat ------------------------------------------------------------------------------------------

def test_chat_plain_format(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}]}]
    body = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8}).json()
    text = "system: be brief\nuser: hi\nassistant:"
    assert plain_prompt([("system", "be brief"), ("user", "hi")]) == text
    assert engine.submitted[0].prompt == tuple(TOK.encode(text))
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text[:8]}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(text)
    assert engine.submitted[0].keep == len(text.removesuffix("assistant:"))  # what the next turn begins with


class _ThinkingTemplate(ByteTokenizer):
    """A template whose assistant opening (`<think>`) is not how it renders an earlier assistant turn."""

    chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")


def test_a_chat_prompt_keeps_the_conversation_a_next_turn_begins_with(engine):
    """The prefix cache saves a chat's conversation without the assistant's opening (`Request.keep`): the next
    turn's prompt begins with that, though not with the whole prompt."""
    turns = [[{"role": "user", "content": "hi"}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
              {"role": "user", "content": "more"}]]
    with TestClient(make_app(engine, _ThinkingTemplate(), MODEL)) as client:
        for messages in turns:
            assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).status_code == 200
    first, second = engine.submitted[:2]
    assert first.prompt == tuple(TOK.encode("<|user|>hi\n<|assistant|><think>\n"))
    assert first.keep == len("<|user|>hi\n")
    assert second.prompt[:first.keep] == first.prompt[:first.keep] and second.prompt[:len(first.prompt)] != \
        first.prompt
    assert second.keep == len("<|user|>hi\n<|assistant|>yo\n<|user|>more\n")


def test_chat_template_for_one_user_message(engine):
    with TestClient(make_app(engine, TemplateTokenizer(), MODEL)) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_completion_tokens": 4})
    assert r.status_code == 200
    assert engine.submitted[0].prompt == tuple(TOK.encode("<|user|>hi<|assistant|>"))
    assert engine.submitted[0].max_tokens == 4


def test_chat_stream(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abcd"}],
                                                  "max_tokens": 8, "stream": True})
    events = sse(r)
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain_prompt([("user", "abcd")])[:8]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_chat_bad_messages(client):
    for messages, param in (("hi", "messages"), ([], "messages"), ([{"content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 5}], "messages[0].content")):
        r = client.post("/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, messages


# --- errors ----------------------------------------------------------------------------------------

def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    return err


def test_malformed_json(client):
    err = _error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400)
    assert "JSON" in err["message"] and err["type"] == "invalid_request_error"
    assert "object" in _error(client.post("/v1/completions", json=[1, 2]), 400)["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "n": True}, "n"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "seed": 1.5}, "seed"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"prompt": "a", "diffusion": {"steps": "2"}}, "diffusion.steps"),
    ({"prompt": "a", "diffusion": []}, "diffusion"),
    ({"prompt": "a", "model": 7}, "model"),
])
def test_wrong_types(client, engine, body, param):
    assert _error(client.post("/v1/completions", json=body), 400)["param"] == param
    assert engine.submitted == []


@pytest.mark.parametrize(("body", "needle"), [
    ({"prompt": "a", "max_tokens": 65}, "max_tokens must be an integer in [1, 64]"),
    ({"prompt": "a" * 65}, "at most 64"),
    ({"prompt": ""}, "empty"),
    ({"prompt": [300]}, "outside"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "n": 9}, "n must be in [1, 8]"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"prompt": "a", "stop": [""]}, "empty"),
    ({"prompt": "a", "diffusion": {"block_length": 32}}, "block_length must be 4"),
    ({"prompt": "a", "diffusion": {"cache": "none"}}, "cache"),
    ({"prompt": "a", "diffusion": {"steps": 9}}, "steps"),
    ({"prompt": "a", "diffusion": {"remasking": "best"}}, "remasking"),
    ({"prompt": "a", "diffusion": {"stepz": 2}}, "stepz"),
])
def test_bad_settings_name_the_problem(client, engine, body, needle):
    assert needle in _error(client.post("/v1/completions", json=body), 400)["message"]
    assert engine.submitted == []


def test_unknown_model(client):
    err = _error(complete(client, prompt="a", model="gpt-4"), 404)
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]


def test_engine_refusals(client, engine):
    engine.fail = QueueFull("16 requests are waiting already")
    r = complete(client, prompt="a")
    assert "16 requests are waiting" in _error(r, 429)["message"] and r.headers["retry-after"] == "1"
    engine.fail = Draining("the engine is draining")
    assert _error(complete(client, prompt="a"), 503)["code"] == "draining"
    engine.fail = BadRequest("steps (per block) must be an integer in [1, 4], got 7")
    err = _error(complete(client, prompt="a"), 400)
    assert err["message"] == "steps (per block) must be an integer in [1, 4], got 7" and err["param"] == "steps"


def test_a_refused_choice_cancels_the_others(client, engine):
    engine.fail, engine.fail_after = QueueFull("full"), 1
    _error(complete(client, prompt="abcd", n=2), 429)
    assert engine.cancelled == engine.rids == [100]


def test_internal_error_is_one_line_and_isolated(client, engine, logs):
    engine.fail = RuntimeError("boom")
    err = _error(complete(client, prompt="a"), 500)
    assert err["type"] == "server_error" and "boom" not in err["message"]
    assert len(logs) == 1 and "RuntimeError: boom" in logs[0]
    engine.fail = None
    assert complete(client, prompt="abcd", max_tokens=4).json()["choices"][0]["text"] == "abcd"


# --- disconnects -----------------------------------------------------------------------------------

async def _asgi_post(app: Any, body: dict[str, Any], disconnect_when: Any) -> list[dict[str, Any]]:
    """POST /v1/completions straight to the ASGI app; the client disconnects once `disconnect_when(sent)`."""
    payload = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    changed = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        while not disconnect_when(sent):
            changed.clear()
            await changed.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        changed.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def _wait(cond: Any, timeout: float = 5) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_stream_disconnect_cancels_every_choice(engine):
    engine.delay = 0.05
    app = make_app(engine, TOK, MODEL)

    def after_first_chunk(sent: list[dict[str, Any]]) -> bool:
        return any(b"data: " in m.get("body", b"") for m in sent)

    sent = asyncio.run(_asgi_post(app, {"prompt": "abcd", "max_tokens": 64, "n": 2, "stream": True},
                                  after_first_chunk))
    assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
    assert sorted(engine.cancelled) == engine.rids == [100, 101]
    _wait(lambda: engine.finished == {100: "cancelled", 101: "cancelled"})


def test_non_stream_disconnect_cancels(engine):
    engine.gate.clear()  # nothing finishes until the client has gone
    app = make_app(engine, TOK, MODEL)
    asyncio.run(_asgi_post(app, {"prompt": "abcd", "max_tokens": 64}, lambda sent: True))
    assert engine.cancelled == [100]
    engine.gate.set()
    _wait(lambda: engine.finished == {100: "cancelled"})


# --- metrics ---------------------------------------------------------------------------------------

def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


def test_metrics(client, engine):
    complete(client, prompt="abcd", max_tokens=8)
    sse(complete(client, prompt="abcd", max_tokens=8, stream=True))
    complete(client, prompt="a", max_tokens="x")
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    assert _sample(text, 'clover_requests_total{endpoint="/v1/completions",status="200"}') == 2
    assert _sample(text, 'clover_requests_total{endpoint="/v1/completions",status="400"}') == 1
    assert _sample(text, "clover_request_latency_seconds_count") == 2
    assert _sample(text, 'clover_request_latency_seconds_bucket{le="+Inf"}') == 2
    assert _sample(text, "clover_time_to_first_block_seconds_count") == 2
    assert _sample(text, "clover_generated_tokens_total") == 16
    assert _sample(text, "clover_forward_passes_total") == engine.stats().program_passes > 0
    assert _sample(text, "clover_tokens_per_pass") == 16 / engine.stats().row_passes
    assert _sample(text, "clover_batch_capacity") == 4
    assert _sample(text, "clover_queue_depth") == 0 and _sample(text, "clover_active_rows") == 0
    assert _sample(text, "clover_mean_rows_per_block") >= 1
    assert "# TYPE clover_request_latency_seconds histogram" in text
    assert "# TYPE clover_generated_tokens_total counter" in text
    client.get("/metrics")
    assert _sample(client.get("/metrics").text, 'clover_requests_total{endpoint="/metrics",status="200"}') == 2


# --- the serve command -----------------------------------------------------------------------------

def test_serve_flags_fail_before_loading(capsys):
    assert cli.main(["serve", "--port", "70000"]) == 2
    assert "--port must be in [0, 65535]" in capsys.readouterr().err
    assert cli.main(["serve", "--batch-sizes", "0", "4"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err


def test_serve_without_the_extra(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'clover-jax[serve]'" in err and len(err.strip().splitlines()) == 1


def test_serve_busy_port(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert cli.main(["serve", "--port", str(s.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_engine_kwargs():
    args = cli.build_parser().parse_args(["serve", "--batch-sizes", "4", "1", "4", "--max-tokens", "256"])
    kw = serve_cmd.engine_kwargs(args, None)
    assert kw == {"batch_sizes": (1, 4), "cache": "auto", "queue_size": 256, "dispatch": None, "mesh": None,
                  "max_tokens": 256, "self_speculative": False, "prefill_rows": 4,
                  "prefix_cache_gb": 1.0, "scaffold_classes": serve_cmd.SCAFFOLD_CLASSES}
    assert serve_cmd.SCAFFOLD_CLASSES > 0  # calls are written into the canvas by default
    args = cli.build_parser().parse_args(["serve", "--tool-calls", "free"])
    assert serve_cmd.engine_kwargs(args, None)["scaffold_classes"] == 0  # calls stay as the model wrote them
    args = cli.build_parser().parse_args(["serve", "--self-speculative", "--prefill-rows", "2"])
    assert serve_cmd.engine_kwargs(args, None)["self_speculative"] is True
    assert serve_cmd.engine_kwargs(args, None)["prefill_rows"] == 2
    with pytest.raises(UsageError, match="--prefill-rows must be >= 1, got 0"):
        serve_cmd.check_flags(cli.build_parser().parse_args(["serve", "--prefill-rows", "0"]))


def test_model_defaults_fill_what_a_request_leaves_out():
    """generation_config.json's settings (the shipped model's: temperature 0.9, random remasking, 128
    tokens) apply to fields a request omits; a field the request gives wins."""
    from clover_jax.serving.http_request import parse_job, request_defaults

    defaults = request_defaults({"temperature": 0.9, "remasking": "random", "gen_length": 128,
                                           "block_length": 32, "steps": None, "seed": 3})
    assert defaults == {"temperature": 0.9, "remasking": "random", "max_tokens": 128}
    eng = FakeEngine()
    eng.max_tokens = 64
    req = parse_job({"prompt": "ab"}, eng, (5, 6), False, defaults).requests[0]
    assert (req.sampling.temperature, req.sampling.remasking, req.max_tokens) == (0.9, "random", 64)  # the limit
    req = parse_job({"prompt": "ab", "temperature": 0, "max_tokens": 8, "diffusion": {"remasking": "margin"}},
                    eng, (5, 6), False, defaults).requests[0]
    assert (req.sampling.temperature, req.sampling.remasking, req.max_tokens) == (0, "margin", 8)
    assert parse_job({"prompt": "ab"}, eng, (5, 6), False).requests[0].sampling.temperature == 0.0
    eng.self_speculative = True  # a request for a mode that decodes greedily does not get the model's temperature
    for mode in ("causal", "self_speculative"):
        req = parse_job({"prompt": "ab", "diffusion": {mode: True}}, eng, (5, 6), False, defaults).requests[0]
        assert (req.sampling.temperature, getattr(req.sampling, mode), req.sampling.remasking) == (0.0, True, "random")
    with pytest.raises(BadRequest, match=r"diffusion\.causal decodes greedily"):
        parse_job({"prompt": "ab", "temperature": 0.5, "diffusion": {"causal": True}}, eng, (5, 6), False, defaults)


def install_fake_engine(delay: float) -> None:
    """Make `clover serve` in this process run a FakeEngine on the byte tokenizer (for the subprocess test)."""
    module = types.ModuleType("clover_jax.serving.engine")
    module.Engine = functools.partial(FakeEngine, delay=delay)  # type: ignore[attr-defined]
    sys.modules["clover_jax.serving.engine"] = module
    from clover_jax import loading

    loading.open_model = lambda model, mesh=None, say=None: loading.OpenModel(FakeCfg(), None, ByteTokenizer(), None)


def _read_lines(stream: Any, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_serve_drains_on_sigterm():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_serve_api as t; t.install_fake_engine(0.2); "
            "from clover_jax import cli; "
            "sys.exit(cli.main(['serve', '--port', '0', '--block-length', '4', '--log-level', 'warning']))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    seen = []
    try:
        while not any("listening on" in s for s in seen):
            seen.append(lines.get(timeout=120))
        assert any("compiled block program for batch 16" in s for s in seen)
        url = re.search(r"listening on (http://\S+)", seen[-1]).group(1)
        with httpx.Client(base_url=url, timeout=30) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": "abcd", "max_tokens": 32, "stream": True}) as r:
            data = (line for line in r.iter_lines() if line.startswith("data: "))
            first = json.loads(next(data)[6:])
            assert first["choices"][0]["text"] == "abcd"
            proc.send_signal(signal.SIGTERM)
            _wait(lambda: httpx.get(url + "/health").status_code == 503)
            assert httpx.post(url + "/v1/completions", json={"prompt": "a"}).status_code == 503
            rest = list(data)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in rest[:-1]) == "abcd" * 7
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    while not lines.empty():
        seen.append(lines.get())
    assert "clover serve: drained, exiting" in "".join(seen)


def test_time_to_first_block_is_before_the_end(engine):
    engine.delay = 0.1
    with TestClient(make_app(engine, TOK, MODEL)) as client:
        assert complete(client, prompt="abcd", max_tokens=16).status_code == 200  # 4 blocks, 0.1 s apart
        text = client.get("/metrics").text
    first, total = (_sample(text, f"clover_{m}_seconds_sum") for m in ("time_to_first_block", "request_latency"))
    assert first < 0.1 and total > 0.25


def test_openai_client_reads_the_responses(client):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    assert [m.id for m in oa.models.list().data] == [MODEL]
    r = oa.completions.create(model=MODEL, prompt="abcdefgh", max_tokens=8, stop=["fg"])
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("abcde", "stop", 5)
    chunks = list(oa.completions.create(model=MODEL, prompt="abcd", max_tokens=8, n=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == 1) == "abcdabcd"
    stream = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                        stream=True, extra_body={"diffusion": {"steps": 2}})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "user: "
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="a")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oa.completions.create(model=MODEL, prompt="a", max_tokens=1000)


def test_engine_failure_is_a_500_and_the_engine_goes_on(client, engine, logs):
    engine.fail_blocks, engine.last_error = True, RuntimeError("device lost")
    err = _error(complete(client, prompt="abcd", max_tokens=8, n=2), 500)
    assert err["code"] == "engine_error" and "device lost" not in err["message"]
    assert "device lost" in logs[0] and engine.cancelled == [101]  # the other choice is cancelled
    events = sse(complete(client, prompt="abcd", max_tokens=8, stream=True))
    assert events[-2]["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
    engine.fail_blocks = False
    assert complete(client, prompt="abcd", max_tokens=4).json()["choices"][0]["text"] == "abcd"
