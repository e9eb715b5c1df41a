"""The agent loop over the `openai` client and its score: `run_agent` asks a task's question with the tools
through an OpenAI-compatible server (`clover serve`), executes every call the model makes and sends its result
back until the model answers in text; the `Episode` it returns says whether the answer is right and whether it
came through exactly the task's calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from examples.toy_agent.task import TOOLS, Call, Task, execute


@dataclass
class Episode:
    """One question through the agent loop: the answer it ended with and what it took."""

    task: Task
    answer: str | None = None
    steps: int = 0  # chat completions requested
    calls: int = 0  # tool calls executed
    made: list[Call] = field(default_factory=list)  # those calls, in order
    tokens: list[int] = field(default_factory=list)  # completion tokens per step
    wall_s: float = 0.0

    @property
    def correct(self) -> bool:
        """Whether the final answer is the expected one."""
        return self.answer is not None and self.answer.strip() == self.task.answer

    @property
    def through_the_tools(self) -> bool:
        """Whether the answer is right and came by exactly the task's calls (not guessed, not memorized)."""
        return self.correct and tuple(self.made) == self.task.calls


def run_agent(client: Any, model: str, task: Task, *, stream: bool = False, max_steps: int = 4,
              max_tokens: int = 96, extra_body: dict[str, Any] | None = None,
              on_chunk: Callable[[Any], None] | None = None) -> Episode:
    """Ask `task.question` with the tools through `client` (an `openai.OpenAI`), execute every call the model
    makes and send its result back, until the model answers in text or `max_steps` completions were asked.
    `on_chunk(chunk)`: called with every chunk of every streamed completion as it arrives (needs `stream`)."""
    if on_chunk is not None and not stream:
        raise ValueError("on_chunk needs stream=True: a whole completion has no chunks")
    ep, started = Episode(task), time.monotonic()
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.question}]
    while ep.steps < max_steps:
        ep.steps += 1
        content, calls, tokens = _complete(client, model, messages, stream, max_tokens, extra_body or {}, on_chunk)
        ep.tokens.append(tokens)
        if not calls:
            ep.answer = content
            break
        messages.append({"role": "assistant", "content": content or None, "tool_calls": calls})
        for call in calls:
            ep.calls += 1
            try:
                args = json.loads(call["function"]["arguments"])
            except ValueError:
                args = {}
            ep.made.append(Call(call["function"]["name"], args))
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": execute(call["function"]["name"], args)})
    ep.wall_s = time.monotonic() - started
    return ep


def _complete(client: Any, model: str, messages: list[dict[str, Any]], stream: bool, max_tokens: int,
              extra_body: dict[str, Any], on_chunk: Callable[[Any], None] | None = None
              ) -> tuple[str, list[dict[str, Any]], int]:
    """(content, tool calls as OpenAI dicts, completion tokens) of one chat completion."""
    kwargs = {"model": model, "messages": messages, "tools": list(TOOLS), "max_tokens": max_tokens,
              "temperature": 0.0, "extra_body": extra_body}
    if not stream:
        out = client.chat.completions.create(**kwargs)
        msg = out.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                 for c in msg.tool_calls or []]
        return msg.content or "", calls, out.usage.completion_tokens
    content, slots, tokens = "", {}, 0
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if on_chunk is not None:
            on_chunk(chunk)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = slots.setdefault(tc.index, {"id": "", "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                slot["id"] += tc.id or ""
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
    return content, [slots[i] for i in sorted(slots)], tokens
