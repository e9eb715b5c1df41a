"""OpenAI function tools of a chat request: `tools`, `tool_choice`, `parallel_tool_calls`.

`parse_tools(body)` reads the request's tool fields into a `ToolPlan` or raises `FieldError` (HTTP 400,
`param` naming the field):

- `tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}; the name
  is a non-empty string of letters, digits, `_`, `-` and `.`, unique in the list, and `parameters` (default
  an empty object schema) a JSON-schema object (a dict whose `type`, if given, is "object");
- `tool_choice`: "auto" (the default with tools), "none", "required", or
  {"type": "function", "function": {"name": NAME}} naming one of `tools`; given without tools: a 400;
- `parallel_tool_calls`: a boolean (default true): whether one answer may hold several calls.

`check_arguments(spec, arguments)` says whether a call's arguments fit its tool's JSON schema (required
keys present, declared types right, enums respected, no undeclared keys when `additionalProperties` is
false): the parsers keep only calls that fit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clover_jax.serving.field_error import FieldError

CHOICES = ("auto", "none", "required")
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
_NAME = re.compile(TOOL_NAME_PATTERN)


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: its name, description (None if not given) and JSON-schema `parameters`."""

    name: str
    parameters: Mapping[str, Any]
    description: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's {"type": "function", "function": {...}} object (what chat templates take)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tool calling.

    tools: the declared tools, in request order;
    choice: "auto", "none", "required" or "function" (then `forced` names the one function);
    parallel: whether an answer may carry several calls (else generation ends after the first).
    """

    tools: tuple[ToolSpec, ...]
    choice: str = "auto"
    forced: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the model's text is searched for tool calls (every choice but "none")."""
        return bool(self.tools) and self.choice != "none"

    def allowed(self) -> dict[str, ToolSpec]:
        """The tools a call may name: all of them, or only the forced one."""
        return {t.name: t for t in self.tools if self.forced is None or t.name == self.forced}


def parse_tools(body: Mapping[str, Any]) -> ToolPlan | None:
    """The ToolPlan of a chat request, or None when it declares no tools (and no tool_choice). Raises FieldError."""
    tools_value, choice_value = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools_value is None or tools_value == []:
        if choice_value is not None and choice_value != "none":
            raise FieldError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    if not isinstance(tools_value, list):
        raise FieldError("tools must be a list of function tools", "tools")
    tools = tuple(_parse_tool(t, f"tools[{i}]") for i, t in enumerate(tools_value))
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise FieldError(f"tool name {name!r} is declared twice", f"tools[{i}].function.name")
    choice, forced = _parse_choice(choice_value, names)
    return ToolPlan(tools, choice, forced, True if parallel is None else parallel)


def _parse_tool(value: Any, where: str) -> ToolSpec:
    if not isinstance(value, dict):
        raise FieldError(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}", where)
    kind = value.get("type", "function")
    if kind != "function":
        raise FieldError(f"{where}.type must be \"function\"", f"{where}.type")
    function = value.get("function")
    if not isinstance(function, dict):
        raise FieldError(f"{where}.function must be an object with a name", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise FieldError(f"{where}.function.name is required (a non-empty string)", f"{where}.function.name")
    if not _NAME.match(name):
        raise FieldError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'",
                         f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise FieldError(f"{where}.function.description must be a string", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise FieldError(f"{where}.function.parameters must be a JSON-schema object ({{\"type\": \"object\", ...}})",
                         f"{where}.function.parameters")
    for key in ("properties",):
        if key in parameters and not isinstance(parameters[key], dict):
            raise FieldError(f"{where}.function.parameters.{key} must be an object",
                             f"{where}.function.parameters.{key}")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise FieldError(f"{where}.function.parameters.required must be a list of strings",
                         f"{where}.function.parameters.required")
    return ToolSpec(name, parameters, description)


def _parse_choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise FieldError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {value!r}",
                             "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise FieldError("tool_choice must be \"auto\", \"none\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise FieldError(f"tool_choice names the function {name!r}, which is not among tools", "tool_choice")
    return "function", name


# --- checking arguments against a schema ----------------------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                       "boolean": (bool,), "object": (dict,), "array": (list,), "null": (type(None),)}


def fits_type(value: Any, schema: Mapping[str, Any]) -> bool:
    """Whether `value` has a type `schema` allows (its `type`, a name or a list of names; none: any) and,
    when the schema has an `enum`, is one of it. Booleans are never integers or numbers."""
    types = schema.get("type")
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if names is not None:
        def one(name: Any) -> bool:
            kinds = _TYPES.get(name) if isinstance(name, str) else None
            if kinds is None:
                return True  # a type this checker does not know: not refused
            return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not any(one(n) for n in names):
            return False
    enum = schema.get("enum")
    return not isinstance(enum, list) or value in enum


def check_arguments(spec: ToolSpec, arguments: Any) -> bool:
    """Whether `arguments` (the parsed call's) fit `spec.parameters`: an object holding every required key,
    each declared key of a right type, and no undeclared key when `additionalProperties` is false."""
    if not isinstance(arguments, dict):
        return False
    props = spec.parameters.get("properties") or {}
    if any(r not in arguments for r in spec.parameters.get("required", [])):
        return False
    for key, value in arguments.items():
        schema = props.get(key)
        if schema is None:
            if spec.parameters.get("additionalProperties") is False:
                return False
            continue
        if isinstance(schema, dict) and not fits_type(value, schema):
            return False
    return True


def schema_types(spec: ToolSpec, key: str) -> list[str]:
    """The JSON-schema type names declared for argument `key` (empty when undeclared or untyped)."""
    schema = (spec.parameters.get("properties") or {}).get(key)
    types = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(types, str):
        return [types]
    return [t for t in types if isinstance(t, str)] if isinstance(types, list) else []
