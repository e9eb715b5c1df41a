"""What a serving client asks for and what it gets back, independent of HTTP.

`Request` is one generation (one OpenAI "choice"): token ids and the sampler settings that stay
dynamic in the serving program, so requests with different settings share a batch. `Event` is what
the engine reports to a request after every block it committed: a block is final once committed
(block-causal attention never revisits it), so each event's tokens can be streamed at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from clover_jax.errors import CloverError
from clover_jax.sampler.scoring import REMASKING

MAX_INT32 = 2**31 - 1  # top_k travels to the device as an int32


class ServingError(CloverError):
    """A request the engine cannot take (the HTTP layer answers it with a 4xx)."""


class BadRequest(ServingError):
    """Invalid settings or a prompt that does not fit: HTTP 400."""


class QueueFull(ServingError):
    """The queue holds `queue_size` waiting requests already: HTTP 429."""


class Draining(ServingError):
    """The engine is shutting down and admits nothing new: HTTP 503."""


@dataclass(frozen=True)
class Request:
    """One generation. `max_tokens` is rounded up to whole blocks inside the engine; the tokens it
    reports never exceed `max_tokens`."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    threshold: float = 0.0  # > 0: also commit every masked position whose confidence exceeds it
    steps: int | None = None  # refinement steps per block; None = block_length (one token a step)
    remasking: str = "low_confidence"
    seed: int = 0
    eos_stop: bool = True

    def check(self, block_length: int, vocab_size: int, max_prompt: int, max_tokens: int) -> None:
        """Raise BadRequest naming the first problem (cheap, before the request is queued)."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise BadRequest(msg)

        need(len(self.prompt) > 0, "the prompt is empty")
        need(all(0 <= t < vocab_size for t in self.prompt), f"a prompt token id is outside [0, {vocab_size})")
        need(len(self.prompt) <= max_prompt,
             f"the prompt has {len(self.prompt)} tokens; this server takes at most {max_prompt}")
        need(isinstance(self.max_tokens, int) and 0 < self.max_tokens <= max_tokens,
             f"max_tokens must be an integer in [1, {max_tokens}], got {self.max_tokens!r}")
        need(math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and 0 <= self.top_k <= MAX_INT32,
             f"top_k must be an integer in [0, {MAX_INT32}], got {self.top_k!r}")
        need(self.threshold == 0 or 0 < self.threshold <= 1,
             f"threshold must be in (0, 1] (or 0 = off), got {self.threshold}")
        need(self.steps is None or (isinstance(self.steps, int) and 1 <= self.steps <= block_length),
             f"steps (per block) must be an integer in [1, {block_length}], got {self.steps!r}")
        need(self.remasking in REMASKING,
             f"unknown remasking strategy {self.remasking!r}; choose one of {tuple(REMASKING)}")
        need(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")


class Event(NamedTuple):
    """One committed block of a request (or its end).

    tokens: the block's new tokens, cut at the end token and at `max_tokens` (may be empty);
    finish_reason: None while the request runs, "stop" (end token), "length" (max_tokens reached)
      or "cancelled"; the last event of a request always has one;
    passes: forward passes the request took part in so far (the steps in which its block still had masks;
      the prompt's prefill not counted);
    queued_s: seconds the request waited in the queue for a batch row (0.0 from an engine that does not say).
    """

    tokens: tuple[int, ...]
    finish_reason: str | None
    passes: int
    queued_s: float = 0.0
