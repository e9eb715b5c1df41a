"""Rendering a checkpoint's jinja chat template the way HuggingFace transformers does.

`render_chat_template(template, messages, tools=..., add_generation_prompt=...)` renders with a sandboxed
environment, `trim_blocks` and `lstrip_blocks`, a `tojson` filter that keeps non-ASCII text and `<`, `>`, `&`
as they are (jinja's own escapes them for HTML, which would change what the model reads), and a
`raise_exception(message)` function that templates call to refuse a conversation (raised here as
`ChatTemplateError`). Messages are OpenAI-shaped dicts: {"role", "content"}, an assistant's "tool_calls"
with `function.arguments` as a dict (what the Qwen templates iterate over), a tool message's "tool_call_id".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its `raise_exception`) or failed to render."""


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _environment() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # a base dependency, imported when a template is read

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env


def template_syntax_error(template: str) -> str | None:
    """Why `template` does not parse as a jinja chat template (its line and jinja's message), or None when it
    does. Parsing reads no conversation, so a template that parses may still refuse one when rendered."""
    import jinja2

    try:
        _environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], *,
                         tools: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                         **extra: Any) -> str:
    """The prompt text of `messages` (and `tools`, OpenAI function objects, passed as None when empty) under
    `template`; `extra` are further template variables (e.g. `enable_thinking`). Raises ChatTemplateError."""
    import jinja2

    env = _environment()
    try:
        return env.from_string(template).render(messages=list(messages), tools=list(tools) if tools else None,
                                                add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from e
