"""What a serving client asks for and what it gets back, independent of HTTP.

`Request` is one generation (one OpenAI "choice"): token ids, a length, and the sampler settings
(`sampler.settings.SamplerConfig`) that stay dynamic in the serving program, so requests with different settings
share a batch. `Event` is what the engine reports to a request after every block it committed: a block is final
once committed (block-causal attention never revisits it), so each event's tokens can be streamed at once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from clover_jax.errors import CloverError, SamplerError
from clover_jax.sampler.settings import SERVER_FIXED, SETTINGS, SamplerConfig, check_settings


class ServingError(CloverError):
    """A request the engine cannot take (the HTTP layer answers it with a 4xx). `param`: the request field at
    fault, when one is."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadRequest(ServingError):
    """Invalid settings or a prompt that does not fit: HTTP 400."""


class QueueFull(ServingError):
    """The queue holds `queue_size` waiting requests already: HTTP 429."""


class Draining(ServingError):
    """The engine is shutting down and admits nothing new: HTTP 503."""


def cache_choices(cache: str) -> tuple[str, ...]:
    """The cache modes a request may name on a server running `cache`: auto, and the server's own."""
    return ("auto",) if cache == "auto" else ("auto", cache)


@dataclass(frozen=True)
class Scaffold:
    """Tokens a request's response is written around: `tokens[i]` is fixed at generated column i (committed as the
    model's own before its block runs) or -1 (the model writes it); `classes[i]` (missing: 0) restricts what the
    model may write there: 0 any token, c >= 1 only the token ids of `allowed[c - 1]` (the logits of every other
    token are -inf). A serving client builds one to write a tool call's frame and keys and let the model fill in
    the values (`serving.scaffold`); an end token fixed at a column ends the response there."""

    tokens: tuple[int, ...]
    classes: tuple[int, ...] = ()
    allowed: tuple[tuple[int, ...], ...] = ()

    def check(self, vocab_size: int, columns: int, n_classes: int, mask_id: int | None = None) -> str | None:
        """The first problem with this scaffold for a row of `columns` generated columns and `n_classes` token
        classes (`mask_id`: the model's mask token, which is never written), or None."""
        if len(self.tokens) > columns or len(self.classes) > columns:
            return f"the scaffold covers {max(len(self.tokens), len(self.classes))} tokens, more than max_tokens"
        if any(not -1 <= t < vocab_size for t in self.tokens):
            return f"a scaffold token id is outside [0, {vocab_size})"
        if len(self.allowed) > n_classes:
            return f"the scaffold has {len(self.allowed)} token classes; this server takes at most {n_classes}"
        if any(not 0 <= c <= len(self.allowed) for c in self.classes):
            return "a scaffold column names a token class it does not define"
        if any(not group or any(not 0 <= t < vocab_size for t in group) for group in self.allowed):
            return "a scaffold token class is empty or holds a token id outside the vocabulary"
        if mask_id is not None and (mask_id in self.tokens or any(set(group) == {mask_id} for group in self.allowed)):
            return "a scaffold fixes the mask token, or holds a column to it alone"
        return None


@dataclass(frozen=True)
class Request:
    """One generation: its prompt, at most `max_tokens` tokens (rounded up to whole blocks inside the engine; the
    tokens it reports never exceed `max_tokens`), and the sampler settings it runs with (`sampling`: its traced
    settings; the engine fixes those of `settings.SERVER_FIXED`, which must be left at their defaults or set to the
    engine's own values). `sampling.steps_per_block` defaults to block_length: one token a step. `keep`: the
    prompt's first tokens that a later request is likely to begin with (a chat's conversation without the
    assistant's opening), which the engine's prefix cache also saves; 0: the whole prompt. `scaffold`: tokens fixed
    in the response and what the model may write around them (`Scaffold`), on an engine that takes scaffolds."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplerConfig = field(default_factory=SamplerConfig)
    keep: int = 0
    scaffold: Scaffold | None = None

    def row_settings(self, block_length: int) -> SamplerConfig:
        """The settings the request's row runs with: `sampling` over its whole blocks of the engine's length
        (`.n_blocks` of the result: the blocks it runs at most)."""
        n_blocks = -(-self.max_tokens // block_length) if isinstance(self.max_tokens, int) else 1
        return self.sampling.replace(gen_length=max(n_blocks, 1) * block_length, block_length=block_length,
                                     cache="auto", block_grid="auto")

    def check(self, block_length: int, cache: str, vocab_size: int, max_prompt: int, max_tokens: int,
              spell: Mapping[str, str] | None = None, given: Collection[str] = (), speculative: bool = False,
              scaffold_classes: int | None = None, mask_id: int | None = None) -> None:
        """Raise BadRequest naming the first problem (cheap, before the request is queued); settings are named as
        `spell` has them (the HTTP layer: `settings.REQUEST_NAMES`). A setting of `settings.SERVER_FIXED` must be
        left at its default or be the engine's; `given`: settings the client set explicitly (the HTTP layer knows),
        which must be the engine's even when they equal the default. `speculative`: the engine serves
        self-speculative and causal requests (`Engine.self_speculative`); `scaffold_classes`: the token classes a
        scaffold may define (None: the engine takes no scaffolds); `mask_id`: the model's mask token (a scaffold
        never fixes it)."""
        name = (lambda n: (spell or {}).get(n, n))

        def need(ok: bool, msg: str, param: str | None = None) -> None:
            if not ok:
                raise BadRequest(msg, param=param)

        need(len(self.prompt) > 0, "the prompt is empty", "prompt")
        need(all(0 <= t < vocab_size for t in self.prompt), f"a prompt token id is outside [0, {vocab_size})",
             "prompt")
        need(len(self.prompt) <= max_prompt,
             f"the prompt has {len(self.prompt)} tokens; this server takes at most {max_prompt}", "prompt")
        need(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and 0 < self.max_tokens <= max_tokens,
             f"max_tokens must be an integer in [1, {max_tokens}], got {self.max_tokens!r}", "max_tokens")
        s = self.sampling
        loose = () if "block_length" in given else (SETTINGS["block_length"].default,)
        need(s.block_length in (*loose, block_length),
             f"{name('block_length')} must be {block_length} (the block length this server runs), got "
             f"{s.block_length}", name("block_length"))
        allowed = cache_choices(cache)
        need(s.cache in allowed, f"{name('cache')} must be {' or '.join(map(repr, allowed))} (this server's cache "
             f"mode is fixed at start), got {s.cache!r}", name("cache"))
        for mode in ("self_speculative", "causal"):
            need(not getattr(s, mode) or speculative,
                 f"{name(mode)} needs a server started with --self-speculative (this one is not)", name(mode))
        if self.scaffold is not None:
            need(scaffold_classes is not None, "this server takes no scaffolds", "scaffold")
            need(not (s.self_speculative or s.causal), "a scaffolded request cannot be self-speculative or causal",
                 "scaffold")
            columns = -(-self.max_tokens // block_length) * block_length
            problem = self.scaffold.check(vocab_size, columns, scaffold_classes or 0, mask_id)
            need(problem is None, str(problem), "scaffold")
        for key in SERVER_FIXED:
            if key not in ("block_length", "cache", "self_speculative", "causal"):
                need(getattr(s, key) == SETTINGS[key].default,
                     f"{name(key)} is not a per-request setting of this server", name(key))
        try:
            check_settings(self.row_settings(block_length), spell)
        except SamplerError as e:
            raise BadRequest(str(e), param=e.param) from None


class Event(NamedTuple):
    """One committed block of a request (or its end).

    tokens: the block's new tokens, cut at the end token and at `max_tokens` (may be empty);
    finish_reason: None while the request runs, "stop" (end token), "length" (max_tokens reached)
      or "cancelled"; the last event of a request always has one;
    passes: forward passes the request took part in so far (the steps in which its block still had masks;
      the prompt's prefill not counted);
    queued_s: seconds the request waited in the queue for a batch row (0.0 from an engine that does not say);
    cached_tokens: prompt tokens the engine's prefix cache gave it (not prefilled again).
    """

    tokens: tuple[int, ...]
    finish_reason: str | None
    passes: int
    queued_s: float = 0.0
    cached_tokens: int = 0
