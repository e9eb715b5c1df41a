"""Rendering a `Run` (`clover_jax.serving.choices`) as OpenAI response objects: one JSON body, or SSE chunks.

Non-streamed, `collect` waits for every choice (cancelling them all if the client disconnects) and
answers a `chat.completion` / `text_completion` object with its `usage`. Streamed, `stream_response`
sends the chunks of each choice as its text is released (a chat stream opens each choice with its
role), a choice's tool calls as one chunk each, then its final chunk with the finish_reason, the usage
chunk when asked (`stream_options.include_usage`) and `data: [DONE]`; a client that disconnects has
all its choices cancelled. A request its deadline ended carries the extension field `"timed_out": true`
(on the response object or, streamed, on the final chunk of each choice it ended).

A failure is answered by `failure`: logged on the server (the engine's last error, or the traceback) and
answered as one line, never a traceback; a stream that fails midway sends that error object, then [DONE].
"""

from __future__ import annotations

import asyncio
import json
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from clover_jax.serving.choices import Choice, EngineFailure, Run
from clover_jax.serving.guard import Access, access_of
from clover_jax.serving.http_errors import ApiError
from clover_jax.serving.metrics import Metrics

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
PING_S = 15  # SSE keep-alive comment interval


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
    """One finished choice of a non-streamed response: its message (chat) or text, and finish_reason."""
    if meta.chat:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.calls:
            message = {"role": "assistant", "content": c.text or None, "tool_calls": _tool_calls_json(c)}
        if c.reasoning:  # vLLM's field for a thinking model's reasoning
            message["reasoning_content"] = c.reasoning
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


async def collect(run: Run, meta: Meta, metrics: Metrics, request: HTTPRequest) -> Response:
    """Wait for every choice (cancelling them all if the client goes away); the whole response. Records the
    run's latency in `metrics` and fills the request's access line."""
    access = access_of(request.scope)
    watcher = asyncio.ensure_future(_watch_disconnect(run, request, access))
    try:
        async for _ in run.deltas():
            pass
    finally:
        watcher.cancel()
        run.cancel()  # no-op unless something failed midway
        run.describe(access)
    run.record(metrics)
    body = {**meta.head("chat.completion" if meta.chat else "text_completion"),
            "choices": [_choice_json(meta, c) for c in run.choices], "usage": run.usage()}
    if run.timed_out:
        body["timed_out"] = True
    return JSONResponse(body)


async def _watch_disconnect(run: Run, request: HTTPRequest, access: Access | None = None) -> None:
    """Cancel `run` (and mark the access line) once the client has gone; ends when the run is done."""
    while not run.done:
        if await request.is_disconnected():
            if access is not None:
                access.error = "client_disconnected"
            run.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def stream_response(run: Run, meta: Meta, metrics: Metrics, log: Callable[[str], None],
                    access: Access | None = None) -> EventSourceResponse:
    """The SSE response streaming `run` (see `_stream`), with a keep-alive comment every PING_S seconds."""
    return EventSourceResponse(_stream(run, meta, metrics, log, access), sep="\n", ping=PING_S)


async def _stream(run: Run, meta: Meta, metrics: Metrics, log: Callable[[str], None],
                  access: Access | None = None) -> AsyncIterator[dict[str, str]]:
    """The SSE events of a streamed run, ending with `data: [DONE]`. Whatever ends it early (a client
    that disconnects, an error) cancels the choices still running."""
    finished = False
    try:
        if meta.chat:
            for c in run.choices:
                yield _chunk(meta, c.index, {"role": "assistant"}, None)
        async for c, delta in run.deltas():
            if delta.reasoning:
                yield _chunk(meta, c.index, {"reasoning_content": delta.reasoning}, None)
            if delta.content:
                yield _chunk(meta, c.index, {"content": delta.content} if meta.chat else delta.content, None)
            if c.done and c.calls:
                for call in _tool_calls_json(c, stream=True):
                    yield _chunk(meta, c.index, {"tool_calls": [call]}, None)
            if c.done:
                yield _chunk(meta, c.index, {} if meta.chat else "", c.finish_reason, run.timed_out)
        if run.job.include_usage:
            yield {"data": json.dumps({**meta.head(_chunk_object(meta)), "choices": [], "usage": run.usage()})}
        run.record(metrics)
        finished = True
        yield {"data": "[DONE]"}
    except Exception as e:
        error = failure(log, run.engine, meta.id, e)
        if access is not None:
            access.error = error.code
        finished = True
        yield {"data": json.dumps({"error": {"message": error.message, "type": error.type, "param": None,
                                             "code": error.code}})}
        yield {"data": "[DONE]"}
    finally:
        if not finished and access is not None and access.error is None:
            access.error = "client_disconnected"
        run.cancel()
        run.describe(access)


def _chunk_object(meta: Meta) -> str:
    """The `object` of this request's stream chunks."""
    return "chat.completion.chunk" if meta.chat else "text_completion"


def failure(log: Callable[[str], None], engine: Any, what: str, e: Exception) -> ApiError:
    """Log an unexpected failure `e` of `what` (a path or a response id) to `log`, with the engine's last
    error or the traceback (call it inside the `except`), and the 500 that answers it."""
    if isinstance(e, EngineFailure):
        log(f"{what}: {e}: {getattr(engine, 'last_error', None)!r}")
        return ApiError(500, "the engine failed while generating (logged on the server)", type="server_error",
                        code="engine_error")
    log(f"{what} failed:\n{traceback.format_exc()}")
    return ApiError(500, "internal error (logged on the server)", type="server_error", code="internal_error")
