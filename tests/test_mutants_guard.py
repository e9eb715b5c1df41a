"""`clover serve`'s door (`clover_jax.serving.guard.Guard`) driven as ASGI, without the app behind it: request ids,
API keys, the body limit (Content-Length and counted chunks), the answers it gives itself and the access line of every
request. Written for the mutation run (`bash scripts/mutation.sh guard`; docs/testing.md, "Mutation score"); the
same behaviours through the whole app are tests/test_serve_security.py's."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import pytest

from clover_jax.serving import logs
from clover_jax.serving.guard import Access, BodyTooLarge, Guard, KeyRing, access_of

KEYS = KeyRing(["key-one-123", "key-two-456"])
NO_KEYS = KeyRing([])
MISSING = "this server needs an API key: send it as 'Authorization: Bearer <key>'"
INVALID = ("the API key is not valid (send 'Authorization: Bearer <key>' with a key this server was started with)")
TOO_LARGE = "the request body is larger than this server's limit of 100 bytes"


class Echo:
    """The app behind the guard: reads the whole body, answers 200 with its length; remembers what it saw."""

    def __init__(self, start_first: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.start_first = start_first

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            self.calls.append({"scope": scope, "receive": receive})
            return
        if self.start_first:  # a streaming answer: the response starts before the body is read
            await send({"type": "http.response.start", "status": 200, "headers": []})
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append({"scope": scope, "body": body, "access": access_of(scope)})
        if not self.start_first:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-app", b"1")]})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})


class Answer:
    def __init__(self, sent: list[dict[str, Any]]) -> None:
        self.status = sent[0]["status"]
        self.headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
        self.body = b"".join(m.get("body", b"") for m in sent[1:])
        self.complete = sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)

    def error(self) -> dict[str, Any]:
        assert self.complete  # the answer ends: a client is not left waiting for more
        assert self.headers["content-type"] == "application/json"
        assert int(self.headers["content-length"]) == len(self.body)
        return json.loads(self.body)["error"]


def request(app: Any, *, keys: KeyRing = NO_KEYS, limit: int = 100, method: str = "POST",
            path: str = "/v1/completions", raw_path: Any = "same", headers: dict[str, str] | None = None,
            chunks: tuple[bytes | None, ...] = (b"",), client: Any = ("10.0.0.7", 5123)) -> Answer:
    """Guard(app) answering one HTTP request whose body arrives in `chunks` (None: a message without a body)."""
    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "query_string": b"",
                             "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}
    if raw_path is not None:
        scope["raw_path"] = path.encode() if raw_path == "same" else raw_path
    if client is not None:
        scope["client"] = client
    pending = list(chunks)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not pending:
            return {"type": "http.disconnect"}
        body = pending.pop(0)
        return {"type": "http.request", "more_body": bool(pending)} | ({} if body is None else {"body": body})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(Guard(app, keys, limit)(scope, receive, send))
    return Answer(sent)


class Lines:
    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    def all(self) -> list[dict[str, Any]]:
        """The access lines logged so far (their fields)."""
        return [r.access for r in self.caplog.records if r.name == logs.ACCESS_LOGGER]


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Lines:
    caplog.set_level(logging.INFO, logger=logs.ACCESS_LOGGER)
    return Lines(caplog)


# --- request ids and the headers of every answer --------------------------------------------------------------

@pytest.mark.parametrize(("given", "kept"), [
    ("client-id_1.2:3", True), ("x" * 128, True), ("A", True),
    ("x" * 129, False), ("bad id", False), ("", False), ("id\n", False), ("naïve", False),
])
def test_a_well_formed_request_id_comes_back(given, kept, access):
    app = Echo()
    r = request(app, headers={"X-Request-Id": given})
    rid = r.headers["x-request-id"]
    assert (rid == given) if kept else re.fullmatch(r"[0-9a-f]{32}", rid)
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-app"] == "1"
    assert access.all()[0]["request_id"] == rid == app.calls[0]["access"].request_id


def test_fresh_ids_differ():
    assert request(Echo()).headers["x-request-id"] != request(Echo()).headers["x-request-id"]


def test_the_access_line_of_a_request(access):
    app = Echo()
    r = request(app, path="/v1/completions", headers={"content-length": "5"}, chunks=(b"ab", b"cde"))
    assert r.status == 200 and r.body == b"5" and app.calls[0]["body"] == b"abcde"
    (line,) = access.all()
    assert line["request_id"] == r.headers["x-request-id"] and line["method"] == "POST"
    assert (line["path"], line["status"], line["client"], line["error"]) == ("/v1/completions", 200, "10.0.0.7:5123",
                                                                           None)
    assert line["run_s"] >= 0 and set(line) == set(logs.ACCESS_FIELDS)
    assert app.calls[0]["access"].path == "/v1/completions"


@pytest.mark.parametrize(("path", "raw_path", "logged"), [
    ("/v1/models/a\nb", b"/v1/models/a%0Ab", "/v1/models/a%0Ab"),  # as sent: no line breaks in the log
    ("/v1/models", b"/v1/models?x=1?y=2", "/v1/models"),  # a server that leaves the query in raw_path
    ("/v1/models", bytearray(b"/v1/models"), "/v1/models"),
    ("/v1/models?y", None, "/v1/models"),
])
def test_the_logged_path_is_the_raw_one_without_the_query(path, raw_path, logged, access):
    request(Echo(), method="GET", path=path, raw_path=raw_path)
    assert access.all()[0]["path"] == logged


def test_a_request_without_a_client_address(access):
    request(Echo(), client=None)
    assert access.all()[0]["client"] is None


def test_access_fields_time_taken_less_the_queue():
    a = Access("r", "GET", "/", None, started=100.0)
    assert a.fields(now=101.5)["run_s"] == 1.5 and a.fields(now=101.5)["queue_s"] is None
    a.queue_s = 0.123456
    f = a.fields(now=101.0)
    assert f["queue_s"] == 0.1235 and f["run_s"] == 0.8765
    a.queue_s = 2.0  # a clock that says less than the queue: never negative
    assert a.fields(now=101.0)["run_s"] == 0.0
    a.tokens_in, a.tokens_out, a.passes, a.finish, a.status = 4, 8, 2, "stop", 200
    assert {k: v for k, v in a.fields(now=101.0).items() if k in ("tokens_in", "tokens_out", "passes", "finish",
                                                                 "status")} == \
        {"tokens_in": 4, "tokens_out": 8, "passes": 2, "finish": "stop", "status": 200}
    assert access_of({}) is None


def test_non_http_scopes_pass_straight_through(access):
    app = Echo()
    marker = object()

    async def receive() -> Any:
        return marker

    asyncio.run(Guard(app, KEYS, 100)({"type": "lifespan"}, receive, None))
    assert app.calls[0]["receive"] is receive and access.all() == []


# --- API keys ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("authorization", ["Bearer key-one-123", "bearer key-two-456", "BEARER key-one-123",
                                           "  Bearer key-one-123  ", "Bearer   key-one-123"])
def test_a_configured_key_is_accepted(authorization):
    app = Echo()
    assert request(app, keys=KEYS, headers={"Authorization": authorization}).status == 200 and app.calls


@pytest.mark.parametrize(("headers", "message", "close"), [
    ({}, MISSING, False),
    ({"Authorization": "Bearer key-one-1234"}, INVALID, False),
    ({"Authorization": "Basic key-one-123"}, INVALID, False),
    ({"Authorization": "key-one-123"}, INVALID, False),
    ({"Authorization": "Bearer"}, INVALID, False),
    ({"Authorization": ""}, INVALID, False),
    ({"content-length": "12"}, MISSING, True),  # a request with a body: the connection closes
    ({"content-length": "0"}, MISSING, False),
    ({"transfer-encoding": "chunked"}, MISSING, True),
    ({"content-length": "abc"}, MISSING, True),  # the key is checked first
])
def test_without_a_valid_key_401(headers, message, close, access):
    app = Echo()
    r = request(app, keys=KEYS, headers=headers)
    err = r.error()
    assert r.status == 401 and err == {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "invalid_api_key"}
    assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-content-type-options"] == "nosniff"
    assert r.headers.get("connection") == ("close" if close else None)
    assert app.calls == [] and "key-one" not in r.body.decode()
    (line,) = access.all()
    assert (line["status"], line["error"]) == (401, "invalid_api_key")


def test_health_needs_no_key_and_no_keys_need_none():
    assert request(Echo(), keys=KEYS, method="GET", path="/health").status == 200
    assert request(Echo(), keys=KEYS, method="GET", path="/health", raw_path=b"/health?probe=1?x").status == 200
    assert request(Echo(), keys=KEYS, method="GET", path="/healthz").status == 401
    assert request(Echo(), method="GET", path="/v1/models").status == 200  # no keys configured


def test_the_key_ring():
    assert not KeyRing([]) and KEYS and repr(KEYS) == "KeyRing(2 keys)"
    assert KEYS.accepts(b"Bearer key-two-456") and not KEYS.accepts(None) and not KEYS.accepts(b"")
    assert not KEYS.accepts(b"Bearer key-two-45") and not KEYS.accepts(b"Bearerkey-two-456")


# --- the body limit ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", ["abc", "-1", "1e3", "12 34"])
def test_a_content_length_that_is_no_number_400(length, access):
    app = Echo()
    r = request(app, headers={"content-length": length})
    assert r.status == 400 and r.error() == {"message": "the Content-Length header is not a number",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "invalid_content_length"}
    assert r.headers["connection"] == "close" and app.calls == []
    assert (access.all()[0]["status"], access.all()[0]["error"]) == (400, "invalid_content_length")


def test_a_content_length_over_the_limit_413_before_reading(access):
    app = Echo()
    r = request(app, headers={"content-length": "101"}, chunks=(b"x" * 101,))
    assert r.status == 413 and r.error() == {"message": TOO_LARGE, "type": "invalid_request_error", "param": None,
                                             "code": "body_too_large"}
    assert r.headers["connection"] == "close" and app.calls == []
    assert (access.all()[0]["status"], access.all()[0]["error"]) == (413, "body_too_large")
    assert request(Echo(), headers={"content-length": " 100 "}, chunks=(b"x" * 100,)).status == 200  # the limit


def test_a_chunked_body_is_counted_as_it_arrives(access):
    app = Echo()
    r = request(app, headers={"transfer-encoding": "chunked"}, chunks=(b"x" * 60, b"x" * 40))
    assert r.status == 200 and r.body == b"100"
    r = request(app, headers={"transfer-encoding": "chunked"}, chunks=(b"x" * 60, b"x" * 41))
    assert r.status == 413 and r.error() == {"message": TOO_LARGE, "type": "invalid_request_error", "param": None,
                                             "code": "body_too_large"}
    assert r.headers["connection"] == "close" and r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-request-id"] == access.all()[1]["request_id"]
    assert len(app.calls) == 1 and (access.all()[1]["status"], access.all()[1]["error"]) == (413, "body_too_large")


def test_a_message_without_body_bytes_counts_none():
    r = request(Echo(), headers={"transfer-encoding": "chunked"}, chunks=(b"x" * 98, None, b"yy"))
    assert r.status == 200 and r.body == b"100"


def test_an_empty_content_length_with_spaces_is_no_body():
    r = request(Echo(), keys=KEYS, headers={"content-length": " 0 "})
    assert r.status == 401 and "connection" not in r.headers


def test_a_body_too_large_after_the_answer_started_is_the_apps(access):
    app = Echo(start_first=True)
    with pytest.raises(BodyTooLarge) as e:
        request(app, chunks=(b"x" * 101,))
    assert e.value.limit == 100 and str(e.value) == TOO_LARGE
    (line,) = access.all()  # still one access line
    assert line["status"] == 200 and line["error"] is None
