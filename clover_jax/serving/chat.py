"""Chat messages to prompt text for `/v1/chat/completions`.

A single user message goes through the tokenizer's chat template when it has one
(`Tokenizer.apply_chat_template` takes exactly one user turn). Anything else (several messages, a
system prompt, a tokenizer without a template) uses the plain format, one line per message and an
open assistant turn at the end:

    system: You are terse.
    user: Hi
    assistant:
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clover_jax.tokenizer import Tokenizer


class MessageError(ValueError):
    """A `messages` value that is not a list of {role, content} objects; `param` names the bad field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_messages(messages: Any) -> list[tuple[str, str]]:
    """(role, content) pairs of an OpenAI `messages` list. Content may be a string, null (empty) or a
    list of parts of which the {"type": "text", "text": ...} ones are joined. Raises MessageError."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list of {role, content} objects", "messages")
    return [_parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _parse_message(message: Any, where: str) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise MessageError(f"{where} must be an object with role and content", where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise MessageError(f"{where}.role must be a non-empty string", f"{where}.role")
    return role, _content_text(message.get("content"), f"{where}.content")


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise MessageError(f"{where}[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                   f"{where}[{i}]")
            texts.append(part["text"])
        return "".join(texts)
    raise MessageError(f"{where} must be a string or a list of text parts", where)


def plain_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The plain format: "role: content\\n" per message, then "assistant:"."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


def render_messages(tokenizer: Tokenizer, messages: Sequence[tuple[str, str]]) -> str:
    """The prompt text of a conversation: the chat template for one user message when the tokenizer
    has one, else `plain_prompt`."""
    if len(messages) == 1 and messages[0][0] == "user":
        templated = tokenizer.apply_chat_template(messages[0][1])
        if templated is not None:
            return templated
    return plain_prompt(messages)
