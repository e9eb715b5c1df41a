"""`clover serve` on a network: API keys, limits, the deadline, disconnects, fuzzing (schemathesis over the
server's own OpenAPI document, hypothesis over the request parser), hostile bytes and connections, and
the access lines. Everything runs on the FAKE engine of test_serve_api (no model, no compile); servers
listen on 127.0.0.1 only and every loop is bounded."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import platform
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from test_serve_api import MODEL, TOK, FakeEngine, _read_lines, _wait, echo, sse

from clover_jax import cli
from clover_jax.commands import serve as serve_cmd
from clover_jax.errors import UsageError
from clover_jax.serving import guard, logs
from clover_jax.serving.api import make_app, set_draining
from clover_jax.serving.http_errors import ApiError
from clover_jax.serving.http_request import Limits, chat_prompt, completion_prompt, parse_job
from clover_jax.serving.requests import ServingError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEY = "test-key-0123456789abcdef"
KEY2 = "second-key-fedcba9876543210"
AUTH = {"Authorization": f"Bearer {KEY}"}
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True)

_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
FE_DFL_ENV = ctypes.c_void_p(-1)  # glibc's and musl's ((const fenv_t *) -1): the default environment
FENV_SIZE = 64  # bytes, more than any fenv_t (32 on x86-64 glibc)


def flushes_subnormals() -> bool:
    """Whether this thread's floating-point unit flushes subnormals to zero (FTZ / DAZ on x86)."""
    tiny = sys.float_info.min
    return tiny / 2 == 0.0 or float("5e-324") == 0.0


def default_float_environment() -> None:
    """Put this thread's floating-point environment back to the C library's default: round to nearest, no
    exception traps, subnormals kept (glibc's fesetenv(FE_DFL_ENV) clears x86's FTZ and DAZ bits)."""
    if not sys.platform.startswith("linux"):
        pytest.fail(f"this thread flushes subnormals to zero and resetting it is not implemented on {sys.platform}")
    assert _LIBM.fesetenv(FE_DFL_ENV) == 0, "fesetenv(FE_DFL_ENV) failed"


@pytest.fixture(autouse=True)
def _subnormal_floats():
    """hypothesis and schemathesis refuse to draw floats in a thread that flushes subnormals to zero (a compiled
    library may set that processor state, as XLA's CPU runtime can in an xdist worker that ran JAX tests). Such a
    thread gets the default floating-point environment for the test, and its own back afterwards: the fuzz tests
    always run."""
    if not flushes_subnormals():
        yield
        return
    saved = ctypes.create_string_buffer(FENV_SIZE)
    assert _LIBM.fegetenv(saved) == 0
    default_float_environment()
    assert not flushes_subnormals(), "the default floating-point environment still flushes subnormals"
    try:
        yield
    finally:
        _LIBM.fesetenv(saved)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not sys.platform.startswith("linux"),
                    reason="sets x86's MXCSR through glibc's x86-64 fenv_t")
def test_a_thread_that_flushes_subnormals_gets_them_back():
    """The state the fixture above undoes, made here: MXCSR's FTZ and DAZ bits set (what -ffast-math code and XLA's
    CPU threads do), under which hypothesis cannot draw floats; the reset gives them back."""
    saved = ctypes.create_string_buffer(FENV_SIZE)
    assert _LIBM.fegetenv(saved) == 0
    env = bytearray(saved.raw)
    mxcsr = struct.unpack_from("<I", env, 28)[0]  # x86-64 glibc fenv_t: 28 bytes of x87 state, then MXCSR
    struct.pack_into("<I", env, 28, mxcsr | 0x8040)  # FTZ (bit 15) and DAZ (bit 6)
    try:
        assert _LIBM.fesetenv(ctypes.create_string_buffer(bytes(env), FENV_SIZE)) == 0
        assert flushes_subnormals()
        @fuzz(5)
        @given(x=st.floats())
        def any_float(x: float) -> None:
            pass

        with pytest.raises(FloatingPointError, match="subnormal"):
            any_float()
        default_float_environment()
        assert not flushes_subnormals()
        any_float()
        drawn: list[float] = []

        @fuzz(20)
        @given(x=st.floats(min_value=0.0, max_value=1e-310, exclude_min=True))
        def subnormal(x: float) -> None:
            drawn.append(x)

        subnormal()
        assert drawn and all(0.0 < x <= 1e-310 for x in drawn)  # subnormals, drawn and kept
    finally:
        _LIBM.fesetenv(saved)



def fuzz(examples: int) -> settings:
    """Deterministic hypothesis settings (no database, no deadline) running `examples` examples."""
    return settings(FUZZ, max_examples=examples)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine()
    e.start()
    yield e
    e.gate.set()
    e.drain(timeout=5)


@pytest.fixture
def keyed(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(make_app(engine, TOK, MODEL, api_keys=[KEY, KEY2])) as c:
        yield c


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(make_app(engine, TOK, MODEL)) as c:
        yield c


@contextlib.contextmanager
def live(app: Any) -> Iterator[str]:
    """`app` served by uvicorn on a free port of 127.0.0.1 in a thread; yields its base URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", log_config=None,
                            access_log=False)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    _wait(lambda: srv.started and srv.servers, 60)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


def post(c: TestClient, body: Any, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return c.post(path, json=body, headers={**AUTH, **headers})


def error_of(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if code is not None:
        assert err["code"] == code, err
    return err


# --- API keys ---------------------------------------------------------------------------------------

ROUTES = [("GET", "/metrics"), ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("GET", "/openapi.json"),
          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/no/such/route")]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_but_health_needs_a_key(keyed, engine, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer "}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        r = keyed.request(method, path, headers=headers, json={"prompt": "ab", "messages": [{"role": "user"}]})
        err = error_of(r, 401, "invalid_api_key")
        assert err["type"] == "invalid_request_error" and r.headers["www-authenticate"] == "Bearer"
        assert KEY not in r.text and "wrong" not in r.text
    assert engine.submitted == []
    body = {"prompt": "abcd", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for key in (KEY, KEY2):
        r = keyed.request(method, path, headers={"Authorization": f"bearer {key}"}, json=body)
        assert r.status_code == (404 if path == "/no/such/route" else 200), r.text
    assert keyed.get("/health").json() == {"status": "ok"}  # no key: load balancers probe it


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = guard.hmac.compare_digest
    monkeypatch.setattr(guard.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    ring = guard.KeyRing(["k1-aaaaaaaa", "k2-bbbbbbbb", "k3-cccccccc"])
    for header, ok in ((b"Bearer k1-aaaaaaaa", True), (b"Bearer k3-cccccccc", True), (b"Bearer k2", False),
                       (b"Bearer " + b"x" * 5000, False), (b"Token k1-aaaaaaaa", False)):
        calls.clear()
        assert ring.accepts(header) is ok
        assert len(calls) == 3 and all(len(a) == len(b) == 32 for a, b in calls)  # digests: equal lengths
    assert not ring.accepts(None) and not ring.accepts(b"")
    assert "k1" not in repr(ring)


def test_keys_are_never_logged_echoed_or_exported(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    bad = "Bearer not-the-key-but-secret-too"
    keyed.get("/v1/models", headers={"Authorization": bad})
    post(keyed, {"prompt": "abcd", "max_tokens": 4})
    post(keyed, {"prompt": "abcd", "max_tokens": "x"})
    r = keyed.get("/metrics", headers=AUTH)
    assert r.status_code == 200 and KEY not in r.text and "not-the-key" not in r.text
    lines = [f.format(rec) for rec in caplog.records for f in (logs.TextFormatter(), logs.JsonFormatter())]
    assert len([rec for rec in caplog.records if rec.name == logs.ACCESS_LOGGER]) == 4
    assert not any(KEY in line or "not-the-key" in line for line in [*lines, caplog.text])


def test_openai_client_with_and_without_the_key(engine):
    openai = pytest.importorskip("openai")
    with live(make_app(engine, TOK, MODEL, api_keys=[KEY])) as url:
        good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert [m.id for m in good.models.list().data] == [MODEL]
        r = good.completions.create(model=MODEL, prompt="abcd", max_tokens=6)
        assert r.choices[0].text == "abcdab"
        chunks = list(good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "user"
        for key in ("wrong-key", KEY[:-1]):
            bad = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError) as e:
                bad.completions.create(model=MODEL, prompt="abcd", max_tokens=4)
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert httpx.get(url + "/health").status_code == 200
    assert len(engine.submitted) == 2


def test_api_key_sources(tmp_path, capsys):
    f = tmp_path / "keys"
    f.write_text("# the team's keys\n\n  file-key-one  \n#file-key-commented\nfile-key-two\n")
    f.chmod(0o600)
    args = cli.build_parser().parse_args(["serve", "--api-key", "flag-key", "--api-key-file", str(f)])
    keys = serve_cmd.api_keys(args, {"CLOVER_API_KEY": " env-key \n"})
    assert keys == ["flag-key", "file-key-one", "file-key-two", "env-key"]
    assert serve_cmd.api_keys(cli.build_parser().parse_args(["serve"]), {"CLOVER_API_KEY": ""}) == []
    assert capsys.readouterr().err == ""
    f.chmod(0o644)
    serve_cmd.read_key_file(str(f))
    assert "readable by every user" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    bad = tmp_path / "bad"
    bad.write_text("has a-space secret-part\n")
    for argv, needle in ((["--api-key-file", str(tmp_path / "missing")], "cannot read it"),
                         (["--api-key-file", str(empty)], "holds no key"),
                         (["--api-key-file", str(bad)], "line 1"),
                         (["--api-key", "tab\tsecret-part"], "--api-key #1")):
        with pytest.raises(UsageError, match=needle) as e:
            serve_cmd.api_keys(cli.build_parser().parse_args(["serve", *argv]), {})
        assert "secret-part" not in str(e.value)


def test_warning_without_a_key_off_loopback(capsys):
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.8.9.10"):
        assert serve_cmd.exposure_warning(host, []) is None, host
    for host in ("0.0.0.0", "::", "192.0.2.7", "example.invalid"):
        assert "without an API key" in serve_cmd.exposure_warning(host, []), host
    assert serve_cmd.exposure_warning("0.0.0.0", ["k"]) is None
    with socket.socket() as s:  # a busy port: the command stops after the warning, before loading anything
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert cli.main(["serve", "--host", "0.0.0.0", "--port", str(s.getsockname()[1])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("clover serve: warning: listening on 0.0.0.0 without an API key")


def test_help_documents_the_decisions(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("--api-key KEY", "--api-key-file FILE", "CLOVER_API_KEY", "--max-body-bytes", "--max-messages",
                   "--max-n", "--request-timeout", "'length'", "timed_out", "--log-format {text,json}"):
        assert needle in text, needle


# --- limits -----------------------------------------------------------------------------------------

def test_limit_flags(capsys):
    parse = cli.build_parser().parse_args
    assert serve_cmd.limits(parse(["serve"])) == Limits(1 << 20, 256, 8, serve_cmd.REQUEST_TIMEOUT_S)
    args = parse(["serve", "--max-body-bytes", "4096", "--max-messages", "3", "--max-n", "1", "--request-timeout", "0"])
    assert serve_cmd.limits(args) == Limits(4096, 3, 1, None)
    for argv, needle in ((["--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
                         (["--max-messages", "0"], "--max-messages must be >= 1"), (["--max-n", "0"], "--max-n"),
                         (["--request-timeout", "-1"], "--request-timeout"),
                         (["--request-timeout", "nan"], "--request-timeout")):
        assert cli.main(["serve", *argv]) == 2
        assert needle in capsys.readouterr().err


def test_body_limit_before_parsing(engine):
    with TestClient(make_app(engine, TOK, MODEL, limits=Limits(max_body_bytes=2048))) as c:
        big = {"prompt": "a" * 4000}
        err = error_of(c.post("/v1/completions", json=big), 413, "body_too_large")
        assert "2048" in err["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"a" * 500
            yield b'"}'

        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        error_of(r, 413, "body_too_large")
        assert engine.submitted == []
        assert c.post("/v1/completions", json={"prompt": "a" * 1000, "max_tokens": 4}).status_code == 400  # > 64
        assert c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 4}).status_code == 200


def test_a_huge_content_length_is_refused_without_waiting_for_the_body(engine):
    with live(make_app(engine, TOK, MODEL)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000000000\r\n\r\n{")
            head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()


def test_message_and_choice_limits(engine):
    with TestClient(make_app(engine, TOK, MODEL, limits=Limits(max_messages=3, max_n=1))) as c:
        msgs = [{"role": "user", "content": "x"}] * 4
        err = error_of(c.post("/v1/chat/completions", json={"messages": msgs}), 400, "too_many_messages")
        assert err["param"] == "messages" and "at most 3" in err["message"]
        assert c.post("/v1/chat/completions", json={"messages": msgs[:3], "max_tokens": 4}).status_code == 200
        err = error_of(c.post("/v1/completions", json={"prompt": "ab", "n": 2}), 400)
        assert err["param"] == "n" and "n must be in [1, 1]" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "ab", "n": 1, "max_tokens": 2}).status_code == 200


def test_deadline_ends_a_request_with_length(engine):
    engine.delay = 0.2  # 16 blocks of 4 tokens: 3.2 s; the deadline cuts it after a few
    with TestClient(make_app(engine, TOK, MODEL, limits=Limits(request_timeout_s=0.8))) as c:
        t0 = time.monotonic()
        body = c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 64, "n": 2}).json()
        assert time.monotonic() - t0 < 2.5
        assert body["timed_out"] is True
        for choice in body["choices"]:
            assert choice["finish_reason"] == "length" and 0 < len(choice["text"]) < 64
            assert echo("abcd", 64).startswith(choice["text"])
        assert body["usage"]["completion_tokens"] == sum(len(ch["text"]) for ch in body["choices"])
        _wait(lambda: metric(c.get("/metrics").text, "clover_generations_in_flight") == 0)  # rows freed
        assert all(engine.finished.get(r) == "cancelled" for r in engine.rids)
        text = c.get("/metrics").text
        assert metric(text, "clover_requests_timed_out_total") == 1 and metric(text, "clover_active_rows") == 0

        events = sse(c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 64, "stream": True}))
        assert events[-1] == "[DONE]" and events[-2]["timed_out"] is True
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert not any("timed_out" in e for e in events[:-2])
        assert c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 4}).json()["choices"][0]["text"] \
            == "abcd"  # a short one is untouched


def test_deadline_reads_fine_in_the_openai_client(engine):
    openai = pytest.importorskip("openai")
    engine.delay = 0.1
    with TestClient(make_app(engine, TOK, MODEL, limits=Limits(request_timeout_s=0.3))) as c:
        oa = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0)
        stream = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abcd"}],
                                            max_tokens=64, stream=True)
        finals = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
        assert finals == ["length"]
        r = oa.completions.create(model=MODEL, prompt="abcd", max_tokens=64)
        assert r.choices[0].finish_reason == "length" and r.model_extra["timed_out"] is True


def test_deadline_of_a_request_that_never_got_a_row(engine):
    engine.gate.clear()  # the fake engine stops between blocks: nothing finishes
    with TestClient(make_app(engine, TOK, MODEL, limits=Limits(request_timeout_s=0.2))) as c:
        body = c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 8}).json()
        assert body["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        assert body["timed_out"] is True and engine.cancelled == engine.rids
        engine.gate.set()
        _wait(lambda: engine.finished == {engine.rids[0]: "cancelled"})


def test_disconnect_mid_stream_frees_the_row_in_metrics(engine):
    engine.delay = 0.3  # 16 blocks: 4.8 s, so the row is still running when the client hangs up
    with live(make_app(engine, TOK, MODEL)) as url:
        body = {"prompt": "abcd", "max_tokens": 64, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
            during = httpx.get(url + "/metrics").text
        assert metric(during, "clover_active_rows") == 1 and metric(during, "clover_generations_in_flight") == 1

        def idle() -> bool:
            text = httpx.get(url + "/metrics").text
            return metric(text, "clover_active_rows") == 0 and metric(text, "clover_generations_in_flight") == 0

        _wait(idle, 10)
        assert engine.finished == {engine.rids[0]: "cancelled"}
        assert metric(httpx.get(url + "/metrics").text, 'clover_generations_ended_total{finish_reason="cancelled"}') \
            == 1


# --- hostile bytes ----------------------------------------------------------------------------------

JSON = {"content-type": "application/json"}
DEEP = 10_000
HOSTILE = [
    ("invalid UTF-8", b'{"prompt": "\xff\xfe\xc3"}', JSON, 400, "invalid_json"),
    ("invalid UTF-8 in a key", b'{"\xc0\xaf": 1, "prompt": "a"}', JSON, 400, "invalid_json"),
    ("lone surrogate", b'{"prompt": "a\\ud800b"}', JSON, 400, "invalid_value"),
    ("lone surrogate in a message", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', JSON, 400,
     "invalid_value"),
    ("arrays 10,000 deep", b"[" * DEEP + b"]" * DEEP, JSON, 400, "invalid_json"),
    ("objects 10,000 deep", b'{"a":' * DEEP + b"1" + b"}" * DEEP, JSON, 400, "invalid_json"),
    ("a prompt 10,000 deep", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", JSON, 400, "invalid_json"),
    ("a prompt 40 deep", b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", JSON, 400, "invalid_json"),
    ("max_tokens as a string", b'{"prompt": "a", "max_tokens": "10"}', JSON, 400, "invalid_type"),
    ("n as a string", b'{"prompt": "a", "n": "2"}', JSON, 400, "invalid_type"),
    ("temperature as a string", b'{"prompt": "a", "temperature": "0.5"}', JSON, 400, "invalid_type"),
    ("seed as a string", b'{"prompt": "a", "seed": "1"}', JSON, 400, "invalid_type"),
    ("steps as a string", b'{"prompt": "a", "diffusion": {"steps": "2"}}', JSON, 400, "invalid_type"),
    ("ids as strings", b'{"prompt": ["1", "2"]}', JSON, 400, None),
    ("huge max_tokens", b'{"prompt": "a", "max_tokens": 1' + b"0" * 30 + b"}", JSON, 400, "invalid_value"),
    ("huge n", b'{"prompt": "a", "n": 1' + b"0" * 100 + b"}", JSON, 400, "invalid_value"),
    ("huge seed", b'{"prompt": "a", "seed": 1' + b"0" * 25 + b"}", JSON, 400, "invalid_value"),
    ("huge negative seed", b'{"prompt": "a", "seed": -1' + b"0" * 25 + b"}", JSON, 400, "invalid_value"),
    ("top_k past int32", b'{"prompt": "a", "diffusion": {"top_k": 4294967296}}', JSON, 400, "invalid_value"),
    ("huge token id", b'{"prompt": [1' + b"0" * 30 + b"]}", JSON, 400, "invalid_value"),
    ("5000-digit integer", b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", JSON, 400, "invalid_json"),
    ("huge integer temperature", b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}", JSON, 400,
     "invalid_value"),
    ("1e400 temperature", b'{"prompt": "a", "temperature": 1e400}', JSON, 400, "invalid_value"),
    ("NaN", b'{"prompt": "a", "temperature": NaN}', JSON, 400, "invalid_json"),
    ("Infinity", b'{"prompt": "a", "top_p": Infinity}', JSON, 400, "invalid_json"),
    ("-Infinity", b'{"prompt": "a", "diffusion": {"threshold": -Infinity}}', JSON, 400, "invalid_json"),
    ("top_p underflowing to 0", b'{"prompt": "a", "top_p": 1e-400}', JSON, 400, "invalid_value"),
    ("an empty body", b"", JSON, 400, "invalid_json"),
    ("whitespace", b" \n\t ", JSON, 400, "invalid_json"),
    ("a JSON array", b"[1, 2]", JSON, 400, "invalid_json"),
    ("JSON null", b"null", JSON, 400, "invalid_json"),
    ("a NUL byte", b'{"prompt": "a"}\x00', JSON, 400, "invalid_json"),
    ("truncated", b'{"prompt": "a", "max_tok', JSON, 400, "invalid_json"),
    ("no content type", b'{"prompt": "a"}', {}, 415, "unsupported_media_type"),
    ("text/plain", b'{"prompt": "a"}', {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ("a form", b"prompt=a", {"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
    ("multipart", b"--b\r\n\r\na\r\n--b--\r\n", {"content-type": "multipart/form-data; boundary=b"}, 415,
     "unsupported_media_type"),
    ("a bad Content-Length", b'{"prompt": "a"}', {**JSON, "content-length": "1x"}, 400, None),
]


@pytest.mark.parametrize(("what", "raw", "headers", "status", "code"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies(client, engine, what, raw, headers, status, code):
    generic = code in ("invalid_json", "unsupported_media_type") or status != 400  # the same on both endpoints
    paths = ["/v1/completions", "/v1/chat/completions"] if generic else \
        ["/v1/chat/completions" if b'"messages"' in raw else "/v1/completions"]
    for path in paths:
        error_of(client.post(path, content=raw, headers=headers), status, code)
    assert engine.submitted == []
    ok = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 6})
    assert ok.json()["choices"][0]["text"] == "abcdab"


def test_integers_written_as_floats_and_json_media_types(client, engine):
    r = client.post("/v1/completions", content=b'{"prompt": [97.0, 98], "max_tokens": 4.0, "n": 2.0, "seed": 7.0}',
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and [ch["text"] for ch in r.json()["choices"]] == [TOK.decode([97, 98] * 2)] * 2
    assert engine.submitted[0].max_tokens == 4 and [q.sampling.seed for q in engine.submitted] == [7, 8]
    error_of(client.post("/v1/completions", json={"prompt": "a", "seed": 1.5}), 400, "invalid_type")
    r = client.post("/v1/completions", content=b'{"prompt": "ab", "max_tokens": 2}',
                    headers={"content-type": "application/vnd.api+json"})
    assert r.status_code == 200


def test_a_thousand_connections_opened_and_dropped(engine):
    """1,000 connections to 127.0.0.1 open at once (silent, half a request line, headers and half a body,
    a whole streaming request), then all dropped, half of them with a reset: the server answers at once, no
    row or queue place stays taken, and the next client gets its completion."""
    engine.delay = 0.01
    request = json.dumps({"prompt": "abcd", "max_tokens": 64, "stream": True}).encode()
    with live(make_app(engine, TOK, MODEL)) as url:
        port = int(url.rsplit(":", 1)[1])
        socks: list[socket.socket] = []
        try:
            for i in range(1000):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                socks.append(s)
                kind = i % 4
                if kind == 1:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
                elif kind == 2:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
                elif kind == 3:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
            assert len(socks) == 1000
        finally:
            for i, s in enumerate(socks):
                if i % 2:  # a reset instead of a close
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").json() == {"status": "ok"}

            def idle() -> bool:
                text = c.get("/metrics").text
                return all(metric(text, m) == 0 for m in ("clover_active_rows", "clover_queue_depth",
                                                          "clover_generations_in_flight"))

            # the dropped streams free their rows and queue places as the server notices each hang-up (under
            # load that can outlast a request sent at once, which would then meet a full queue: a 429)
            _wait(idle, 30)
            r = c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 8})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abcdabcd", (r.status_code, r.text)
            _wait(idle, 30)
    assert all(reason in ("cancelled", "length") for reason in engine.finished.values())


# --- fuzzing ----------------------------------------------------------------------------------------

def test_schemathesis_over_the_servers_own_openapi(engine):
    """Positive and negative cases generated from /openapi.json (the request bodies included), with a key:
    no 5xx, statuses / content types / bodies / SSE events as documented, schema-invalid bodies refused,
    requests without the key refused (positive_data_acceptance is left out: a schema cannot say that a
    prompt is too long once tokenized). Then a normal request is answered correctly."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.checks import positive_data_acceptance

    app = make_app(engine, TOK, MODEL, api_keys=[KEY])
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    doc = app.openapi()
    assert doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 64
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    for mode, examples in ((schemathesis.GenerationMode.POSITIVE, 120), (schemathesis.GenerationMode.NEGATIVE, 120)):
        @fuzz(examples)
        @given(case=schema.as_strategy(mode))
        def check(case: Any) -> None:
            case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance])

        check()
    with TestClient(app) as c:
        assert post(c, {"prompt": "abcd", "max_tokens": 5}).json()["choices"][0]["text"] == "abcda"


def text(max_size: int) -> st.SearchStrategy[str]:
    """Any str JSON can carry, lone surrogates included (JSON's \\ud800 escapes)."""
    odd = st.sampled_from(["\ud800", "\udfff", "\x00", "\n", "\"", "\\", "\u00e9", "\uffff", "\U0001f600"])
    # joined from a list: st.text folds its alphabet into code point ranges that leave the surrogates out
    return st.lists(st.characters() | odd, max_size=max_size).map("".join)


def json_values(max_leaves: int = 10) -> st.SearchStrategy[Any]:
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**40), max_value=10**40)
               | st.floats() | text(12))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=max_leaves)


ANY = json_values()
PLAUSIBLE = {
    "model": st.just(MODEL) | ANY,
    "prompt": text(70) | st.lists(st.integers(-3, 300), max_size=70) | st.lists(st.text(max_size=5),
                                                                                         max_size=2) | ANY,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", ""]) | ANY},
                                               optional={"content": text(20) | ANY}), max_size=3) | ANY,
    "max_tokens": st.integers(-2, 70) | ANY,
    "max_completion_tokens": st.integers(-2, 70) | ANY,
    "temperature": st.floats(-1, 3) | ANY,
    "top_p": st.floats(-0.5, 1.5) | ANY,
    "n": st.integers(-1, 10) | ANY,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | ANY,
    "seed": st.integers() | ANY,
    "stream": st.booleans() | ANY,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | ANY}) | ANY,
    "diffusion": st.fixed_dictionaries({}, optional={
        "steps": st.integers(-1, 6) | ANY, "block_length": st.integers(0, 8) | ANY,
        "threshold": st.floats(-1, 2) | ANY, "remasking": st.sampled_from(["low_confidence", "random", "x"]) | ANY,
        "cache": st.sampled_from(["auto", "prefix", "none"]) | ANY, "top_k": st.integers(-1, 2**40) | ANY}) | ANY,
}
BODIES = st.fixed_dictionaries({}, optional=PLAUSIBLE) | st.dictionaries(st.text(max_size=8), ANY, max_size=5) | ANY


@fuzz(400)
@given(body=BODIES, chat=st.booleans())
def test_the_parser_raises_only_request_errors(body, chat):
    engine = FakeEngine()  # not started: parsing only
    if not isinstance(body, dict):
        return
    try:
        prompt, thinking, keep = chat_prompt(body, TOK, 3) if chat else (completion_prompt(body, TOK), False, 0)
        job = parse_job(body, engine, prompt, chat, {"temperature": 0.5}, max_n=4, thinking=thinking, keep=keep)
    except (ApiError, ServingError) as e:
        assert str(e)
        return
    assert 1 <= len(job.requests) <= 4
    for req in job.requests:
        req.check(engine.block_length, engine.cache, engine.cfg.vocab_size, engine.max_prompt, engine.max_tokens)
        assert 0 <= req.keep < len(req.prompt) and (req.keep == 0 or chat)  # a chat's conversation, never all of it


def _check_answer(r: httpx.Response, allowed: set[int]) -> None:
    assert r.status_code in allowed, r.text
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = sse(r)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    elif r.status_code == 200:
        assert r.json()["choices"]
    else:
        error_of(r, r.status_code)


def test_any_body_gets_an_answer_and_no_5xx(engine):
    app = make_app(engine, TOK, MODEL)
    with TestClient(app) as c:
        @fuzz(150)
        @given(body=BODIES, chat=st.booleans())
        def json_bodies(body: Any, chat: bool) -> None:
            raw = json.dumps(body, allow_nan=True).encode()
            r = c.post("/v1/chat/completions" if chat else "/v1/completions", content=raw, headers=JSON)
            _check_answer(r, {200, 400, 404, 429})

        @fuzz(100)
        @given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode), chat=st.booleans(),
               ctype=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
        def raw_bodies(raw: bytes, chat: bool, ctype: str) -> None:
            headers = {"content-type": ctype} if ctype else {}
            r = c.post("/v1/chat/completions" if chat else "/v1/completions", content=raw, headers=headers)
            _check_answer(r, {200, 400, 404, 415, 429})

        json_bodies()
        raw_bodies()
        assert c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 6}).json()["choices"][0]["text"] \
            == "abcdab"
        _wait(lambda: engine.stats().active_rows == 0 and engine.stats().queue_depth == 0)
        text = c.get("/metrics").text
        assert metric(text, "clover_generations_in_flight") == 0
        assert not re.search(r'status="5\d\d"', text)

        set_draining(app)  # now the deliberate 503, and only that

        @fuzz(60)
        @given(body=BODIES, chat=st.booleans())
        def draining(body: Any, chat: bool) -> None:
            raw = json.dumps(body, allow_nan=True).encode()
            r = c.post("/v1/chat/completions" if chat else "/v1/completions", content=raw, headers=JSON)
            assert error_of(r, 503)["code"] == "draining"

        draining()
        assert c.get("/health").status_code == 503 and c.get("/v1/models").status_code == 200
        set_draining(app, False)
        assert c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 4}).json()["choices"][0]["text"] \
            == "abcd"


# --- access lines -----------------------------------------------------------------------------------

def test_one_access_line_per_request(keyed, caplog):
    caplog.set_level(logging.INFO, logger=logs.ACCESS_LOGGER)
    r1 = post(keyed, {"prompt": "abcd", "max_tokens": 8}, **{"X-Request-Id": "client-id_1.2:3"})
    r2 = post(keyed, {"prompt": "abcd", "max_tokens": 8, "stream": True, "n": 2}, **{"X-Request-Id": "bad id"})
    r3 = post(keyed, {"prompt": "abcd", "max_tokens": "x"}, **{"X-Request-Id": "x" * 129})
    r4 = keyed.get("/v1/models")
    r5 = keyed.get("/v1/models/nope%0Ainjected", headers=AUTH)
    assert r1.headers["x-request-id"] == "client-id_1.2:3"
    for r in (r2, r3, r4, r5):
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    lines = [rec.access for rec in caplog.records if rec.name == logs.ACCESS_LOGGER]
    assert [a["request_id"] for a in lines] == [r.headers["x-request-id"] for r in (r1, r2, r3, r4, r5)]
    a1, a2, a3, a4, a5 = lines
    assert (a1["method"], a1["path"], a1["status"], a1["tokens_in"], a1["tokens_out"]) == \
        ("POST", "/v1/completions", 200, 4, 8)
    assert a1["passes"] == 8 and a1["finish"] == "length" and a1["error"] is None  # 2 blocks of 4 steps
    assert isinstance(a1["queue_s"], float) and a1["run_s"] >= 0 and a1["client"].startswith("testclient")
    assert (a2["status"], a2["tokens_out"], a2["finish"]) == (200, 16, "length,length")
    assert (a3["status"], a3["error"], a3["tokens_in"]) == (400, "invalid_type", None)
    assert (a4["status"], a4["error"]) == (401, "invalid_api_key")
    assert (a5["status"], a5["path"]) == (404, "/v1/models/nope%0Ainjected")
    text = logs.TextFormatter().format([rec for rec in caplog.records if rec.name == logs.ACCESS_LOGGER][-1])
    assert "\n" not in text and text.startswith("clover serve: access request_id=")


def test_a_client_gone_mid_body_is_an_access_line_not_an_error(engine, caplog):
    """A client that sends its headers and half its body, then hangs up: one access line (status 499,
    `client_disconnected`), no error logged with a traceback, and the engine never saw a request."""
    caplog.set_level(logging.INFO)
    with live(make_app(engine, TOK, MODEL)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            time.sleep(0.2)  # the body read is under way
        _wait(lambda: any(rec.name == logs.ACCESS_LOGGER for rec in caplog.records), 30)
    access = [rec.access for rec in caplog.records if rec.name == logs.ACCESS_LOGGER]
    assert [(a["path"], a["status"], a["error"]) for a in access] == [("/v1/completions", 499, "client_disconnected")]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
    assert not engine.rids  # nothing was submitted


def test_log_formats_are_parseable():
    fields = {"request_id": "r1", "method": "POST", "path": "/v1/x y\n\"=\\", "status": 200, "tokens_in": 3,
              "tokens_cached": 2, "tokens_out": None, "passes": 7, "queue_s": 0.25, "run_s": 1.5, "finish": "stop",
              "error": None, "client": "127.0.0.1:5"}
    record = logging.LogRecord(logs.ACCESS_LOGGER, logging.INFO, __file__, 1, "access", None, None)
    record.access = fields
    text = logs.TextFormatter().format(record)
    assert text.startswith("clover serve: access ") and "\n" not in text
    parsed = dict(part.split("=", 1) for part in text.removeprefix("clover serve: access ").split(" "))
    assert list(parsed) == list(logs.ACCESS_FIELDS)
    assert parsed["path"] == "/v1/x\\x20y\\x0a\\x22\\x3d\\x5c" and parsed["tokens_out"] == "-"
    assert parsed["queue_s"] == "0.250" and parsed["status"] == "200"
    obj = json.loads(logs.JsonFormatter().format(record))
    assert obj["event"] == "access" and {k: obj[k] for k in logs.ACCESS_FIELDS} == fields
    plain = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, "a\nb %s", ("c",), None)
    assert json.loads(logs.JsonFormatter().format(plain))["message"] == "a\nb c"
    assert logs.TextFormatter().format(plain) == "clover serve: warning: a\nb c"


def test_serve_command_keys_deadline_and_json_logs(tmp_path):
    """`clover serve` (the fake engine, in a subprocess) with a key file, $CLOVER_API_KEY,
    --request-timeout and --log-format json: every stderr line is a JSON object, each request has its
    access line, and no key appears anywhere in the output."""
    keyfile = tmp_path / "keys"
    keyfile.write_text("# keys\nfile-key-abcdefgh\n")
    keyfile.chmod(0o600)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_serve_api as t; t.install_fake_engine(0.2); "
            "from clover_jax import cli; sys.exit(cli.main(['serve', '--port', '0', '--block-length', '4', "
            f"'--log-format', 'json', '--api-key-file', {str(keyfile)!r}, '--request-timeout', '0.7']))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CLOVER_API_KEY": "env-key-12345678"}
    proc = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        while not any("listening on" in s for s in seen):
            seen.append(lines.get(timeout=120))
        url = re.search(r"listening on (http://[0-9.:]+)", seen[-1]).group(1)
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").status_code == 401
            for key in ("file-key-abcdefgh", "env-key-12345678"):
                assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            r = c.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 64},
                       headers={"Authorization": "Bearer env-key-12345678", "X-Request-Id": "trace-42"})
            assert r.headers["x-request-id"] == "trace-42" and "server" not in r.headers
            body = r.json()
            assert body["timed_out"] is True and body["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get())
    objects = [json.loads(s) for s in seen]  # every line is one JSON object
    access = [o for o in objects if o.get("event") == "access"]
    assert [(a["path"], a["status"]) for a in access] == [("/health", 200), ("/v1/models", 401), ("/v1/models", 200),
                                                          ("/v1/models", 200), ("/v1/completions", 200)]
    last = access[-1]
    assert last["request_id"] == "trace-42" and last["finish"] == "length" and 0 < last["tokens_out"] < 64
    assert any(o["message"] == "drained, exiting" for o in objects)
    assert not any(k in "".join(seen) for k in ("file-key-abcdefgh", "env-key-12345678"))
