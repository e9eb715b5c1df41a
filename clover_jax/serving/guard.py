"""The door of `clover serve`'s HTTP app: request ids, API keys, the body size limit, access lines.

`Guard` is ASGI middleware in front of every route. Per HTTP request, in this order:

  1. a request id: the client's `X-Request-Id` when well-formed (`REQUEST_ID`: 1-128 of letters,
     digits and `._:-`), else a fresh 32-hex one; every response carries it back as `X-Request-Id`
     (and `X-Content-Type-Options: nosniff`);
  2. with API keys configured, every path but `/health` needs `Authorization: Bearer <key>`: the
     presented key's SHA-256 is compared with every configured key's by `hmac.compare_digest` (all of
     them, always: the time does not tell which key matched, or how much of one); otherwise 401 with
     an OpenAI error object (code "invalid_api_key") and `WWW-Authenticate: Bearer`. Nothing of the
     presented key is echoed or logged;
  3. a body over `max_body_bytes` is answered 413 before anything reads it: at once when
     Content-Length says so, else when the bytes received (a chunked body) pass the limit
     (`BodyTooLarge` raised from `receive`; the app turns it into the 413, or Guard does when the
     app did not answer yet). Early refusals of a request with a body close the connection;
  4. once the response is sent (a stream: its last byte), one access line (`logs.log_access`) with
     the fields the handler filled into `Access` (tokens, passes, queue time, finish reasons).

`Access` travels to the handlers in `scope["clover.access"]` (`access_of`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clover_jax.serving.logs import log_access

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
OPEN_PATHS = ("/health",)  # answered without an API key (load balancers probe it)
SCOPE_KEY = "clover.access"


class BodyTooLarge(Exception):
    """The request body passed the server's limit (raised from the wrapped `receive`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes")
        self.limit = limit


@dataclass
class Access:
    """What one access line says; Guard fills the HTTP side, the generation handlers the rest."""

    request_id: str
    method: str
    path: str
    client: str | None
    started: float = field(default_factory=time.monotonic)
    status: int | None = None
    tokens_in: int | None = None
    tokens_cached: int | None = None  # of tokens_in, those the prefix cache gave (not prefilled again)
    tokens_out: int | None = None
    passes: int | None = None
    queue_s: float | None = None
    finish: str | None = None  # the choices' finish reasons, comma-separated ("length,stop")
    error: str | None = None  # the error code of an error answer (or of a stream's error event)

    def fields(self, now: float | None = None) -> dict[str, Any]:
        """The access line's fields (`logs.ACCESS_FIELDS`); run_s is the time taken less the queue's."""
        total = (time.monotonic() if now is None else now) - self.started
        return {"request_id": self.request_id, "method": self.method, "path": self.path, "status": self.status,
                "tokens_in": self.tokens_in, "tokens_cached": self.tokens_cached, "tokens_out": self.tokens_out,
                "passes": self.passes,
                "queue_s": None if self.queue_s is None else round(self.queue_s, 4),
                "run_s": round(max(total - (self.queue_s or 0.0), 0.0), 4), "finish": self.finish,
                "error": self.error, "client": self.client}


def access_of(scope: Scope) -> Access | None:
    """The request's Access record (None outside Guard, e.g. in a bare test app)."""
    return scope.get(SCOPE_KEY)


class KeyRing:
    """The API keys a server accepts; `accepts` is constant-time in what the client presented."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"KeyRing({len(self._digests)} keys)"

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether an `Authorization` header value is `Bearer <one of the keys>`. Every key is compared
        (hmac.compare_digest over SHA-256 digests of equal length), whichever matches."""
        if not authorization:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        match = False
        for known in self._digests:
            match |= hmac.compare_digest(digest, known)
        return match and scheme.lower() == b"bearer"


def _error_body(message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


def _client(scope: Scope) -> str | None:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


def _path(scope: Scope) -> str:
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes | bytearray) else scope.get("path", "")
    return path.split("?", 1)[0]


class Guard:
    """ASGI middleware: see the module docstring. `keys` empty: no API key needed."""

    def __init__(self, app: ASGIApp, keys: KeyRing, max_body_bytes: int) -> None:
        self.app, self.keys, self.max_body = app, keys, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        given_s = given.decode("latin-1") if given is not None else ""
        rid = given_s if REQUEST_ID.fullmatch(given_s) else uuid.uuid4().hex
        access = Access(rid, str(scope.get("method", "")), _path(scope), _client(scope))
        scope[SCOPE_KEY] = access
        started = False

        async def send_tagged(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                access.status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["X-Request-Id"] = rid
                headers["X-Content-Type-Options"] = "nosniff"
            await send(message)

        try:
            refusal = self._refusal(scope, access)
            if refusal is not None:
                await self._answer(send_tagged, *refusal)
                return
            try:
                await self.app(scope, self._counting(receive), send_tagged)
            except BodyTooLarge as e:
                if started:
                    raise
                access.error = "body_too_large"
                await self._answer(send_tagged, 413, _error_body(str(e), "invalid_request_error",
                                                                 "body_too_large"), {"Connection": "close"})
        finally:
            log_access(access.fields())

    def _refusal(self, scope: Scope, access: Access) -> tuple[int, bytes, dict[str, str]] | None:
        """(status, body, headers) of a request refused before the app sees it, or None."""
        length = _header(scope, b"content-length")
        has_body = bool(length and length.strip() != b"0") or _header(scope, b"transfer-encoding") is not None
        close = {"Connection": "close"} if has_body else {}
        if self.keys and access.path not in OPEN_PATHS and not self.keys.accepts(_header(scope, b"authorization")):
            missing = _header(scope, b"authorization") is None
            message = ("this server needs an API key: send it as 'Authorization: Bearer <key>'" if missing else
                       "the API key is not valid (send 'Authorization: Bearer <key>' with a key this server "
                       "was started with)")
            access.error = "invalid_api_key"
            return 401, _error_body(message, "invalid_request_error", "invalid_api_key"), \
                {"WWW-Authenticate": "Bearer", **close}
        if length is not None:
            text = length.strip()
            if not text.isdigit():
                access.error = "invalid_content_length"
                return 400, _error_body("the Content-Length header is not a number", "invalid_request_error",
                                        "invalid_content_length"), {"Connection": "close"}
            if int(text) > self.max_body:
                access.error = "body_too_large"
                message = str(BodyTooLarge(self.max_body))
                return 413, _error_body(message, "invalid_request_error", "body_too_large"), \
                    {"Connection": "close"}
        return None

    async def _answer(self, send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _counting(self, receive: Receive) -> Receive:
        """`receive`, raising BodyTooLarge once the body's bytes pass the limit."""
        seen = 0
        limit = self.max_body

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return counted
