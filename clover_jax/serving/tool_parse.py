"""Tool calls in a model's text: the two forms the Qwen family writes, and when a call is complete.

Every call sits between `<tool_call>` and `</tool_call>`. Inside, either

- JSON (Hermes / Qwen2.5 / Qwen3): `{"name": "add", "arguments": {"a": 1, "b": 2}}` (`arguments` may also be
  a JSON string holding the object), or
- XML (Qwen3.5 / Qwen3-Coder templates)::

      <function=add>
      <parameter=a>
      1
      </parameter>
      </function>

  where a parameter's value is the text between its tags less one newline at each end, converted by the
  tool's JSON-schema type of that parameter: `string` stays as written, `integer`, `number`, `boolean`,
  `object`, `array` and `null` are parsed as JSON, a `boolean` or `null` also from Python's `True`, `False`,
  `None` (the published Qwen3.5 template writes them so into earlier turns); a value that does not parse as its
  type makes the call invalid; an undeclared or untyped parameter is parsed as JSON when it can be, else kept as
  text.

`parse_calls(text, tools)` returns the calls only when every `<tool_call>` in the text is closed, parses,
names a known tool and fits its schema (`tools.check_arguments`); otherwise it returns no calls at all,
so the caller answers the text as plain content (never a malformed call). The content beside valid calls
is the text before the first `<tool_call>`, without trailing whitespace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clover_jax.serving.tools import ToolSpec, check_arguments, schema_types

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_FUNCTION = re.compile(r"^<function=([^>\n]+)>(.*)</function>$", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
# How the published Qwen3.5 / 3.6 chat templates write a boolean or null argument into an earlier turn (jinja's
# `| string`, Python's spelling): a model that reads its history so may write its calls so.
_PYTHON_LITERALS: dict[str, tuple[str, Any]] = {"True": ("boolean", True), "False": ("boolean", False),
                                                 "None": ("null", None)}


@dataclass(frozen=True)
class ParsedCall:
    """One valid call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Parsed:
    """The outcome of `parse_calls`: `calls` empty means "answer `content` as plain text"."""

    content: str
    calls: tuple[ParsedCall, ...] = ()


def parse_calls(text: str, tools: Mapping[str, ToolSpec]) -> Parsed:
    """The tool calls in `text` (see the module docstring); Parsed(text) when there are none or any is invalid."""
    if OPEN not in text:
        return Parsed(text)
    blocks = list(_BLOCK.finditer(text))
    if text.count(OPEN) != len(blocks) or text.count(CLOSE) != len(blocks):
        return Parsed(text)  # an unclosed or stray tag
    calls = []
    for block in blocks:
        call = parse_one(block.group(1), tools)
        if call is None:
            return Parsed(text)
        calls.append(call)
    return Parsed(text[:text.index(OPEN)].rstrip(), tuple(calls))


def parse_one(inner: str, tools: Mapping[str, ToolSpec]) -> ParsedCall | None:
    """The call between one pair of tags (JSON or XML form), or None when it is not a valid call of `tools`."""
    body = inner.strip()
    call = _from_json(body) if body.startswith("{") else _from_xml(body, tools)
    if call is None:
        return None
    spec = tools.get(call.name)
    return call if spec is not None and check_arguments(spec, call.arguments) else None


def _from_json(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    return ParsedCall(obj["name"], args) if isinstance(args, dict) else None


def _from_xml(body: str, tools: Mapping[str, ToolSpec]) -> ParsedCall | None:
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name, inside = match.group(1).strip(), match.group(2)
    spec = tools.get(name)
    if spec is None or _PARAM.sub("", inside).strip():
        return None  # an unknown function, or text outside the parameters
    args: dict[str, Any] = {}
    for p in _PARAM.finditer(inside):
        key = p.group(1).strip()
        if key in args:
            return None
        ok, value = convert_value(_trim_newlines(p.group(2)), schema_types(spec, key))
        if not ok:
            return None
        args[key] = value
    return ParsedCall(name, args)


def _trim_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def convert_value(raw: str, types: list[str]) -> tuple[bool, Any]:
    """(ok, value) of an XML parameter's text for the declared JSON-schema `types` (see the module docstring)."""
    if not types:
        try:
            return True, json.loads(raw)
        except ValueError:
            return True, raw
    if "string" in types:
        return True, raw
    text = raw.strip()
    if text in _PYTHON_LITERALS and _PYTHON_LITERALS[text][0] in types:
        return True, _PYTHON_LITERALS[text][1]
    try:
        value = json.loads(text)
    except ValueError:
        return False, None
    return True, value  # the schema check that follows refuses a value of the wrong type


# --- when generation may end -----------------------------------------------------------------------

def call_end(text: str, released: int, parallel: bool) -> int | None:
    """Where to cut a generation that calls tools, or None to go on.

    `text` is everything decoded so far, of which `text[:released]` was there before the latest block.
    Without `parallel`: the end of the first `</tool_call>` once one is written. With `parallel`: the end of
    the last `</tool_call>` once every opened call is closed, the latest block opened no call and the text does
    not end with the start of one: a model that writes several calls in a row is not cut between them (a
    call opened and closed within one block costs one more block).
    """
    first = text.find(CLOSE)
    if first < 0:
        return None
    if not parallel:
        return first + len(CLOSE)
    if text.count(OPEN) > text.count(CLOSE) or OPEN in text[max(released - len(OPEN) + 1, 0):]:
        return None
    last = text.rindex(CLOSE) + len(CLOSE)
    return None if _opens_at_end(text[last:]) else last


def _opens_at_end(tail: str) -> bool:
    """Whether `tail` ends with a proper prefix of `<tool_call>` (a call may be starting)."""
    stripped = tail.rstrip()
    return any(stripped.endswith(OPEN[:k]) for k in range(1, len(OPEN)))


def pending_open(text: str) -> int:
    """How many characters at the end of `text` could be the start of `<tool_call>` (to hold back when streaming)."""
    for k in range(len(OPEN) - 1, 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
