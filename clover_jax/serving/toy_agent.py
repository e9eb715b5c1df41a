"""A small tool-use task and the agent loop that solves it through an OpenAI-compatible server.

Three tools: `square(x)` and `double(x)` on integers, and `capital(country)` over a fixed table. A question
needs one call (square, double or a capital) or two, the second on the first's result ("What is twice the
square of 7?": square 7, double 49); the answer after the last result is that result. Every call has one
argument, which the model copies from the question or from the latest tool result. The task serves three uses:
`sft_rows` writes block-diffusion SFT transcripts of it in `clover serve`'s plain chat format (for a model with
no chat template, such as the shipped clover-tiny) and `finetune` runs the recipe on them (`Recipe`,
resumable), `run_agent` drives a model through `/v1/chat/completions` with the `openai` client (execute each
call, feed the result back, stop at a plain answer), and the tests and `benchmarks/agent.py` score it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class Recipe:
    """The fine-tuning recipe's settings (block-diffusion SFT on `sft_rows`): rows of `seq_len` tokens filled
    with end tokens, noise levels drawn from [noise_eps, 1], the response's blocks on the grid generation uses."""

    steps: int = 6000  # the cosine schedule's length (a run may stop earlier and resume)
    seq_len: int = 232  # the longest row (a chain's answer turn, after two calls) is 231 tokens
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 50
    noise_eps: float = 0.3
    lift_digits: bool = True  # start from `lift_digit_embeddings` (the shipped model's digits never trained)

    def train_config(self, seed: int = 0, ckpt_every: int = 200) -> Any:
        """The `TrainConfig` of this recipe."""
        from clover_jax.training import TrainConfig

        return TrainConfig(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr,
                           warmup_steps=self.warmup_steps, noise_eps=self.noise_eps, seed=seed, dispatch="tiled",
                           log_every=10**9, eval_every=10**9, ckpt_every=ckpt_every)


def lift_digit_embeddings(weights: Any, tokenizer: Any) -> Any:
    """`weights` with the input embeddings of the digits 0-9 scaled to the vocabulary's median norm (directions
    kept). Tiny Shakespeare has almost no digits, so the shipped model's digit embeddings never left their
    initialization (norm about 0.24 against a median 0.55): a digit's identity starts out weaker in the residual
    stream than any word's, and the task is mostly copying numbers."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    table = np.asarray(weights.embed, np.float32).copy()
    norms = np.linalg.norm(table, axis=1)
    digits = sorted({tokenizer.encode(str(d))[-1] for d in range(10)})
    table[digits] *= (np.median(norms) / norms[digits])[:, None]
    return dataclasses.replace(weights, embed=jnp.asarray(table, weights.embed.dtype))


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
    start = lift_digit_embeddings(weights, tokenizer) if recipe.lift_digits else weights
    fresh = jax.tree.map(jnp.copy, start)  # the training step may donate its inputs
    res = run_training(cfg, recipe.train_config(seed), data, ckpt_dir=os.path.join(workdir, "checkpoints")
                       if run_dir else None, stop_at=stop_at, init_weights=fresh, progress=False,
                       eval_at_end=False, log=lambda line: None, on_step=on_step)
    return res.state.weights


def score_turns(weights: Any, cfg: Any, tokenizer: Any, held: Sequence[Task],
                remasking: str = "low_confidence") -> tuple[tuple[int, int], tuple[int, int]]:
    """((call turns exactly the expected call, call turns), (answer turns exactly the answer, answer turns)) over
    every turn of `held` (`turns`, the conversation given up to it), generated greedily one token a pass in
    `remasking` order with `clover_jax.generate` from the prompts `clover serve` renders (no server: a quick
    check while training)."""
    import clover_jax

    tools, out = specs(), []
    every = [turn for task in held for turn in turns(task)]
    for is_call, length in ((True, 64), (False, 32)):
        group = [turn for turn in every if turn.is_call == is_call]
        sampler = clover_jax.SamplerConfig(gen_length=length, block_length=32, steps=length, temperature=0.0,
                                           remasking=remasking, seed=0)
        res = clover_jax.generate(weights, cfg, [tokenizer.encode(plain_prompt(t.messages, tools)) for t in group],
                                  sampler)
        out.append((sum(tokenizer.decode(ids).strip() == t.response for t, ids in zip(group, res.tokens, strict=True)),
                    len(group)))
    return out[0], out[1]
