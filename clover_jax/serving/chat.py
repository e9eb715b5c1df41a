"""Chat messages (and tools) to prompt text for `/v1/chat/completions`.

`parse_messages` reads OpenAI's `messages`: system / user / assistant / tool turns, an assistant turn's
`tool_calls` ({"id", "type": "function", "function": {"name", "arguments"}}, arguments a JSON object or a
string holding one) and a tool turn's `tool_call_id` (required).

`render_messages` gives the prompt text:

- a tokenizer with a jinja chat template (`chat_template`, a checkpoint's `chat_template.jinja` or
  `tokenizer_config.json`) renders the whole conversation and the tools through it, as transformers'
  `apply_chat_template(messages, tools=..., add_generation_prompt=True)` does (assistant calls carry their
  arguments as objects, which the Qwen templates expect);
- otherwise a single user turn without tools goes through `Tokenizer.apply_chat_template` when it gives a
  text, and anything else uses the plain format: the tools first (a `tools:` line, then one line per tool,
  `name(arg: type, optional?: type) - description`: a compact signature, since a tool's JSON schema costs a
  small vocabulary about a hundred tokens), then one line per message and an open assistant turn::

      tools:
      add(a: integer, b: integer) - Add two integers.
      system: You are terse.
      user: What is 2 plus 3?
      assistant: <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>
      tool: <tool_response>5</tool_response>
      assistant:

  An assistant turn's calls follow its content in the JSON form, a tool turn's content is wrapped in
  `<tool_response>` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clover_jax.serving.field_error import FieldError
from clover_jax.serving.tool_parse import CLOSE, OPEN
from clover_jax.serving.tools import ToolSpec
from clover_jax.tokenizer import Tokenizer
from clover_jax.tokenizer.chat_template import render_chat_template


@dataclass(frozen=True)
class CallMessage:
    """A tool call an assistant turn made: its id, the function's name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Message:
    """One chat turn. `tool_calls`: an assistant's calls; `tool_call_id`: which call a tool turn answers;
    `reasoning_content`: an assistant's reasoning as this server returned it apart from its answer (the Qwen3.5 /
    3.6 templates write it back between `<think>` tags in the turns after the last question)."""

    role: str
    content: str
    tool_calls: tuple[CallMessage, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def as_template(self) -> dict[str, Any]:
        """The message as a chat template takes it (arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def parse_messages(messages: Any) -> list[Message]:
    """The turns of an OpenAI `messages` list. Content may be a string, null (empty) or a list of parts
    of which the {"type": "text", "text": ...} ones are joined. Raises FieldError."""
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages must be a non-empty list of {role, content} objects", "messages")
    return [_parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _parse_message(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise FieldError(f"{where} must be an object with role and content", where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise FieldError(f"{where}.role must be a non-empty string", f"{where}.role")
    content = _content_text(message.get("content"), f"{where}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise FieldError(f"{where}.name must be a string", f"{where}.name")
    calls: tuple[CallMessage, ...] = ()
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise FieldError(f"{where}.tool_calls is only allowed in assistant messages", f"{where}.tool_calls")
        calls = _parse_calls(message["tool_calls"], f"{where}.tool_calls")
    call_id = message.get("tool_call_id")
    if role == "tool" and (not isinstance(call_id, str) or not call_id):
        raise FieldError(f"{where}.tool_call_id is required in tool messages (the id of the call answered)",
                         f"{where}.tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise FieldError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise FieldError(f"{where}.reasoning_content must be a string, in an assistant message",
                         f"{where}.reasoning_content")
    return Message(role, content, calls, call_id if role == "tool" else None, name, reasoning)


def _parse_calls(value: Any, where: str) -> tuple[CallMessage, ...]:
    if not isinstance(value, list):
        raise FieldError(f"{where} must be a list of tool calls", where)
    out = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise FieldError(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             "\"arguments\"}}", at)
        if call.get("type", "function") != "function":
            raise FieldError(f"{at}.type must be \"function\"", f"{at}.type")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise FieldError(f"{at}.id must be a string", f"{at}.id")
        args = function.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise FieldError(f"{at}.function.arguments is not valid JSON", f"{at}.function.arguments") from None
        if not isinstance(args, dict):
            raise FieldError(f"{at}.function.arguments must be a JSON object (or a string holding one)",
                             f"{at}.function.arguments")
        out.append(CallMessage(call_id, function["name"], args))
    return tuple(out)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise FieldError(f"{where}[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                 f"{where}[{i}]")
            texts.append(part["text"])
        return "".join(texts)
    raise FieldError(f"{where} must be a string or a list of text parts", where)


# --- the plain format ------------------------------------------------------------------------------

def tool_line(spec: ToolSpec) -> str:
    """One tool in the plain format: `name(arg: type, optional?: type) - description`."""
    props = spec.parameters.get("properties") or {}
    required = set(spec.parameters.get("required", []))
    args = []
    for key, schema in props.items():
        types = schema.get("type") if isinstance(schema, dict) else None
        kind = "|".join(types) if isinstance(types, list) else types if isinstance(types, str) else "any"
        args.append(f"{key}{'' if key in required else '?'}: {kind}")
    line = f"{spec.name}({', '.join(args)})"
    return f"{line} - {spec.description}" if spec.description else line


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call in the JSON form, between its tags."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CLOSE}"


def _plain_turn(m: Message | tuple[str, str]) -> str:
    if isinstance(m, tuple):
        m = Message(*m)
    if m.role == "tool":
        return f"tool: <tool_response>{m.content}</tool_response>\n"
    return f"{m.role}: {m.content}{''.join(call_text(c.name, c.arguments) for c in m.tool_calls)}\n"


def plain_prompt(messages: Sequence[Message | tuple[str, str]], tools: Sequence[ToolSpec] = ()) -> str:
    """The plain format (see the module docstring): the tools, a line per message, then "assistant:"."""
    head = "tools:\n" + "".join(tool_line(t) + "\n" for t in tools) if tools else ""
    return head + "".join(_plain_turn(m) for m in messages) + "assistant:"


def render_messages(tokenizer: Tokenizer, messages: Sequence[Message], tools: Sequence[ToolSpec] = (),
                    template_vars: dict[str, Any] | None = None, generation_prompt: bool = True) -> str:
    """The prompt text of a conversation and its tools (see the module docstring); `template_vars`: further
    variables of the chat template (a request's `chat_template_kwargs`, e.g. `enable_thinking`);
    `generation_prompt` False: without the assistant's opening (the text a next turn's prompt begins with; the
    plain format then ends before "assistant:"). Raises ChatTemplateError when the checkpoint's template refuses the
    conversation."""
    template = getattr(tokenizer, "chat_template", None)
    extra = dict(template_vars or {})
    if isinstance(template, str) and template:
        return render_chat_template(template, [m.as_template() for m in messages],
                                    tools=[t.as_openai() for t in tools] or None,
                                    add_generation_prompt=generation_prompt, **extra)
    if not tools and len(messages) == 1 and messages[0].role == "user" and not messages[0].tool_calls:
        templated = tokenizer.apply_chat_template(messages[0].content, **extra)
        if templated is not None:
            return templated if generation_prompt else ""  # (one turn: no next one renders it alike)
    text = plain_prompt(messages, tools)
    return text if generation_prompt else text.removesuffix("assistant:")
