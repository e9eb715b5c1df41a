"""Thinking: the reasoning a Qwen3.5 / 3.6-style model writes before its answer, apart from the answer.

Qwen3.5 and 3.6 chat templates take `enable_thinking`: on (their default), the model first writes its reasoning and
closes it with `</think>` (the template may have opened `<think>` in the prompt already); off, the template closes
an empty `<think></think>` itself and the model answers at once. As vLLM's Qwen3 reasoning parser does, a chat
completion returns the text before `</think>` as `reasoning_content` and the rest as `content`; a completion that
never closes its reasoning is all content (a model that does not think).

`split(text, final, opened)` is that rule on the text generated so far: a completion thinks when it opens with
`<think>` or its prompt opened one (`opened`); its reasoning streams as `reasoning_content` while it is written (a
tail that may be half of `</think>` held back), its answer as `content`.
"""

from __future__ import annotations

from typing import NamedTuple

OPEN, CLOSE = "<think>", "</think>"


class Split(NamedTuple):
    """A completion's text so far, as reasoning and content (both releasable now)."""

    reasoning: str
    content: str


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered chat prompt ends inside an open `<think>` (the template started the reasoning)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def split(text: str, final: bool, opened: bool = False) -> Split:
    """(reasoning, content) of a completion's `text` so far; `final`: the completion ended; `opened`: the prompt
    opened `<think>` (the completion starts inside the reasoning). A completion that thinks (it opens with `<think>`,
    or the prompt did): reasoning is what comes before `</think>`, content what comes after it (leading newlines
    dropped); while it runs, a tail that may be half of `</think>` is held back. Any other completion is all
    content (a first few characters that may still become `<think>` held back while it runs)."""
    body, thinks = text, opened
    if body.startswith(OPEN):
        body, thinks = body[len(OPEN):], True
    elif not final and not opened and OPEN.startswith(body):
        return Split("", "")  # may still open a reasoning
    if not thinks:
        return Split("", text)
    end = body.find(CLOSE)
    if end >= 0:
        return Split(body[:end], body[end + len(CLOSE):].lstrip("\n"))
    return Split(body if final else body[:len(body) - _held(body, CLOSE)], "")
