"""One request's choices in the engine: engine events in, released text, stops, tool calls and deadlines out.

Each choice is one engine `Request`. The engine calls back from its own thread once per committed
block; `loop.call_soon_threadsafe` moves each `Event` onto the request's asyncio queue. Text is
decoded host-side from all of a choice's tokens; stop strings are matched there too (the engine is
then told to cancel the row), and a stream holds back the last `len(longest stop) - 1` characters
(and a trailing U+FFFD that may be half a UTF-8 character) until the next block, so a stop string
spanning two blocks never leaks. With tools, a choice's text from its first `<tool_call>` on is held
back, and the calls it ends with become `Choice.calls` (`clover_jax.serving.tool_parse`). A chat choice's
reasoning (the text before `</think>` of a model that thinks) is released apart from its answer, as
`Choice.reasoning` (`clover_jax.serving.reasoning`); tool calls are read from the answer only.

Deadline: once a `Run`'s deadline passes, every unfinished choice ends with finish_reason "length"
(the text generated so far, as when max_tokens runs out) and `Run.timed_out` is set; its engine rows
are cancelled, so they free at the next block boundary (a request still queued leaves the queue at
once). `clover_jax.serving.responses` renders a `Run` as JSON or SSE.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from clover_jax.serving.guard import Access
from clover_jax.serving.http_request import Job
from clover_jax.serving.metrics import Metrics
from clover_jax.serving.reasoning import split as split_reasoning
from clover_jax.serving.requests import Event
from clover_jax.serving.scaffold import CallForms, CallLayout, drafted_tool, opening
from clover_jax.serving.tool_parse import OPEN, ParsedCall, call_end, parse_calls, pending_open
from clover_jax.serving.tools import ToolPlan
from clover_jax.tokenizer import Tokenizer


class EngineFailure(Exception):
    """The engine ended a choice with finish_reason "error" (its device program failed)."""


class Released(NamedTuple):
    """What one event released of a choice: answer text and reasoning text (either may be empty)."""

    content: str
    reasoning: str = ""


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


@dataclass
class Choice:
    """One choice's progress: its tokens so far and the text released to the client."""

    index: int
    rid: int | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stopped: bool = False  # a stop string matched (the engine row still runs until cancelled)
    used: int | None = None  # with a stop match: the tokens the returned text came from
    passes: int = 0  # forward passes the engine reported so far
    queued_s: float = 0.0  # how long it waited for a row (the engine's report)
    cached: int = 0  # prompt tokens the engine's prefix cache gave it
    seen: int = 0  # characters decoded before the latest event
    calls: tuple[tuple[str, ParsedCall], ...] = ()  # (id, call) of the tool calls it ended with
    thinking: bool | None = None  # a chat choice (reasoning apart); True: its prompt opened `<think>`
    reasoning: str = ""  # the reasoning released so far (`text`: the answer)
    hold: bool = False  # release nothing until it ends (a call `tool_choice` requires may replace the whole draft)
    gen: int = 0  # which of its engine requests runs now (a rewrite is the next); older ones' events are dropped
    layout: CallLayout | None = None  # while its call is rewritten into a scaffold: the call's layout
    passes_before: int = 0  # passes of its earlier engine requests

    @property
    def done(self) -> bool:
        """Whether nothing more will be released."""
        return self.finish_reason is not None

    def apply(self, event: Event, decode: Callable[[list[int]], str], stops: Sequence[str],
              tools: ToolPlan | None = None) -> Released:
        """Take one engine event; returns the text newly released (cut before a stop string; while the
        choice runs, less the tail a stop string or a UTF-8 character could still span), its answer and, for a chat
        choice of a model that thinks, its reasoning apart.

        With `tools` (a plan that parses calls): the choice also ends once its tool calls are complete
        (`tool_parse.call_end`), no text from the first `<tool_call>` on is released while it runs, and at
        the end valid calls become `calls` with finish_reason "tool_calls" (the text is then the content
        before them); invalid ones leave the whole text as content."""
        self.tokens.extend(event.tokens)
        full = decode(self.tokens)
        cut = find_stop(full, stops)
        if tools is not None:
            end_call = call_end(full, self.seen, tools.parallel)
            if end_call is not None and (cut is None or end_call <= cut):
                cut = end_call
        self.seen = len(full)
        if cut is not None:
            self.finish_reason, self.stopped = "stop", True
            # the fewest tokens whose text reaches the cut: what usage counts
            self.used = next(k for k in range(len(self.tokens) + 1) if len(decode(self.tokens[:k])) >= cut)
            return self._end(full[:cut], tools)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            return self._end(full, tools)
        end = len(full) - (max(map(len, stops)) - 1 if stops else 0)
        while end > 0 and full[end - 1] == "\ufffd":
            end -= 1
        upto = full[:max(end, 0)]
        reasoning, answer = self._split(upto, final=False)
        if self.hold:
            return Released("")
        if tools is not None:  # hold back a call (or what may become one), and the whitespace before it
            answer = answer.split(OPEN, 1)[0]
            answer = answer[:len(answer) - pending_open(answer)].rstrip()
        return self._release(reasoning, answer)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of a chat choice's text (`reasoning.split`); ("", text) of a completion's."""
        if self.thinking is None:
            return "", text
        return split_reasoning(text, final, self.thinking)

    def _end(self, text: str, tools: ToolPlan | None) -> Released:
        """Release the rest of a finished choice: its calls when `tools` finds valid ones in its answer, else its
        text."""
        reasoning, answer = self._split(text, final=True)
        if tools is not None and self.finish_reason in ("stop", "length"):
            parsed = parse_calls(answer, tools.allowed())
            if parsed.calls:
                self.calls = tuple((f"call_{uuid.uuid4().hex[:24]}", c) for c in parsed.calls)
                self.finish_reason = "tool_calls"
                return self._release(reasoning, parsed.content)
        return self._release(reasoning, answer)

    def finish_call(self, decode: Callable[[list[int]], str], forms: CallForms) -> Released:
        """End a rewritten call (its engine request finished): the call read from its layout (`CallForms.read`),
        with the answer's text before it as content; a malformed one leaves its text as content."""
        layout = self.layout
        assert layout is not None
        call = forms.read(layout, self.tokens)
        self.used = min(layout.end, len(self.tokens))
        reasoning, answer = self._split(decode(self.tokens[:self.used]), final=True)
        if call is None:
            self.finish_reason = "stop"
            return self._release(reasoning, answer)
        self.calls = ((f"call_{uuid.uuid4().hex[:24]}", call),)
        self.finish_reason = "tool_calls"
        return self._release(reasoning, answer.split(OPEN, 1)[0].rstrip())

    def _release(self, reasoning: str, answer: str) -> Released:
        out = Released(answer[len(self.text):], reasoning[len(self.reasoning):])
        self.text += out.content
        self.reasoning += out.reasoning
        return out


class Run:
    """The choices of one HTTP request in the engine: submits them, turns their events into text.

    `deadline` (time.monotonic() seconds, None: none): once it passes, `deltas` ends every unfinished
    choice with finish_reason "length" and cancels its engine row (`timed_out` becomes True).
    `metrics` (if given) counts every generation submitted and every final engine event."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, job: Job, loop: asyncio.AbstractEventLoop,
                 started: float, deadline: float | None = None, metrics: Metrics | None = None,
                 forms: CallForms | None = None) -> None:
        self.engine, self.tokenizer, self.job, self.loop = engine, tokenizer, job, loop
        self.forms = forms  # with tools: rewrite a call the model did not write whole into the canvas
        self.queue: asyncio.Queue[tuple[int, int, Event] | None] = asyncio.Queue()
        # a call `tool_choice` requires may replace a draft whole: nothing of it is released before it ends
        hold = forms is not None and job.tools is not None and job.tools.choice in ("required", "function")
        self.choices = [Choice(i, thinking=job.reasoning, hold=hold) for i in range(len(job.requests))]
        self.started = started
        self.deadline = deadline
        self.metrics = metrics
        self.first_block: float | None = None
        self.timed_out = False

    def _on_event(self, index: int, gen: int = 0) -> Callable[[Event], None]:
        loop, queue, metrics = self.loop, self.queue, self.metrics

        def on_event(event: Event) -> None:  # runs on the engine thread
            # a closed loop means nobody waits for this request any more; never raise into the engine
            with contextlib.suppress(Exception):
                if metrics is not None and event.finish_reason is not None:
                    metrics.count_ended(event.finish_reason)
                loop.call_soon_threadsafe(queue.put_nowait, (index, gen, event))

        return on_event

    def submit(self) -> None:
        """Submit every choice; if one is refused, cancel those already in and re-raise."""
        try:
            for choice, req in zip(self.choices, self.job.requests, strict=True):
                choice.rid = self.engine.submit(req, self._on_event(choice.index, choice.gen))
                if self.metrics is not None:
                    self.metrics.count_submitted()
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Cancel every unfinished choice in the engine (idempotent) and wake `deltas`."""
        for c in self.choices:
            if not c.done:
                c.finish_reason = "cancelled"
                if c.rid is not None:
                    self.engine.cancel(c.rid)
        self.queue.put_nowait(None)

    @property
    def done(self) -> bool:
        """Whether every choice has finished."""
        return all(c.done for c in self.choices)

    async def _next(self) -> tuple[int, int, Event] | None:
        """The next event; TimeoutError once the deadline passed."""
        if self.deadline is None:
            return await self.queue.get()
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return await asyncio.wait_for(self.queue.get(), left)

    def expire(self) -> list[tuple[Choice, Released]]:
        """The deadline passed: end every unfinished choice with "length" (releasing all its text so far)
        and cancel its engine row; (choice, released text) of each."""
        self.timed_out = True
        out = []
        for c in self.choices:
            if not c.done and c.layout is not None:  # a call being rewritten: the text before it was released
                c.finish_reason = "length"
                out.append((c, Released("")))
            elif not c.done:
                out.append((c, c.apply(Event((), "length", c.passes, c.queued_s), self.tokenizer.decode,
                                       self.job.stops, self.job.tools)))
                if c.rid is not None:
                    self.engine.cancel(c.rid)  # its row frees at the next block boundary
        if self.metrics is not None:
            self.metrics.count_timeout()
        return out

    async def deltas(self) -> AsyncIterator[tuple[Choice, Released]]:
        """(choice, newly released text) after every event, until all choices are done (or the deadline
        passed: then one last (choice, text) per choice it ended)."""
        while not self.done:
            try:
                item = await self._next()
            except TimeoutError:
                for pair in self.expire():
                    yield pair
                return
            if item is None:
                continue
            index, gen, event = item
            choice = self.choices[index]
            if choice.done or gen != choice.gen:  # e.g. the "cancelled" event after a stop string matched
                continue
            choice.passes = choice.passes_before + event.passes
            if choice.layout is None:  # (a rewrite's prompt is the draft's: its queue time and cache are not news)
                choice.queued_s, choice.cached = event.queued_s, event.cached_tokens
            if self.first_block is None and (event.tokens or event.finish_reason is not None):
                self.first_block = time.monotonic()
            if event.finish_reason == "error":
                choice.finish_reason = "error"
                raise EngineFailure(f"the engine failed while generating choice {index} (request {choice.rid})")
            if choice.layout is not None:  # a call being rewritten: nothing to release until it ends
                choice.tokens.extend(event.tokens)
                if event.finish_reason == "cancelled":
                    choice.finish_reason = "cancelled"
                    yield choice, Released("")
                elif event.finish_reason is not None:
                    delta = choice.finish_call(self.tokenizer.decode, self.forms)
                    if self.metrics is not None:
                        self.metrics.count_tool_call("scaffold", bool(choice.calls))
                    yield choice, delta
                continue
            before = dataclasses.replace(choice, tokens=list(choice.tokens))
            delta = choice.apply(event, self.tokenizer.decode, self.job.stops, self.job.tools)
            if choice.stopped and event.finish_reason is None and choice.rid is not None:
                self.engine.cancel(choice.rid)  # free the row at the next block boundary
            if choice.done and self._rewrite(choice, before, event):
                continue
            yield choice, delta

    def _rewrite(self, choice: Choice, before: Choice, event: Event) -> bool:
        """After a choice's draft ended: when its tools ask for a call and the draft's answer holds none that is whole
        and valid (it opened a call that does not parse, or `tool_choice` requires one), write the call's frame into
        the canvas (`scaffold.CallForms.frame`, its values sized from the draft) and submit that as the choice's next
        engine request; `before`: the choice as it was before the draft's last event, which it is set back to
        (nothing of the draft's end was released; a choice whose `tool_choice` requires a call released nothing of
        its draft at all). False (the draft stands, as ended) when no call is needed or the rewrite cannot run (no
        scaffold, a layout past max_tokens or past the engine's token classes, the engine refusing it)."""
        tools, forms = self.job.tools, self.forms
        if tools is None or choice.finish_reason not in ("stop", "length", "tool_calls"):
            return False
        decode = self.tokenizer.decode
        draft = list(choice.tokens if choice.used is None else choice.tokens[:choice.used])
        full = decode(draft)
        _, answer = choice._split(full, final=True)
        k = opening(draft, decode, len(full) - len(answer))  # a call opened in the answer, not in the reasoning
        forced = tools.choice in ("required", "function")
        if choice.calls or (k is None and not forced):
            if k is not None and self.metrics is not None:
                self.metrics.count_tool_call("model", bool(choice.calls))
            return False
        if k is not None and self.metrics is not None:
            self.metrics.count_tool_call("model", False)
        if forms is None:
            return False
        allowed = list(tools.allowed().values())
        if k is None:  # no call in the draft (which released nothing): the call alone, from the first column
            kept, call_text = [], ""
        else:  # the answer's text and the opening tag as the model wrote them, the frame on from there
            kept = draft[:k]
            call_text = full[len(decode(kept)) - len(OPEN):]
        spec = drafted_tool(call_text, allowed) or allowed[0]
        req = self.job.requests[choice.index]
        context = decode(list(req.prompt[-24:]))
        lead = "</think>\n\n" if choice.thinking else (" " if context.endswith(":") else "")
        layout = forms.frame(spec, forms.value_sizes(call_text, spec), kept, lead, context + decode(kept))
        if layout is None or layout.end >= req.max_tokens:
            return False
        try:
            rid = self.engine.submit(dataclasses.replace(req, scaffold=layout.scaffold),
                                     self._on_event(choice.index, choice.gen + 1))
        except Exception:  # (the queue is full, the server drains: the draft's end stands)
            return False
        if event.finish_reason is None and choice.rid is not None:
            self.engine.cancel(choice.rid)
        passes = choice.passes
        for f in dataclasses.fields(Choice):
            setattr(choice, f.name, getattr(before, f.name))
        choice.gen += 1
        choice.rid = rid
        choice.tokens, choice.seen = [], 0  # the rewrite's events bring its whole response, the fixed tokens too
        choice.layout, choice.passes_before, choice.passes = layout, passes, passes
        if self.metrics is not None:
            self.metrics.count_submitted()
        return True

    def usage(self) -> dict[str, Any]:
        """OpenAI usage: the prompt once, the completion tokens of every choice, and (as OpenAI's
        `prompt_tokens_details.cached_tokens`) the prompt tokens the prefix cache gave, the most any choice got."""
        prompt = len(self.job.requests[0].prompt)
        completion = sum(len(c.tokens) if c.used is None else c.used for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": max(c.cached for c in self.choices)}}

    def record(self, metrics: Metrics) -> None:
        """Time to first block and total latency of a finished run into `metrics` (none for a cancelled one)."""
        if any(c.finish_reason == "cancelled" for c in self.choices):
            return
        now = time.monotonic()
        metrics.observe_generation((self.first_block or now) - self.started, now - self.started)

    def describe(self, access: Access | None) -> None:
        """Fill the access line's generation fields: tokens in / out, passes, queue time, finish reasons."""
        if access is None:
            return
        usage = self.usage()
        access.tokens_in, access.tokens_out = usage["prompt_tokens"], usage["completion_tokens"]
        access.tokens_cached = usage["prompt_tokens_details"]["cached_tokens"]
        access.passes = sum(c.passes for c in self.choices)
        access.queue_s = max(c.queued_s for c in self.choices)
        access.finish = ",".join(c.finish_reason or "none" for c in self.choices)
