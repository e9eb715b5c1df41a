"""Reading a generation request: its JSON body, its fields, the server's limits, the `Job` it becomes.

Bodies must be `Content-Type: application/json` (415 otherwise: a browser cannot send that cross-origin
without a CORS preflight, which this server never grants), at most `MAX_DEPTH` levels deep, without NaN
or Infinity.

Generation fields: max_tokens (default min(128, the server's limit); more than the limit is a 400,
nothing is clipped), temperature (default 0 = greedy), top_p, stop (a string or up to 4), seed, n
(1..`Limits.max_n` choices, each served by its own engine row and queue place, seeds seed, seed+1, ...;
without a seed: random ones when temperature > 0, else 0; more than max_n is a 400 naming the limit),
stream (+ stream_options.include_usage), and the extension object
`"diffusion": {"steps", "block_length", "threshold", "remasking", "cache", "top_k", "self_speculative",
"causal"}`. Unknown top-level fields are ignored (OpenAI clients send extras); a known field of the wrong type, an
unknown `diffusion` field, or a setting the engine refuses is a 400 naming it. /v1/chat/completions
takes at most `Limits.max_messages` messages (`clover_jax.serving.chat` reads them, and
`clover_jax.serving.tools` the tool fields).

Everything here raises `ApiError` (`clover_jax.serving.http_errors`); `from_serving` turns the engine's
refusals (`clover_jax.serving.requests.ServingError`) into one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from typing import Any, NamedTuple

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from clover_jax.sampler.settings import KIND_WORDS, REQUEST_NAMES, SETTINGS, SamplerConfig, merge_defaults
from clover_jax.serving.chat import parse_messages, render_messages
from clover_jax.serving.field_error import FieldError
from clover_jax.serving.guard import BodyTooLarge
from clover_jax.serving.http_errors import CLIENT_CLOSED, ApiError
from clover_jax.serving.reasoning import prompt_opens_thinking
from clover_jax.serving.requests import BadRequest, Draining, QueueFull, Request, ServingError
from clover_jax.serving.tools import ToolPlan, parse_tools
from clover_jax.tokenizer import Tokenizer
from clover_jax.tokenizer.chat_template import ChatTemplateError

DEFAULT_MAX_TOKENS = 128
MAX_CHOICES = 8  # the default of Limits.max_n
MAX_BODY_BYTES = 1 << 20  # the default of Limits.max_body_bytes
MAX_MESSAGES = 256  # the default of Limits.max_messages
MAX_DEPTH = 32  # JSON nesting a request body may have (the deepest valid body has 5)
INT_RANGE = 2**64  # an integer field beyond +-this is refused whatever it is (seeds reach 2**64 - 1)
MAX_STOPS = 4
RANDOM_SEEDS = 2**31  # a seed drawn for a sampled request without one is in [0, RANDOM_SEEDS)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (beyond the engine's own max_prompt / max_tokens).

    max_body_bytes: the largest request body (413 above it, before it is parsed);
    max_messages: the most chat messages (400 above it);
    max_n: the most choices (`n`) per request, each an engine row (400 above it; 1 refuses n > 1);
    request_timeout_s: the deadline from arrival (None: none); see `clover_jax.serving.api`.
    """

    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = MAX_MESSAGES
    max_n: int = MAX_CHOICES
    request_timeout_s: float | None = None


def unknown_model(name: str, served: str) -> ApiError:
    """The 404 of a request (or a GET /v1/models/{id}) naming a model other than `served`."""
    return ApiError(404, f"the model {name!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


def from_serving(e: ServingError) -> ApiError:
    """The HTTP error of an engine refusal: 429 queue full, 503 draining, else 400."""
    if isinstance(e, QueueFull):
        return ApiError(429, str(e) or "the request queue is full; retry later", type="rate_limit_error",
                        code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, Draining):
        return draining_error()
    msg = str(e) or type(e).__name__
    param = e.param
    if param is None:  # an engine that does not say: the first request field the message names
        words = msg.replace("(", " ").split()
        names = ("max_tokens", *REQUEST_NAMES.values(), *(w.removeprefix("diffusion.") for w in REQUEST_NAMES.values()))
        param = next((p for p in (*names, "prompt") if p in words), None)
    return ApiError(400, msg, param=param, code="invalid_value" if isinstance(e, BadRequest) else None)


def draining_error() -> ApiError:
    """The 503 of a generation request that arrives once shutdown began."""
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


async def json_body(request: HTTPRequest) -> dict[str, Any]:
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


def check_model(body: dict[str, Any], served: str) -> None:
    """ApiError 404 when the body names a `model` other than `served` (leaving it out is fine)."""
    name = _field(body, "model", "a string")
    if name is not None and name != served:
        raise unknown_model(name, served)


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
    except FieldError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


class ChatPrompt(NamedTuple):
    """A chat request's prompt: its token ids, whether its text leaves a `<think>` open (the model answers
    inside its reasoning: `clover_jax.serving.reasoning`), and how many of its first tokens are the conversation
    without the assistant's opening (the part the next turn's prompt begins with; 0 when it is not a prefix)."""

    ids: tuple[int, ...]
    thinking: bool
    keep: int = 0


def chat_prompt(body: dict[str, Any], tokenizer: Tokenizer, max_messages: int = MAX_MESSAGES,
                tools: ToolPlan | None = None) -> ChatPrompt:
    """The prompt of a /v1/chat/completions `messages` list, its `tools` and its `chat_template_kwargs` (further
    variables of the chat template, vLLM's field: e.g. {"enable_thinking": false}; see `clover_jax.serving.chat`);
    ApiError 400 for more than `max_messages` messages or a conversation the chat template refuses."""
    template_vars = _field(body, "chat_template_kwargs", "an object", {})
    given = body.get("messages")
    if isinstance(given, list) and len(given) > max_messages:
        raise ApiError(400, f"this server takes at most {max_messages} messages, got {len(given)}",
                       param="messages", code="too_many_messages")
    try:
        messages = parse_messages(given)
    except FieldError as e:
        raise ApiError(400, str(e), param=e.param) from None
    try:
        text = render_messages(tokenizer, messages, tools.tools if tools is not None else (), template_vars)
    except ChatTemplateError as e:
        raise ApiError(400, str(e)[:500], param="messages", code="invalid_value") from None
    except TypeError as e:  # a chat_template_kwargs value the template cannot use
        raise ApiError(400, f"chat_template_kwargs: {e}"[:500], param="chat_template_kwargs",
                       code="invalid_value") from None
    ids = _encode(tokenizer, text, "messages")
    return ChatPrompt(ids, prompt_opens_thinking(text), _conversation_tokens(tokenizer, messages, tools, template_vars,
                                                                           ids))


def _conversation_tokens(tokenizer: Tokenizer, messages: Any, tools: ToolPlan | None, template_vars: dict[str, Any],
                         ids: tuple[int, ...]) -> int:
    """How many of `ids` (the prompt) are the conversation rendered without the assistant's opening, when they are
    its first tokens (the next turn's prompt then begins with them); else 0."""
    try:
        text = render_messages(tokenizer, messages, tools.tools if tools is not None else (), template_vars,
                               generation_prompt=False)
        head = tuple(tokenizer.encode(text))
    except Exception:  # a template that needs the opening: nothing to keep apart
        return 0
    return len(head) if 0 < len(head) < len(ids) and ids[:len(head)] == head else 0


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


_KIND_WORDS = {**KIND_WORDS, bool: "a boolean"}  # a JSON field's type, as `_field` names it


def _settings(body: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The request's sampler settings by `SamplerConfig` field: every setting of the table with a request name
    (`settings.REQUEST_NAMES`), read from the body (top level, or the `diffusion` object for `diffusion.*`) and
    type-checked (ApiError 400 naming it), else `defaults`' value as `settings.merge_defaults` takes it, else left
    out; and the names the body gave. An unknown `diffusion` field is a 400 too."""
    ext = _field(body, "diffusion", "an object", {})
    known = [wire.removeprefix("diffusion.") for wire in REQUEST_NAMES.values() if wire.startswith("diffusion.")]
    unknown = sorted(set(ext) - set(known))
    if unknown:
        raise ApiError(400, f"unknown diffusion field(s) {', '.join(unknown)}; known: {', '.join(known)}",
                       param=f"diffusion.{unknown[0]}")
    given = {}
    for name, wire in REQUEST_NAMES.items():
        inner = wire.startswith("diffusion.")
        obj, key = (ext, wire.removeprefix("diffusion.")) if inner else (body, wire)
        value = _field(obj, key, _KIND_WORDS[SETTINGS[name].kind], None, where="diffusion." if inner else "")
        if value is not None:
            given[name] = value
    stored = {k: v for k, v in defaults.items() if k in REQUEST_NAMES and v is not None}
    return merge_defaults(given, stored), set(given)


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
    # chat requests: reasoning apart from the answer (`serving.reasoning`); True: the prompt opened `<think>`
    reasoning: bool | None = None


def request_defaults(stored: dict[str, Any]) -> dict[str, Any]:
    """What a request that leaves a field out gets, from a checkpoint's sampler defaults (`settings.read_defaults`
    of its generation_config.json): its traced settings that a request may set (`settings.REQUEST_NAMES`; not the
    seed, which a request without one draws), and `max_tokens` from gen_length."""
    out = {k: v for k, v in stored.items()
           if k in REQUEST_NAMES and not SETTINGS[k].compiled and k != "seed" and v is not None}
    if stored.get("gen_length") is not None:
        out["max_tokens"] = stored["gen_length"]
    return out


def parse_job(body: dict[str, Any], engine: Any, prompt: tuple[int, ...], chat: bool,
              defaults: dict[str, Any] | None = None, max_n: int = MAX_CHOICES, tools: ToolPlan | None = None,
              thinking: bool = False, keep: int = 0) -> Job:
    """The Job of a completions (or, with `chat`, chat completions) body. Fields the body leaves out take
    `defaults` (the model's, `request_defaults`), else the sampler's (greedy decoding) and at most 128 tokens.
    Raises ApiError 400 for a field of the wrong type or n outside [1, max_n], and BadRequest for settings the
    engine would refuse (prompt too long, max_tokens too large, a setting out of range: named as the request
    names it). `thinking`: a chat prompt that opened `<think>` (`ChatPrompt.thinking`); `keep`: its tokens a later
    turn begins with (`ChatPrompt.keep`)."""
    d = defaults or {}
    default_max = min(d.get("max_tokens", DEFAULT_MAX_TOKENS), engine.max_tokens)
    max_tokens = _field(body, "max_tokens", "an integer", default_max)
    if chat:
        max_tokens = _field(body, "max_completion_tokens", "an integer", max_tokens)
    n = _field(body, "n", "an integer", 1)
    if not 1 <= n <= max_n:
        raise ApiError(400, f"n must be in [1, {max_n}], got {n} (this server's limit of choices per request)",
                       param="n", code="invalid_value")
    values, given = _settings(body, d)
    stream = _field(body, "stream", "a boolean", False)
    options = _field(body, "stream_options", "an object", {})
    include_usage = bool(_field(options, "include_usage", "a boolean", False, where="stream_options."))
    try:
        sampling = SamplerConfig(**values)
    except TypeError as e:  # never: the names come from the table
        raise ApiError(400, str(e)) from None
    base = Request(prompt=prompt, max_tokens=max_tokens, sampling=sampling, keep=keep)
    base.check(engine.block_length, getattr(engine, "cache", "auto"), engine.cfg.vocab_size, engine.max_prompt,
               engine.max_tokens, REQUEST_NAMES, given, getattr(engine, "self_speculative", False))
    seeds, stops = _seeds(values.get("seed"), n, sampling.temperature), _stops(body)
    return Job(tuple(dataclasses.replace(base, sampling=sampling.replace(seed=s)) for s in seeds), stops, stream,
               include_usage, tools if tools is not None and tools.parses else None, thinking if chat else None)


