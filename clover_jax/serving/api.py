"""The HTTP face of `clover serve`: an OpenAI-compatible API over a batching engine (routes and app assembly).

    GET  /health               {"status": "ok"} (503 {"status": "draining"} once shutdown began)
    GET  /v1/models            the one model, OpenAI list format (GET /v1/models/{id}: that model, or 404)
    POST /v1/completions       prompt: a string, a list of one string, or a list of token ids
    POST /v1/chat/completions  messages, rendered by `clover_jax.serving.chat`
    GET  /metrics              Prometheus text (`clover_jax.serving.metrics`)
    GET  /openapi.json         the OpenAPI document (`clover_jax.serving.schema`): request bodies included

Every request passes `clover_jax.serving.guard.Guard`: API keys (`Authorization: Bearer`, on every route
but /health, 401 otherwise), the body size limit (413, before the body is read), a request id (`X-Request-Id`, the
client's when well-formed) and one access line per request (`clover_jax.serving.logs`).

A generation request goes through three modules: `clover_jax.serving.http_request` reads its body and
fields into a `Job` (the fields, their defaults and limits are described there), `clover_jax.serving.choices`
runs the Job's choices in the engine (stop strings, tool calls, the deadline), and
`clover_jax.serving.responses` renders them as one JSON object or as SSE chunks.

Deadline (`Limits.request_timeout_s`, from arrival): a request still generating when it passes has
every unfinished choice ended with finish_reason "length" (the text generated so far, as when
max_tokens runs out: what OpenAI clients read as "cut short") and the response object (or, streamed,
the final chunk of each such choice) carries the extension field `"timed_out": true`; its engine rows
are cancelled. No error status: the OpenAI clients retry 408 and 5xx answers, which would send the same
too-long request again.

Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}} (`ApiError`,
`clover_jax.serving.http_errors`): 400 bad JSON, types or settings; 401 no or a wrong API key; 404 an
unknown model (or route); 413 a body over the limit; 415 not JSON; 429 the engine's queue is full; 503
draining; 500 a choice the engine ended with "error" (a device failure) or a bug, logged on the server and
answered with one line, never a traceback (a stream that fails midway sends an error object, then [DONE]).
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clover_jax.serving.choices import Run
from clover_jax.serving.guard import Guard, KeyRing, access_of
from clover_jax.serving.http_errors import ApiError
from clover_jax.serving.http_request import (
    MAX_STOPS,
    Limits,
    chat_prompt,
    check_model,
    completion_prompt,
    draining_error,
    from_serving,
    json_body,
    parse_job,
    tool_plan,
    unknown_model,
)
from clover_jax.serving.metrics import CONTENT_TYPE, Metrics
from clover_jax.serving.requests import Event, Request, ServingError, cache_choices
from clover_jax.serving.responses import Meta, collect, failure, stream_response
from clover_jax.serving.scaffold import CallForms, form_of
from clover_jax.serving.schema import openapi_document
from clover_jax.tokenizer import Tokenizer
from clover_jax.version import __version__

__all__ = ["ROUTES", "Limits", "ServerState", "ServingEngine", "make_app", "set_draining"]

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/openapi.json")


class ServingEngine(Protocol):
    """What the HTTP layer needs of `clover_jax.serving.engine.Engine`."""

    block_length: int
    max_prompt: int
    max_tokens: int

    def submit(self, req: Request, on_event: Callable[[Event], None]) -> int: ...
    def cancel(self, rid: int) -> None: ...
    def stats(self) -> Any: ...


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
    forms: CallForms | None = None  # with an engine that takes scaffolds: tool calls rewritten into the canvas


def make_app(engine: ServingEngine, tokenizer: Tokenizer, model_name: str, *,
             log: Callable[[str], None] | None = None, defaults: dict[str, Any] | None = None,
             limits: Limits | None = None, api_keys: Sequence[str] = ()) -> FastAPI:
    """The ASGI app serving `engine` (already started) as model `model_name`. `log` gets one message per
    internal error (with its traceback); default: the `clover_jax.serving` logger. `defaults`: settings
    for fields a request leaves out (`http_request.request_defaults` of the checkpoint's generation_config.json:
    sampler settings by name, and max_tokens). `limits`: see `Limits`. `api_keys`: the keys a request must present as
    `Authorization: Bearer <key>` (every route but /health); none: no key needed."""
    limits = limits or Limits()
    classes = getattr(engine, "scaffold_classes", 0)
    forms = CallForms(tokenizer, engine.cfg.vocab_size, engine.cfg.eos_token_id, classes, form_of(tokenizer),
                      engine.block_length) if classes and engine.cfg.eos_token_id is not None else None
    if forms is not None:
        forms.prepare()
    state = ServerState(engine, tokenizer, model_name, log or logging.getLogger("clover_jax.serving").error,
                        dict(defaults or {}), limits=limits, forms=forms)
    keys = KeyRing(api_keys)
    app = FastAPI(title="clover-jax", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.clover = state
    document: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not document:
            document.append(openapi_document(
                title="clover-jax", version=__version__, auth=bool(keys), model=model_name,
                vocab_size=engine.cfg.vocab_size, max_prompt=engine.max_prompt, max_tokens=engine.max_tokens,
                max_n=limits.max_n, max_messages=limits.max_messages, max_stops=MAX_STOPS,
                block_length=engine.block_length,
                cache_modes=cache_choices(getattr(engine, "cache", "auto"))))
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
        return unknown_model(model_id, st.model_name).response()
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


# --- the generation endpoints --------------------------------------------------------------------

async def _completions(request: HTTPRequest) -> Response:
    return await _generate(request, chat=False)


async def _chat_completions(request: HTTPRequest) -> Response:
    return await _generate(request, chat=True)


async def _start(request: HTTPRequest, st: ServerState, chat: bool, started: float) -> Run:
    """Parse the request and submit its choices; raises ApiError or ServingError."""
    if st.draining:
        raise draining_error()
    body = await json_body(request)
    check_model(body, st.model_name)
    lim = st.limits
    tools = tool_plan(body) if chat else None
    if chat:
        prompt, thinking, keep = chat_prompt(body, st.tokenizer, lim.max_messages, tools)
    else:
        prompt, thinking, keep = completion_prompt(body, st.tokenizer), False, 0
    job = parse_job(body, st.engine, prompt, chat, st.defaults, lim.max_n, tools, thinking, keep)
    deadline = None if lim.request_timeout_s is None else started + lim.request_timeout_s
    run = Run(st.engine, st.tokenizer, job, asyncio.get_running_loop(), started, deadline, st.metrics, st.forms)
    run.submit()
    return run


async def _generate(request: HTTPRequest, chat: bool) -> Response:
    """Answer a generation request: its response (JSON or SSE), or the OpenAI error object of whatever
    refused or failed it (noted on the access line)."""
    st = _state(request)
    access = access_of(request.scope)
    started = access.started if access is not None else time.monotonic()
    try:
        try:
            run = await _start(request, st, chat, started)
            meta = Meta(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), st.model_name,
                        chat)
            if run.job.stream:
                return stream_response(run, meta, st.metrics, st.log, access)
            return await collect(run, meta, st.metrics, request)
        except ServingError as e:
            raise from_serving(e) from None
        except ApiError:
            raise
        except Exception as e:
            raise failure(st.log, st.engine, request.url.path, e) from None
    except ApiError as e:
        if access is not None:
            access.error = e.code or e.type
        return e.response()
