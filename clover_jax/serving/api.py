"""The HTTP face of `clover serve`: an OpenAI-compatible API over a batching engine.

    GET  /health               {"status": "ok"} (503 {"status": "draining"} once shutdown began)
    GET  /v1/models            the one model, OpenAI list format (GET /v1/models/{id}: that model, or 404)
    POST /v1/completions       prompt: a string, a list of one string, or a list of token ids
    POST /v1/chat/completions  messages, rendered by `clover_jax.serving.chat`
    GET  /metrics              Prometheus text (`clover_jax.serving.metrics`)
    GET  /openapi.json         the OpenAPI document (`clover_jax.serving.schema`): request bodies included

Every request passes `clover_jax.serving.guard.Guard`: API keys (`Authorization: Bearer`, on every route
but /health, 401 otherwise), the body size limit (413, before the body is read), a request id (`X-Request-Id`, the
client's when well-formed) and one access line per request (`clover_jax.serving.logs`). Bodies must
be `Content-Type: application/json` (415 otherwise: a browser cannot send that cross-origin without a
CORS preflight, which this server never grants), at most `MAX_DEPTH` levels deep, without NaN or
Infinity.

Generation fields: max_tokens (default min(128, the server's limit); more than the limit is a 400,
nothing is clipped), temperature (default 0 = greedy), top_p, stop (a string or up to 4), seed, n
(1..`Limits.max_n` choices, each served by its own engine row and queue place, seeds seed, seed+1, ...;
without a seed: random ones when temperature > 0, else 0; more than max_n is a 400 naming the limit),
stream (+ stream_options.include_usage), and the extension object
`"diffusion": {"steps", "block_length", "threshold", "remasking", "cache", "top_k"}`. Unknown
top-level fields are ignored (OpenAI clients send extras); a known field of the wrong type, an
unknown `diffusion` field, or a setting the engine refuses is a 400 naming it. /v1/chat/completions
takes at most `Limits.max_messages` messages.

Deadline (`Limits.request_timeout_s`, from arrival): a request still generating when it passes has
every unfinished choice ended with finish_reason "length" (the text generated so far, as when
max_tokens runs out: what OpenAI clients read as "cut short") and the response object (or, streamed,
the final chunk of each such choice) carries the extension field `"timed_out": true`; its engine rows
are cancelled, so they free at the next block boundary (a request still queued leaves the queue at
once). No error status: the OpenAI clients retry 408 and 5xx answers, which would send the same
too-long request again.

Each choice is one engine `Request`. The engine calls back from its own thread once per committed
block; `loop.call_soon_threadsafe` moves each `Event` onto the request's asyncio queue. Text is
decoded host-side from all of a choice's tokens; stop strings are matched there too (the engine is
then told to cancel the row), and a stream holds back the last `len(longest stop) - 1` characters
(and a trailing U+FFFD that may be half a UTF-8 character) until the next block, so a stop string
spanning two blocks never leaks. A client that disconnects has all its choices cancelled.

Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}: 400 bad JSON, types
or settings; 401 no or a wrong API key; 404 an unknown model (or route); 413 a body over the limit; 415
not JSON; 429 the engine's queue is full; 503 draining; 500 a
choice the engine ended with "error" (a device failure) or a bug, logged on the server and answered
with one line, never a traceback (a stream that fails midway sends an error object, then [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clover_jax.serving.chat import MessageError, parse_messages, render_messages
from clover_jax.serving.guard import Access, BodyTooLarge, Guard, KeyRing, access_of
from clover_jax.serving.metrics import CONTENT_TYPE, Metrics
from clover_jax.serving.requests import BadRequest, Draining, Event, QueueFull, Request, ServingError
from clover_jax.serving.schema import SEED_MAX, SEED_MIN, openapi_document
from clover_jax.serving.tool_parse import OPEN, ParsedCall, call_end, parse_calls, pending_open
from clover_jax.serving.tools import ToolError, ToolPlan, parse_tools
from clover_jax.tokenizer import Tokenizer
from clover_jax.tokenizer.chat_template import ChatTemplateError
from clover_jax.version import __version__

DEFAULT_MAX_TOKENS = 128
MAX_CHOICES = 8  # the default of Limits.max_n
MAX_BODY_BYTES = 1 << 20  # the default of Limits.max_body_bytes
MAX_MESSAGES = 256  # the default of Limits.max_messages
MAX_DEPTH = 32  # JSON nesting a request body may have (the deepest valid body has 5)
INT_RANGE = 2**64  # an integer field beyond +-this is refused whatever it is (seeds reach 2**64 - 1)
MAX_STOPS = 4
RANDOM_SEEDS = 2**31  # a seed drawn for a sampled request without one is in [0, RANDOM_SEEDS)
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
PING_S = 15  # SSE keep-alive comment interval
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/openapi.json")
DIFFUSION_FIELDS = ("steps", "block_length", "threshold", "remasking", "cache", "top_k")


class ServingEngine(Protocol):
    """What the HTTP layer needs of `clover_jax.serving.engine.Engine`."""

    block_length: int
    max_prompt: int
    max_tokens: int

    def submit(self, req: Request, on_event: Callable[[Event], None]) -> int: ...
    def cancel(self, rid: int) -> None: ...
    def stats(self) -> Any: ...


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (beyond the engine's own max_prompt / max_tokens).

    max_body_bytes: the largest request body (413 above it, before it is parsed);
    max_messages: the most chat messages (400 above it);
    max_n: the most choices (`n`) per request, each an engine row (400 above it; 1 refuses n > 1);
    request_timeout_s: the deadline from arrival (None: none); see the module docstring.
    """

    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = MAX_MESSAGES
    max_n: int = MAX_CHOICES
    request_timeout_s: float | None = None


@dataclass
class ServerState:
    """Everything the handlers share (`app.state.clover`). `draining` is set by `set_draining`."""

    engine: Any
    tokenizer: Tokenizer
    model_name: str
    log: Callable[[str], None]
    defaults: dict[str, Any] = field(default_factory=dict)  # the model's request defaults (`parse_job`)
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    limits: Limits = field(default_factory=Limits)


class EngineFailure(Exception):
    """The engine ended a choice with finish_reason "error" (its device program failed)."""


CLIENT_CLOSED = 499  # the access log's status of a request whose client hung up mid-body (nginx's convention)


class ApiError(Exception):
    """An error answered as an OpenAI error object with HTTP status `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        """The JSON error response."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def make_app(engine: ServingEngine, tokenizer: Tokenizer, model_name: str, *,
             log: Callable[[str], None] | None = None, defaults: dict[str, Any] | None = None,
             limits: Limits | None = None, api_keys: Sequence[str] = ()) -> FastAPI:
    """The ASGI app serving `engine` (already started) as model `model_name`. `log` gets one message per
    internal error (with its traceback); default: the `clover_jax.serving` logger. `defaults`: settings
    for fields a request leaves out (keys of `DEFAULTABLE`, e.g. from the checkpoint's
    generation_config.json). `limits`: see `Limits`. `api_keys`: the keys a request must present as
    `Authorization: Bearer <key>` (every route but /health); none: no key needed."""
    limits = limits or Limits()
    state = ServerState(engine, tokenizer, model_name, log or logging.getLogger("clover_jax.serving").error,
                        dict(defaults or {}), limits=limits)
    keys = KeyRing(api_keys)
    app = FastAPI(title="clover-jax", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.clover = state
    document: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not document:
            mode = getattr(engine, "cache", None)
            document.append(openapi_document(
                title="clover-jax", version=__version__, auth=bool(keys), model=model_name,
                vocab_size=engine.cfg.vocab_size, max_prompt=engine.max_prompt, max_tokens=engine.max_tokens,
                max_n=limits.max_n, max_messages=limits.max_messages, max_stops=MAX_STOPS,
                block_length=engine.block_length,
                cache_modes=("auto",) if mode in (None, "auto") else ("auto", str(mode))))
        return document[0]

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(Guard, keys=keys, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(_CountRequests, metrics=state.metrics)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _model, methods=["GET"])
    app.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"])
    return app


def set_draining(app: Any, draining: bool = True) -> None:
    """Mark the app as shutting down: /health answers 503 and new generation requests get 503, while
    the requests in flight go on."""
    app.state.clover.draining = draining


# --- plain endpoints ------------------------------------------------------------------------------

def _state(request: HTTPRequest) -> ServerState:
    return request.app.state.clover


async def _health(request: HTTPRequest) -> Response:
    if _state(request).draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


def _model_card(st: ServerState) -> dict[str, Any]:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "clover-jax"}


async def _models(request: HTTPRequest) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


async def _model(request: HTTPRequest) -> Response:
    st = _state(request)
    model_id = request.path_params["model_id"]
    if model_id != st.model_name:
        return _unknown_model(model_id, st.model_name).response()
    return JSONResponse(_model_card(st))


async def _metrics(request: HTTPRequest) -> Response:
    st = _state(request)
    try:
        stats = st.engine.stats()
    except Exception:  # a broken engine must not take the HTTP metrics down with it
        st.log("engine.stats() failed:\n" + traceback.format_exc())
        stats = None
    return Response(st.metrics.render(stats), media_type=CONTENT_TYPE)


async def _http_error(request: HTTPRequest, exc: Exception) -> Response:
    """The framework's 404/405 as OpenAI error objects (status and headers kept)."""
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code), headers=exc.headers).response()


class _CountRequests:
    """ASGI middleware counting every answered HTTP request by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            endpoint = "/v1/models" if path.startswith("/v1/models/") else path if path in ROUTES else "other"
            self.metrics.count_request(endpoint, status)


# --- parsing -------------------------------------------------------------------------------------

def _unknown_model(name: str, served: str) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


def _from_serving(e: ServingError) -> ApiError:
    """The HTTP error of an engine refusal: 429 queue full, 503 draining, else 400."""
    if isinstance(e, QueueFull):
        return ApiError(429, str(e) or "the request queue is full; retry later", type="rate_limit_error",
                        code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, Draining):
        return _draining_error()
    msg = str(e) or type(e).__name__
    words = msg.replace("(", " ").split()
    param = next((p for p in (*_REQUEST_PARAMS, "prompt") if p in words), None)
    return ApiError(400, msg, param=param, code="invalid_value" if isinstance(e, BadRequest) else None)


_REQUEST_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "threshold", "steps", "remasking", "seed")


def _draining_error() -> ApiError:
    return ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                    code="draining")


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed JSON value (a scalar: 0), without recursing."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        todo.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return deepest


async def _json_body(request: HTTPRequest) -> dict[str, Any]:
    """The request's JSON object. ApiError 415 unless the content type is JSON, 413 for a body over the
    limit (from Guard's counting `receive`), 400 for anything that is not a JSON object of at most
    MAX_DEPTH levels (invalid UTF-8, bad syntax, NaN / Infinity, an integer of over 4300 digits); CLIENT_CLOSED
    when the client hangs up before its whole body arrived (an access line, no error log)."""
    if not _is_json(request.headers.get("content-type")):
        raise ApiError(415, "send the body as JSON with the header 'Content-Type: application/json'",
                       code="unsupported_media_type")
    try:
        raw = await request.body()
    except BodyTooLarge as e:
        raise ApiError(413, str(e), code="body_too_large", headers={"Connection": "close"}) from None
    except ClientDisconnect:  # gone before its whole body came: nobody to answer, nothing to log but the access line
        raise ApiError(CLIENT_CLOSED, "the client closed the connection before sending its whole body",
                       code="client_disconnected") from None
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, too many digits
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if _depth(body) > MAX_DEPTH:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    return body


_KINDS: dict[str, tuple[type, ...]] = {"an integer": (int,), "a number": (int, float), "a boolean": (bool,),
                                       "a string": (str,), "an object": (dict,)}


def _preview(value: Any) -> str:
    """A short, safe rendering of a JSON value for an error message (never the whole of a big one)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    shown = json.dumps(value[:40]) if isinstance(value, str) else repr(value) if isinstance(value, float) \
        else json.dumps(value) if isinstance(value, bool) else str(value)[:40]
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _as_int(value: Any) -> int | None:
    """`value` as an integer when JSON Schema calls it one (an int, or a float with no fraction such as
    5.0, within +-INT_RANGE), else None. Booleans are not integers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) <= INT_RANGE:
        return int(value)
    return value if isinstance(value, int) else None


def _field(obj: dict[str, Any], key: str, what: str, default: Any = None, where: str = "") -> Any:
    """obj[key] when present and not null, else `default`; ApiError 400 when it is not `what` (a key of
    _KINDS; booleans are not numbers; an integer may be written 5.0), for an integer beyond +-INT_RANGE
    and a non-finite number. Numbers come back as float, integers as int."""
    value = obj.get(key)
    if value is None:
        return default
    if what == "an integer" and _as_int(value) is not None:
        value = _as_int(value)
    kinds = _KINDS[what]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ApiError(400, f"{where}{key} must be {what}, got {_preview(value)}", param=where + key,
                       code="invalid_type")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_RANGE:
        raise ApiError(400, f"{where}{key} is out of range", param=where + key, code="invalid_value")
    if what == "a number":
        value = float(value)
        if not math.isfinite(value):
            raise ApiError(400, f"{where}{key} must be a finite number", param=where + key, code="invalid_value")
    return value


def _check_model(body: dict[str, Any], served: str) -> None:
    name = _field(body, "model", "a string")
    if name is not None and name != served:
        raise _unknown_model(name, served)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(_as_int(t) is not None for t in value)


def _ids(value: list[Any]) -> tuple[int, ...]:
    return tuple(_as_int(t) for t in value)  # type: ignore[misc]


def _encode(tokenizer: Tokenizer, text: str, param: str) -> tuple[int, ...]:
    """tokenizer.encode(text); ApiError 400 for text that is not valid Unicode (a lone surrogate, which
    JSON's \\uD800 escapes can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (it holds a lone UTF-16 surrogate)", param=param,
                       code="invalid_value") from None
    return tuple(tokenizer.encode(text))


def completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    """Token ids of a /v1/completions `prompt`: a string, a list of one string, a list of token ids (or
    a list of one such list). ApiError 400 otherwise, or for several prompts."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, f"this server takes one prompt per request, got a list of {len(prompt)}; "
                                "send them as separate requests (or use n for several choices)", param="prompt")
        return _encode(tokenizer, prompt[0], "prompt")
    if _is_ids(prompt):
        return _ids(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and _is_ids(prompt[0]):
        return _ids(prompt[0])
    if prompt is None:
        raise ApiError(400, "prompt is required", param="prompt", code="missing_field")
    raise ApiError(400, "prompt must be a string, a list of one string, or a list of token ids", param="prompt",
                   code="invalid_type")


def tool_plan(body: dict[str, Any]) -> ToolPlan | None:
    """The request's `tools` / `tool_choice` / `parallel_tool_calls` (`clover_jax.serving.tools`); ApiError 400."""
    try:
        return parse_tools(body)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


def chat_prompt(body: dict[str, Any], tokenizer: Tokenizer, max_messages: int = MAX_MESSAGES,
                tools: ToolPlan | None = None) -> tuple[int, ...]:
    """Token ids of a /v1/chat/completions `messages` list and its `tools` (see `clover_jax.serving.chat`);
    ApiError 400 for more than `max_messages` messages or a conversation the chat template refuses."""
    given = body.get("messages")
    if isinstance(given, list) and len(given) > max_messages:
        raise ApiError(400, f"this server takes at most {max_messages} messages, got {len(given)}",
                       param="messages", code="too_many_messages")
    try:
        messages = parse_messages(given)
    except MessageError as e:
        raise ApiError(400, str(e), param=e.param) from None
    try:
        text = render_messages(tokenizer, messages, tools.tools if tools is not None else ())
    except ChatTemplateError as e:
        raise ApiError(400, str(e)[:500], param="messages", code="invalid_value") from None
    return _encode(tokenizer, text, "messages")


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return tuple(stops)


def _diffusion(body: dict[str, Any], engine: Any) -> dict[str, Any]:
    """The `diffusion` extension as Request fields."""
    ext = _field(body, "diffusion", "an object", {})
    unknown = sorted(set(ext) - set(DIFFUSION_FIELDS))
    if unknown:
        raise ApiError(400, f"unknown diffusion field(s) {', '.join(unknown)}; known: {', '.join(DIFFUSION_FIELDS)}",
                       param=f"diffusion.{unknown[0]}")
    block_length = _field(ext, "block_length", "an integer", where="diffusion.")
    if block_length is not None and block_length != engine.block_length:
        raise ApiError(400, f"diffusion.block_length must be {engine.block_length} (the block length this server "
                            f"runs), got {block_length}", param="diffusion.block_length")
    cache = _field(ext, "cache", "a string", where="diffusion.")
    mode = getattr(engine, "cache", None)
    allowed = ("auto",) if mode in (None, "auto") else ("auto", str(mode))
    if cache is not None and cache not in allowed:
        raise ApiError(400, f"diffusion.cache must be {' or '.join(map(repr, allowed))} (this server's cache mode is "
                            f"fixed at start), got {cache!r}", param="diffusion.cache")
    out = {"steps": _field(ext, "steps", "an integer", where="diffusion."),
           "threshold": _field(ext, "threshold", "a number", where="diffusion."),
           "remasking": _field(ext, "remasking", "a string", where="diffusion."),
           "top_k": _field(ext, "top_k", "an integer", where="diffusion.")}
    return {k: v for k, v in out.items() if v is not None}


def _seeds(seed: int | None, n: int, temperature: float) -> list[int]:
    if seed is not None:
        return [seed + i for i in range(n)]
    if temperature > 0:
        return [random.randrange(RANDOM_SEEDS) for _ in range(n)]
    return [0] * n


@dataclass(frozen=True)
class Job:
    """A parsed generation request: one engine Request per choice, plus what the HTTP layer does itself."""

    requests: tuple[Request, ...]
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    tools: ToolPlan | None = None  # the chat request's tools, when they are parsed out of its text


# Request settings a checkpoint's generation_config.json may give defaults for (`make_app(defaults=...)`).
DEFAULTABLE = ("max_tokens", "temperature", "top_p", "top_k", "threshold", "remasking")


def parse_job(body: dict[str, Any], engine: Any, prompt: tuple[int, ...], chat: bool,
              defaults: dict[str, Any] | None = None, max_n: int = MAX_CHOICES, tools: ToolPlan | None = None) -> Job:
    """The Job of a completions (or, with `chat`, chat completions) body. Fields the body leaves out take
    `defaults` (the model's, `DEFAULTABLE`), else greedy decoding and at most 128 tokens. Raises ApiError
    400 for a field of the wrong type, n outside [1, max_n] or a seed outside [SEED_MIN, SEED_MAX], and
    BadRequest for settings the engine would refuse (prompt too long, max_tokens too large, ...)."""
    d = defaults or {}
    default_max = min(d.get("max_tokens", DEFAULT_MAX_TOKENS), engine.max_tokens)
    max_tokens = _field(body, "max_tokens", "an integer", default_max)
    if chat:
        max_tokens = _field(body, "max_completion_tokens", "an integer", max_tokens)
    temperature = _field(body, "temperature", "a number", d.get("temperature", 0.0))
    n = _field(body, "n", "an integer", 1)
    if not 1 <= n <= max_n:
        raise ApiError(400, f"n must be in [1, {max_n}], got {n} (this server's limit of choices per request)",
                       param="n", code="invalid_value")
    knobs = {k: d[k] for k in ("top_k", "threshold", "remasking") if k in d} | _diffusion(body, engine)
    base = Request(prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                   top_p=_field(body, "top_p", "a number", d.get("top_p", 1.0)), **knobs)
    stream = _field(body, "stream", "a boolean", False)
    options = _field(body, "stream_options", "an object", {})
    include_usage = bool(_field(options, "include_usage", "a boolean", False, where="stream_options."))
    seed = _field(body, "seed", "an integer")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise ApiError(400, f"seed must be in [{SEED_MIN}, {SEED_MAX}]", param="seed", code="invalid_value")
    seeds, stops = _seeds(seed, n, temperature), _stops(body)
    base.check(engine.block_length, engine.cfg.vocab_size, engine.max_prompt, engine.max_tokens)
    return Job(tuple(dataclasses.replace(base, seed=s) for s in seeds), stops, stream, include_usage,
               tools if tools is not None and tools.parses else None)


# --- running a job -------------------------------------------------------------------------------

def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


@dataclass
class Choice:
    """One choice's progress: its tokens so far and the text released to the client."""

    index: int
    rid: int | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stopped: bool = False  # a stop string matched (the engine row still runs until cancelled)
    used: int | None = None  # with a stop match: the tokens the returned text came from
    passes: int = 0  # forward passes the engine reported so far
    queued_s: float = 0.0  # how long it waited for a row (the engine's report)
    seen: int = 0  # characters decoded before the latest event
    calls: tuple[tuple[str, ParsedCall], ...] = ()  # (id, call) of the tool calls it ended with

    @property
    def done(self) -> bool:
        """Whether nothing more will be released."""
        return self.finish_reason is not None

    def apply(self, event: Event, decode: Callable[[list[int]], str], stops: Sequence[str],
              tools: ToolPlan | None = None) -> str:
        """Take one engine event; returns the text newly released (cut before a stop string; while the
        choice runs, less the tail a stop string or a UTF-8 character could still span).

        With `tools` (a plan that parses calls): the choice also ends once its tool calls are complete
        (`tool_parse.call_end`), no text from the first `<tool_call>` on is released while it runs, and at
        the end valid calls become `calls` with finish_reason "tool_calls" (the text is then the content
        before them); invalid ones leave the whole text as content."""
        self.tokens.extend(event.tokens)
        full = decode(self.tokens)
        cut = find_stop(full, stops)
        if tools is not None:
            end_call = call_end(full, self.seen, tools.parallel)
            if end_call is not None and (cut is None or end_call <= cut):
                cut = end_call
        self.seen = len(full)
        if cut is not None:
            self.finish_reason, self.stopped = "stop", True
            # the fewest tokens whose text reaches the cut: what usage counts
            self.used = next(k for k in range(len(self.tokens) + 1) if len(decode(self.tokens[:k])) >= cut)
            return self._end(full[:cut], tools)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            return self._end(full, tools)
        end = len(full) - (max(map(len, stops)) - 1 if stops else 0)
        while end > 0 and full[end - 1] == "\ufffd":
            end -= 1
        upto = full[:max(end, 0)]
        if tools is not None:  # hold back a call (or what may become one), and the whitespace before it
            upto = upto.split(OPEN, 1)[0]
            upto = upto[:len(upto) - pending_open(upto)].rstrip()
        return self._release(upto)

    def _end(self, text: str, tools: ToolPlan | None) -> str:
        """Release the rest of a finished choice: its calls when `tools` finds valid ones, else its text."""
        if tools is not None and self.finish_reason in ("stop", "length"):
            parsed = parse_calls(text, tools.allowed())
            if parsed.calls:
                self.calls = tuple((f"call_{uuid.uuid4().hex[:24]}", c) for c in parsed.calls)
                self.finish_reason = "tool_calls"
                return self._release(parsed.content)
        return self._release(text)

    def _release(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text += delta
        return delta


class Run:
    """The choices of one HTTP request in the engine: submits them, turns their events into text.

    `deadline` (time.monotonic() seconds, None: none): once it passes, `deltas` ends every unfinished
    choice with finish_reason "length" and cancels its engine row (`timed_out` becomes True).
    `metrics` (if given) counts every generation submitted and every final engine event."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, job: Job, loop: asyncio.AbstractEventLoop,
                 started: float, deadline: float | None = None, metrics: Metrics | None = None) -> None:
        self.engine, self.tokenizer, self.job, self.loop = engine, tokenizer, job, loop
        self.queue: asyncio.Queue[tuple[int, Event] | None] = asyncio.Queue()
        self.choices = [Choice(i) for i in range(len(job.requests))]
        self.started = started
        self.deadline = deadline
        self.metrics = metrics
        self.first_block: float | None = None
        self.timed_out = False

    def _on_event(self, index: int) -> Callable[[Event], None]:
        loop, queue, metrics = self.loop, self.queue, self.metrics

        def on_event(event: Event) -> None:  # runs on the engine thread
            # a closed loop means nobody waits for this request any more; never raise into the engine
            with contextlib.suppress(Exception):
                if metrics is not None and event.finish_reason is not None:
                    metrics.count_ended(event.finish_reason)
                loop.call_soon_threadsafe(queue.put_nowait, (index, event))

        return on_event

    def submit(self) -> None:
        """Submit every choice; if one is refused, cancel those already in and re-raise."""
        try:
            for choice, req in zip(self.choices, self.job.requests, strict=True):
                choice.rid = self.engine.submit(req, self._on_event(choice.index))
                if self.metrics is not None:
                    self.metrics.count_submitted()
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Cancel every unfinished choice in the engine (idempotent) and wake `deltas`."""
        for c in self.choices:
            if not c.done:
                c.finish_reason = "cancelled"
                if c.rid is not None:
                    self.engine.cancel(c.rid)
        self.queue.put_nowait(None)

    @property
    def done(self) -> bool:
        """Whether every choice has finished."""
        return all(c.done for c in self.choices)

    async def _next(self) -> tuple[int, Event] | None:
        """The next event; TimeoutError once the deadline passed."""
        if self.deadline is None:
            return await self.queue.get()
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return await asyncio.wait_for(self.queue.get(), left)

    def expire(self) -> list[tuple[Choice, str]]:
        """The deadline passed: end every unfinished choice with "length" (releasing all its text so far)
        and cancel its engine row; (choice, released text) of each."""
        self.timed_out = True
        out = []
        for c in self.choices:
            if not c.done:
                out.append((c, c.apply(Event((), "length", c.passes, c.queued_s), self.tokenizer.decode,
                                       self.job.stops, self.job.tools)))
                if c.rid is not None:
                    self.engine.cancel(c.rid)  # its row frees at the next block boundary
        if self.metrics is not None:
            self.metrics.count_timeout()
        return out

    async def deltas(self) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, newly released text) after every event, until all choices are done (or the deadline
        passed: then one last (choice, text) per choice it ended)."""
        while not self.done:
            try:
                item = await self._next()
            except TimeoutError:
                for pair in self.expire():
                    yield pair
                return
            if item is None:
                continue
            index, event = item
            choice = self.choices[index]
            if choice.done:  # e.g. the "cancelled" event after a stop string matched
                continue
            choice.passes, choice.queued_s = event.passes, event.queued_s
            if self.first_block is None and (event.tokens or event.finish_reason is not None):
                self.first_block = time.monotonic()
            if event.finish_reason == "error":
                choice.finish_reason = "error"
                raise EngineFailure(f"the engine failed while generating choice {index} (request {choice.rid})")
            delta = choice.apply(event, self.tokenizer.decode, self.job.stops, self.job.tools)
            if choice.stopped and event.finish_reason is None and choice.rid is not None:
                self.engine.cancel(choice.rid)  # free the row at the next block boundary
            yield choice, delta

    def usage(self) -> dict[str, int]:
        """OpenAI usage: the prompt once, the completion tokens of every choice."""
        prompt = len(self.job.requests[0].prompt)
        completion = sum(len(c.tokens) if c.used is None else c.used for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def record(self, metrics: Metrics) -> None:
        """Time to first block and total latency of a finished run into `metrics` (none for a cancelled one)."""
        if any(c.finish_reason == "cancelled" for c in self.choices):
            return
        now = time.monotonic()
        metrics.observe_generation((self.first_block or now) - self.started, now - self.started)

    def describe(self, access: Access | None) -> None:
        """Fill the access line's generation fields: tokens in / out, passes, queue time, finish reasons."""
        if access is None:
            return
        usage = self.usage()
        access.tokens_in, access.tokens_out = usage["prompt_tokens"], usage["completion_tokens"]
        access.passes = sum(c.passes for c in self.choices)
        access.queue_s = max(c.queued_s for c in self.choices)
        access.finish = ",".join(c.finish_reason or "none" for c in self.choices)


# --- responses -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Meta:
    """The fields every response object of one request shares."""

    id: str
    created: int
    model: str
    chat: bool

    def head(self, obj: str) -> dict[str, Any]:
        """id, object, created, model."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _tool_calls_json(c: Choice, stream: bool = False) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` of a choice (streamed: each with its `index`); arguments as a JSON string."""
    return [{**({"index": i} if stream else {}), "id": call_id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, (call_id, call) in enumerate(c.calls)]


def _choice_json(meta: Meta, c: Choice) -> dict[str, Any]:
    if meta.chat:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.calls:
            message = {"role": "assistant", "content": c.text or None, "tool_calls": _tool_calls_json(c)}
        return {"index": c.index, "message": message, "logprobs": None, "finish_reason": c.finish_reason}
    return {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}


def _chunk(meta: Meta, index: int, delta: dict[str, Any] | str, finish: str | None,
           timed_out: bool = False) -> dict[str, str]:
    """One SSE event: a chat.completion.chunk (delta: a dict) or a text_completion chunk (delta: text);
    `timed_out` adds "timed_out": true (the final chunk of a choice the deadline ended)."""
    if meta.chat:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = {**meta.head("chat.completion.chunk"), "choices": [choice]}
    else:
        choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
        body = {**meta.head("text_completion"), "choices": [choice]}
    if timed_out:
        body["timed_out"] = True
    return {"data": json.dumps(body, ensure_ascii=False)}


async def _collect(run: Run, meta: Meta, st: ServerState, request: HTTPRequest) -> Response:
    """Wait for every choice (cancelling them all if the client goes away); the whole response."""
    access = access_of(request.scope)
    watcher = asyncio.ensure_future(_watch_disconnect(run, request, access))
    try:
        async for _ in run.deltas():
            pass
    finally:
        watcher.cancel()
        run.cancel()  # no-op unless something failed midway
        run.describe(access)
    run.record(st.metrics)
    body = {**meta.head("chat.completion" if meta.chat else "text_completion"),
            "choices": [_choice_json(meta, c) for c in run.choices], "usage": run.usage()}
    if run.timed_out:
        body["timed_out"] = True
    return JSONResponse(body)


async def _watch_disconnect(run: Run, request: HTTPRequest, access: Access | None = None) -> None:
    while not run.done:
        if await request.is_disconnected():
            if access is not None:
                access.error = "client_disconnected"
            run.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _stream(run: Run, meta: Meta, st: ServerState, access: Access | None = None) -> AsyncIterator[dict[str, str]]:
    """The SSE events of a streamed run, ending with `data: [DONE]`. Whatever ends it early (a client
    that disconnects, an error) cancels the choices still running."""
    finished = False
    try:
        if meta.chat:
            for c in run.choices:
                yield _chunk(meta, c.index, {"role": "assistant"}, None)
        async for c, delta in run.deltas():
            if delta:
                yield _chunk(meta, c.index, {"content": delta} if meta.chat else delta, None)
            if c.done and c.calls:
                for call in _tool_calls_json(c, stream=True):
                    yield _chunk(meta, c.index, {"tool_calls": [call]}, None)
            if c.done:
                yield _chunk(meta, c.index, {} if meta.chat else "", c.finish_reason, run.timed_out)
        if run.job.include_usage:
            yield {"data": json.dumps({**meta.head(_chunk_object(meta)), "choices": [], "usage": run.usage()})}
        run.record(st.metrics)
        finished = True
        yield {"data": "[DONE]"}
    except Exception as e:
        failure = _failure(st, meta.id, e)
        if access is not None:
            access.error = failure.code
        finished = True
        yield {"data": json.dumps({"error": {"message": failure.message, "type": failure.type, "param": None,
                                             "code": failure.code}})}
        yield {"data": "[DONE]"}
    finally:
        if not finished and access is not None and access.error is None:
            access.error = "client_disconnected"
        run.cancel()
        run.describe(access)


def _chunk_object(meta: Meta) -> str:
    return "chat.completion.chunk" if meta.chat else "text_completion"


# --- the generation endpoints --------------------------------------------------------------------

async def _completions(request: HTTPRequest) -> Response:
    return await _generate(request, chat=False)


async def _chat_completions(request: HTTPRequest) -> Response:
    return await _generate(request, chat=True)


async def _start(request: HTTPRequest, st: ServerState, chat: bool, started: float) -> Run:
    """Parse the request and submit its choices; raises ApiError or ServingError."""
    if st.draining:
        raise _draining_error()
    body = await _json_body(request)
    _check_model(body, st.model_name)
    lim = st.limits
    tools = tool_plan(body) if chat else None
    prompt = chat_prompt(body, st.tokenizer, lim.max_messages, tools) if chat else completion_prompt(body, st.tokenizer)
    job = parse_job(body, st.engine, prompt, chat, st.defaults, lim.max_n, tools)
    deadline = None if lim.request_timeout_s is None else started + lim.request_timeout_s
    run = Run(st.engine, st.tokenizer, job, asyncio.get_running_loop(), started, deadline, st.metrics)
    run.submit()
    return run


async def _generate(request: HTTPRequest, chat: bool) -> Response:
    st = _state(request)
    access = access_of(request.scope)
    started = access.started if access is not None else time.monotonic()
    try:
        try:
            run = await _start(request, st, chat, started)
            meta = Meta(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), st.model_name,
                        chat)
            if run.job.stream:
                return EventSourceResponse(_stream(run, meta, st, access), sep="\n", ping=PING_S)
            return await _collect(run, meta, st, request)
        except ServingError as e:
            raise _from_serving(e) from None
        except ApiError:
            raise
        except Exception as e:
            raise _failure(st, request.url.path, e) from None
    except ApiError as e:
        if access is not None:
            access.error = e.code or e.type
        return e.response()


def _failure(st: ServerState, what: str, e: Exception) -> ApiError:
    """Log an unexpected failure (with the engine's last error, or the traceback) and the 500 that answers it."""
    if isinstance(e, EngineFailure):
        st.log(f"{what}: {e}: {getattr(st.engine, 'last_error', None)!r}")
        return ApiError(500, "the engine failed while generating (logged on the server)", type="server_error",
                        code="engine_error")
    st.log(f"{what} failed:\n{traceback.format_exc()}")
    return ApiError(500, "internal error (logged on the server)", type="server_error", code="internal_error")
