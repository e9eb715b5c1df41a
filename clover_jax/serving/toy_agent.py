"""A small tool-use task and the agent loop that solves it through an OpenAI-compatible server.

Three tools: `add(a, b)` and `mul(a, b)` on integers 0..OPERANDS-1, and `capital(country)` over a fixed table.
Every question needs exactly one call; the answer after the tool's result is the result itself. The
task serves three uses: `sft_rows` writes block-diffusion SFT transcripts of it in `clover serve`'s
plain chat format (for a model with no chat template, such as the shipped clover-tiny) and `finetune` runs
the recipe on them (`Recipe`, resumable), `run_agent` drives a model through `/v1/chat/completions` with the
`openai` client (execute each call, feed the result back, stop at a plain answer), and the tests and
`benchmarks/agent.py` score it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clover_jax.serving.chat import CallMessage, Message, call_text, plain_prompt
from clover_jax.serving.tools import ToolSpec, parse_tools

_INT = {"type": "integer"}
TOOLS: tuple[dict[str, Any], ...] = (
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": _INT, "b": _INT}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "mul", "parameters": {
        "type": "object", "properties": {"a": _INT, "b": _INT}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}},
)
OPERANDS = 10  # the arithmetic questions' operands are 0..OPERANDS-1 (200 distinct questions per operation)
CAPITALS = {"France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Japan": "Tokyo", "Egypt": "Cairo",
            "Peru": "Lima", "Chile": "Santiago", "Kenya": "Nairobi", "Cuba": "Havana", "Greece": "Athens",
            "Norway": "Oslo", "Poland": "Warsaw"}
PHRASES = {"add": ("What is {a} plus {b}?", "Add {a} and {b}."),
           "mul": ("What is {a} times {b}?", "Multiply {a} by {b}."),
           "capital": ("What is the capital of {country}?", "Name the capital of {country}.")}


@dataclass(frozen=True)
class Task:
    """One question, the call that answers it, and the expected answer."""

    question: str
    name: str
    arguments: dict[str, Any] = field(hash=False)
    answer: str


def execute(name: str, arguments: dict[str, Any]) -> str:
    """Run a tool of the task; its result as text (an error message for a bad call)."""
    try:
        if name == "add":
            return str(int(arguments["a"]) + int(arguments["b"]))
        if name == "mul":
            return str(int(arguments["a"]) * int(arguments["b"]))
        if name == "capital":
            return CAPITALS.get(str(arguments["country"]), "unknown")
    except (KeyError, TypeError, ValueError):
        pass
    return "error: bad call"


def _task(name: str, args: dict[str, Any], phrase: str) -> Task:
    return Task(phrase.format(**args), name, args, execute(name, args))


def split(n_train: int, n_held: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Training and held-out tasks (a third each of add, mul and capital, drawn with `seed`) with no question
    in common: arithmetic questions are all distinct; the capital questions (country x phrasing) are split
    in two, the training ones repeating. ValueError when the arithmetic questions cannot all be distinct."""
    per_op = OPERANDS**2 * 2  # operand pairs x phrasings
    if -(-(n_train + n_held) // 3) > per_op:
        raise ValueError(f"{n_train} + {n_held} questions need more than the {per_op} distinct questions per operation "
                         f"of operands 0..{OPERANDS - 1}")
    rng, seen = random.Random(seed), set()
    capitals = [(c, p) for c in sorted(CAPITALS) for p in PHRASES["capital"]]
    rng.shuffle(capitals)
    n_cap = max(1, n_held // 3)
    held_caps, train_caps = capitals[:n_cap], capitals[n_cap:]

    def draw(n: int, caps: list[tuple[str, str]]) -> list[Task]:
        out: list[Task] = []
        while len(out) < n:
            name = ("add", "mul", "capital")[len(out) % 3]
            if name == "capital":
                country, phrase = caps[len(out) // 3 % len(caps)]
                out.append(_task(name, {"country": country}, phrase))
                continue
            t = _task(name, {"a": rng.randrange(OPERANDS), "b": rng.randrange(OPERANDS)}, rng.choice(PHRASES[name]))
            if t.question not in seen:
                seen.add(t.question)
                out.append(t)
        return out

    held = draw(n_held, held_caps)
    return draw(n_train, train_caps), held


def specs() -> list[ToolSpec]:
    """The task's tools as parsed by `clover serve`."""
    plan = parse_tools({"tools": list(TOOLS)})
    assert plan is not None
    return list(plan.tools)


def sft_rows(train: Sequence[Task]) -> list[dict[str, str]]:
    """Two {"prompt", "response"} SFT rows per task, in the plain chat format with the tools: the question
    answered by the call, and the conversation with the call and its result answered by the result."""
    tools, rows = specs(), []
    for t in train:
        user = Message("user", t.question)
        rows.append({"prompt": plain_prompt([user], tools), "response": " " + call_text(t.name, t.arguments)})
        called = Message("assistant", "", tool_calls=(CallMessage("call_0", t.name, t.arguments),))
        result = Message("tool", t.answer, tool_call_id="call_0")
        rows.append({"prompt": plain_prompt([user, called, result], tools), "response": " " + t.answer})
    return rows


@dataclass
class Episode:
    """One question through the agent loop: the answer it ended with and what it took."""

    task: Task
    answer: str | None = None
    steps: int = 0  # chat completions requested
    calls: int = 0  # tool calls executed
    tokens: list[int] = field(default_factory=list)  # completion tokens per step
    wall_s: float = 0.0

    @property
    def correct(self) -> bool:
        """Whether the final answer is the expected one."""
        return self.answer is not None and self.answer.strip() == self.task.answer


def run_agent(client: Any, model: str, task: Task, *, stream: bool = False, max_steps: int = 3,
              max_tokens: int = 96, extra_body: dict[str, Any] | None = None) -> Episode:
    """Ask `task.question` with the tools through `client` (an `openai.OpenAI`), execute every call the model
    makes and send its result back, until the model answers in text or `max_steps` completions were asked."""
    ep, started = Episode(task), time.monotonic()
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.question}]
    while ep.steps < max_steps:
        ep.steps += 1
        content, calls, tokens = _complete(client, model, messages, stream, max_tokens, extra_body or {})
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
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": execute(call["function"]["name"], args)})
    ep.wall_s = time.monotonic() - started
    return ep


def _complete(client: Any, model: str, messages: list[dict[str, Any]], stream: bool, max_tokens: int,
              extra_body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], int]:
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


@dataclass(frozen=True)
class Recipe:
    """The fine-tuning recipe's settings (block-diffusion SFT on `sft_rows`): rows of `seq_len` tokens filled
    with end tokens, noise levels drawn from [noise_eps, 1], the response's blocks on the grid generation uses."""

    steps: int = 6000  # the cosine schedule's length (a run may stop earlier and resume)
    seq_len: int = 168  # the longest row (a second turn with a capital) is 164 tokens
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 50
    noise_eps: float = 0.3

    def train_config(self, seed: int = 0, ckpt_every: int = 200) -> Any:
        """The `TrainConfig` of this recipe."""
        from clover_jax.training import TrainConfig

        return TrainConfig(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr,
                           warmup_steps=self.warmup_steps, noise_eps=self.noise_eps, seed=seed, dispatch="tiled",
                           log_every=10**9, eval_every=10**9, ckpt_every=ckpt_every)


def sft_dataset(cfg: Any, tokenizer: Any, train: Sequence[Task], seq_len: int, workdir: str, seed: int = 0) -> Any:
    """`sft_rows(train)` written to `workdir/tool_task.jsonl` and read back as a `PairDataset`."""
    import os

    from clover_jax.training import PairDataset

    path = os.path.join(workdir, "tool_task.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in sft_rows(train))
    return PairDataset(path, tokenizer.encode, seq_len, cfg.eos_token_id, cfg.filler_id, seed=seed)


def finetune(cfg: Any, weights: Any, tokenizer: Any, train: Sequence[Task], recipe: Recipe = Recipe(), *,
             stop_at: int | None = None, run_dir: str | None = None, seed: int = 0,
             on_step: Any = None) -> Any:
    """Block-diffusion SFT of `weights` on `sft_rows(train)` with `recipe`, up to step `stop_at` (default: the
    recipe's `steps`); the tuned weights. `run_dir`: keep training checkpoints there and resume from the latest
    (the run's data and schedule continue where it stopped); None trains in a scratch directory."""
    import os
    import tempfile

    import jax
    import jax.numpy as jnp

    from clover_jax.training import train as run_training

    workdir = run_dir or tempfile.mkdtemp(prefix="clover-tools-")
    os.makedirs(workdir, exist_ok=True)
    data = sft_dataset(cfg, tokenizer, train, recipe.seq_len, workdir, seed)
    fresh = jax.tree.map(jnp.copy, weights)  # the training step may donate its inputs
    res = run_training(cfg, recipe.train_config(seed), data, ckpt_dir=os.path.join(workdir, "checkpoints")
                       if run_dir else None, stop_at=stop_at, init_weights=fresh, progress=False,
                       eval_at_end=False, log=lambda line: None, on_step=on_step)
    return res.state.weights


def turn_prompts(held: Sequence[Task]) -> tuple[list[str], list[str]]:
    """The two turns of each task as `clover serve` renders them in the plain format with the tools: the question,
    and the question with the expected call and its result."""
    tools = specs()
    first = [plain_prompt([Message("user", t.question)], tools) for t in held]
    second = [plain_prompt([Message("user", t.question),
                            Message("assistant", "", tool_calls=(CallMessage("call_0", t.name, t.arguments),)),
                            Message("tool", t.answer, tool_call_id="call_0")], tools) for t in held]
    return first, second


def score_turns(weights: Any, cfg: Any, tokenizer: Any, held: Sequence[Task],
                remasking: str = "low_confidence") -> tuple[int, int]:
    """(first turns that are exactly the expected call, second turns that are exactly the result), generated
    greedily one token a pass in `remasking` order with `clover_jax.generate` (no server: a quick check while
    training)."""
    import clover_jax

    first, second = turn_prompts(held)
    one = clover_jax.SamplerConfig(gen_length=64, block_length=32, steps=64, temperature=0.0,
                                   remasking=remasking, seed=0)
    two = clover_jax.SamplerConfig(gen_length=32, block_length=32, steps=32, temperature=0.0,
                                   remasking=remasking, seed=0)
    r1 = clover_jax.generate(weights, cfg, [tokenizer.encode(p) for p in first], one)
    r2 = clover_jax.generate(weights, cfg, [tokenizer.encode(p) for p in second], two)
    calls = sum(tokenizer.decode(ids).strip() == call_text(t.name, t.arguments) for t, ids in zip(held, r1.tokens,
                                                                                                 strict=True))
    answers = sum(tokenizer.decode(ids).strip() == t.answer for t, ids in zip(held, r2.tokens, strict=True))
    return calls, answers
