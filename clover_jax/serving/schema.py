"""The OpenAPI 3.1 document of `clover serve` (served by FastAPI at `GET /openapi.json`).

Written out here rather than derived from handler signatures: the handlers parse bodies by hand
(`http_request.parse_job`, with OpenAI-style 400s naming the field), so FastAPI never validates a body itself.
The request schemas say what the parser accepts, with this server's limits filled in (max_tokens,
n, the prompt's token ids and length, messages, stop strings; the sampler settings from their table,
`sampler.settings`): a body the
schema refuses is refused by the server with a 4xx too (the schema is never stricter than the
parser), while a body it admits can still get a 400 for what a schema cannot say (a prompt longer
than the server's limit once tokenized, an empty prompt after tokenizing). Unknown top-level fields
are allowed (OpenAI clients send extras). With API keys every operation but `/health` declares the
HTTP bearer scheme and a 401.
"""

from __future__ import annotations

from typing import Any

from clover_jax.sampler.settings import REQUEST_NAMES, SETTINGS
from clover_jax.serving.tools import TOOL_NAME_PATTERN


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def sampler_fields(block_length: int, cache_modes: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schemas of the sampler settings a request may set (`settings.REQUEST_NAMES`), from the settings table:
    (top-level fields, `diffusion` fields), with the server's block length and cache modes filled in."""
    top: dict[str, Any] = {}
    inner: dict[str, Any] = {}
    for name, wire in REQUEST_NAMES.items():
        s = SETTINGS[name]
        if name == "block_length":
            schema = _nullable({"type": "integer", "enum": [block_length]})
        elif name == "cache":
            schema = _nullable({"type": "string", "enum": list(cache_modes)})
        else:
            schema = s.json_schema(block_length if name == "steps_per_block" else None)
        if wire.startswith("diffusion."):
            inner[wire.removeprefix("diffusion.")] = schema
        else:
            top[wire] = schema
    return top, inner


def request_schemas(*, model: str, vocab_size: int, max_prompt: int, max_tokens: int, max_n: int, max_messages: int,
                    max_stops: int, block_length: int, cache_modes: tuple[str, ...]) -> dict[str, Any]:
    """The components/schemas of the request bodies, with the server's limits."""
    top, diffusion = sampler_fields(block_length, cache_modes)
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    ids = {"type": "array", "items": token, "minItems": 1, "maxItems": max_prompt}
    tokens = _nullable({"type": "integer", "minimum": 1, "maximum": max_tokens})
    common: dict[str, Any] = {
        "model": _nullable({"type": "string", "enum": [model]}),
        "max_tokens": tokens,
        **top,
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": max_n}),
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": max_stops},
                           {"type": "null"}]},
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable(_ref("StreamOptions")),
        "diffusion": _nullable(_ref("Diffusion")),
    }
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    return {
        "CompletionRequest": {
            "type": "object", "required": ["prompt"],
            "properties": {"prompt": {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                ids,
                {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]}, **common},
        },
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"],
            "properties": {"messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1,
                                        "maxItems": max_messages},
                           "max_completion_tokens": tokens,
                           "tools": _nullable({"type": "array", "items": _ref("Tool")}),
                           "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                                                     _ref("NamedToolChoice"), {"type": "null"}]},
                           "parallel_tool_calls": _nullable({"type": "boolean"}),
                           "chat_template_kwargs": _nullable({"type": "object"}),
                           **common},
        },
        "ChatMessage": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"type": "string", "minLength": 1},
                           "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part},
                                                 {"type": "null"}]},
                           "name": _nullable({"type": "string"}),
                           "tool_calls": _nullable({"type": "array", "items": _ref("MessageToolCall")}),
                           "tool_call_id": _nullable({"type": "string"}),
                           "reasoning_content": _nullable({"type": "string"})},
        },
        "MessageToolCall": {
            "type": "object", "required": ["function"],
            "properties": {"id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                           "function": {"type": "object", "required": ["name"], "properties": {
                               "name": {"type": "string", "minLength": 1},
                               "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}]}}}},
        },
        "Tool": {
            "type": "object", "required": ["function"],
            "properties": {"type": {"type": "string", "enum": ["function"]}, "function": {
                "type": "object", "required": ["name"],
                "properties": {"name": {"type": "string", "pattern": TOOL_NAME_PATTERN},
                               "description": _nullable({"type": "string"}),
                               "parameters": _nullable({
                                   "type": "object",
                                   "properties": {"type": {"type": "string", "enum": ["object"]},
                                                  "properties": {"type": "object"},
                                                  "required": {"type": "array", "items": {"type": "string"}}}})}}},
        },
        "NamedToolChoice": {
            "type": "object", "required": ["type", "function"],
            "properties": {"type": {"type": "string", "enum": ["function"]},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}}}},
        },
        "StreamOptions": {"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})}},
        "Diffusion": {"type": "object", "additionalProperties": False, "properties": diffusion},
    }


def response_schemas() -> dict[str, Any]:
    """The components/schemas of the response bodies."""
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    head = {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": _ref("Usage"), "timed_out": {"type": "boolean"}}
    required = ["id", "object", "created", "model", "choices", "usage"]
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                           "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}},
        "Usage": usage,
        "Completion": {"type": "object", "required": required, "properties": {**head, "choices": {
            "type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"],
                                       "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                                      "finish_reason": finish}}}}},
        "ChatCompletion": {"type": "object", "required": required, "properties": {**head, "choices": {
            "type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"],
                                       "properties": {"index": {"type": "integer"}, "finish_reason": finish,
                                                      "message": _ref("AssistantMessage")}}}}},
        "AssistantMessage": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string"}, "content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "reasoning_content": {"type": "string"},
            "tool_calls": {"type": "array", "items": {
                "type": "object", "required": ["id", "type", "function"],
                "properties": {"id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                               "function": {"type": "object", "required": ["name", "arguments"],
                                            "properties": {"name": {"type": "string"},
                                                           "arguments": {"type": "string"}}}}}}}},
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                  "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                 "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": _ref("Model")}}},
        "Health": {"type": "object", "required": ["status"],
                   "properties": {"status": {"type": "string", "enum": ["ok", "draining"]}}},
    }


_ERRORS = {400: "a malformed body, a field of the wrong type or a setting out of range",
           404: "an unknown model", 413: "the body is larger than the server's limit",
           415: "the body is not application/json", 429: "the engine's queue is full (Retry-After)",
           500: "the engine failed while generating (logged on the server)",
           503: "the server is draining (shutting down)"}


def _responses(ok: dict[str, Any], errors: tuple[int, ...], auth: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "success", "content": ok}}
    for code in (*errors, *((401,) if auth else ())):
        what = "no or an invalid API key (WWW-Authenticate: Bearer)" if code == 401 else _ERRORS[code]
        out[str(code)] = {"description": what, "content": _json(_ref("Error"))}
    return out


def openapi_document(*, title: str, version: str, auth: bool, **limits: Any) -> dict[str, Any]:
    """The whole OpenAPI document; `limits` are `request_schemas`' keywords."""
    sec = {"security": [{"bearer": []}]} if auth else {}
    body_errors = (400, 404, 413, 415, 429, 500, 503)

    def generation(schema: str, answer: str, summary: str) -> dict[str, Any]:
        # each server-sent event: a JSON chunk (or an error object) as its data, the last one "[DONE]"
        event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
        ok = {**_json(_ref(answer)), "text/event-stream": {"schema": event}}
        return {"post": {"summary": summary, "operationId": schema[0].lower() + schema[1:].removesuffix("Request"),
                         "requestBody": {"required": True, "content": _json(_ref(schema))},
                         "responses": _responses(ok, body_errors, auth), **sec}}

    paths = {
        "/health": {"get": {"summary": "liveness: 503 once the server drains", "operationId": "health",
                            "responses": {"200": {"description": "serving", "content": _json(_ref("Health"))},
                                          "503": {"description": "draining", "content": _json(_ref("Health"))}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                             "responses": _responses({"text/plain": {"schema": {"type": "string"}}}, (), auth),
                             **sec}},
        "/v1/models": {"get": {"summary": "the served model, as a list", "operationId": "listModels",
                               "responses": _responses(_json(_ref("ModelList")), (), auth), **sec}},
        "/v1/models/{model_id}": {"get": {
            "summary": "the served model", "operationId": "getModel",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": _responses(_json(_ref("Model")), (404,), auth), **sec}},
        "/v1/completions": generation("CompletionRequest", "Completion", "a text completion"),
        "/v1/chat/completions": generation("ChatCompletionRequest", "ChatCompletion", "a chat completion"),
    }
    components: dict[str, Any] = {"schemas": {**request_schemas(**limits), **response_schemas()}}
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": components}
