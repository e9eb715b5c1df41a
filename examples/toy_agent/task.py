"""The toy tool task and its data: the three tools and what they return, the questions (`split`), the
completions each question takes (`turns`) and the SFT rows written from them (`sft_rows`).

A task's plan is the tools it needs, in order: `square`, `double`, `capital`, or a chain of the two arithmetic
tools, the second on the first's result. Everything here is deterministic (`split` shuffles with its seed).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clover_jax.serving.chat import CallMessage, Message, call_text, plain_prompt
from clover_jax.serving.tools import ToolSpec, parse_tools

_X = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS: tuple[dict[str, Any], ...] = (
    {"type": "function", "function": {"name": "square", "parameters": _X}},
    {"type": "function", "function": {"name": "double", "parameters": _X}},
    {"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}},
)
OPERANDS = 100  # the arithmetic questions' operands are 0..OPERANDS-1
CAPITALS = {"France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Japan": "Tokyo", "Egypt": "Cairo",
            "Peru": "Lima", "Chile": "Santiago", "Kenya": "Nairobi", "Cuba": "Havana", "Greece": "Athens",
            "Norway": "Oslo", "Poland": "Warsaw"}
# the questions' plans (the tools they need, in order) and two phrasings of each
PHRASES: dict[tuple[str, ...], tuple[str, str]] = {
    ("square",): ("What is the square of {x}?", "Square {x}."),
    ("double",): ("What is twice {x}?", "Double {x}."),
    ("square", "double"): ("What is twice the square of {x}?", "Square {x}, then double it."),
    ("double", "square"): ("What is the square of twice {x}?", "Double {x}, then square it."),
    ("capital",): ("What is the capital of {country}?", "Name the capital of {country}."),
}


@dataclass(frozen=True)
class Call:
    """One tool call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class Task:
    """One question, the calls that answer it (in order) and the expected answer."""

    question: str
    calls: tuple[Call, ...]
    answer: str


@dataclass(frozen=True)
class Turn:
    """One completion of a task's conversation: the messages so far and the expected response (a call's text
    or the answer)."""

    messages: tuple[Message, ...]
    response: str

    @property
    def is_call(self) -> bool:
        """Whether the expected response is a tool call."""
        return self.response.startswith("<tool_call>")


def execute(name: str, arguments: dict[str, Any]) -> str:
    """Run a tool of the task; its result as text (an error message for a bad call)."""
    try:
        if name == "square":
            return str(int(arguments["x"]) ** 2)
        if name == "double":
            return str(2 * int(arguments["x"]))
        if name == "capital":
            return CAPITALS.get(str(arguments["country"]), "unknown")
    except (KeyError, TypeError, ValueError):
        pass
    return "error: bad call"


def make_task(plan: tuple[str, ...], arguments: dict[str, Any], phrase: str) -> Task:
    """The task of `phrase` filled with `arguments`: `plan`'s tools called in order, each on the last result."""
    calls, args, result = [], dict(arguments), ""
    for name in plan:
        calls.append(Call(name, args))
        result = execute(name, args)
        args = {"x": int(result)} if name != "capital" else {}
    return Task(phrase.format(**arguments), tuple(calls), result)


def split(n_train: int, n_held: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Training and held-out tasks with no question in common, the plans taken in turn (square, double, the
    two chains, capital). Each plan's questions (operand or country x phrasing) are shuffled with `seed`;
    the held-out ones are taken first, the training ones cycle through the rest (the 20 capital questions
    left repeat). ValueError when a plan has too few questions to hold out."""
    plans = list(PHRASES)
    rng, pools = random.Random(seed), {}
    for plan in plans:
        if plan == ("capital",):
            pool = [make_task(plan, {"country": c}, p) for c in sorted(CAPITALS) for p in PHRASES[plan]]
        else:
            pool = [make_task(plan, {"x": x}, p) for x in range(OPERANDS) for p in PHRASES[plan]]
        rng.shuffle(pool)
        pools[plan] = pool
    held = []
    for i in range(n_held):
        pool = pools[plans[i % len(plans)]]
        if len(pool) < 2:
            raise ValueError(f"{n_held} held-out questions leave no training question of plan {plans[i % len(plans)]}")
        held.append(pool.pop())
    train = []
    for i in range(n_train):
        pool = pools[plans[i % len(plans)]]
        train.append(pool[i // len(plans) % len(pool)])
    return train, held


def specs() -> list[ToolSpec]:
    """The task's tools as parsed by `clover serve`."""
    plan = parse_tools({"tools": list(TOOLS)})
    assert plan is not None
    return list(plan.tools)


def turns(task: Task) -> list[Turn]:
    """The completions `task` takes, one per call and one for the answer, each with the conversation before it
    as `run_agent` holds it (the calls made, their results sent back)."""
    messages, out = [Message("user", task.question)], []
    for i, call in enumerate(task.calls):
        out.append(Turn(tuple(messages), call_text(call.name, call.arguments)))
        messages.append(Message("assistant", "", tool_calls=(CallMessage(f"call_{i}", call.name, call.arguments),)))
        messages.append(Message("tool", execute(call.name, call.arguments), tool_call_id=f"call_{i}"))
    out.append(Turn(tuple(messages), task.answer))
    return out


def sft_rows(train: Sequence[Task]) -> list[dict[str, str]]:
    """One {"prompt", "response"} SFT row per turn of each task (`turns`), in the plain chat format with the
    tools, as `clover serve` renders the conversation for a model with no chat template."""
    tools = specs()
    return [{"prompt": plain_prompt(turn.messages, tools), "response": " " + turn.response}
            for task in train for turn in turns(task)]
