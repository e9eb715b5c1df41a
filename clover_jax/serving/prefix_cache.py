"""The serving engine's prefix cache: the caches that earlier prompts left, found again by the prompts that begin
with them.

`PrefixStore(grain, entry_bytes, budget_bytes)` holds entries keyed by their prompt's tokens, each a one-row model
cache (`model.cache.read_row` of the row right after its prompt was admitted) of `entry_bytes`:
  * `lookup(prompt)` gives the longest saved prompt that `prompt` begins with as a `Hit`: its cache, its length and
    the tokens reusable from it (its length down to a whole number of `grain` tokens, the finest cut that keeps the
    reuse exact for the model; a hit always reuses at least one grain), and marks it the most recently used;
  * `put(prompt, read)` saves `read()` under `prompt` unless it is there already, first evicting the least recently
    used entries until it fits in `budget_bytes` (a settable attribute); it gives the entry, or None when a prompt
    is shorter than a grain or one entry is more than the whole budget.
Entries are copies: no running row writes them. The engine's scheduler thread and its causal lane
(`serving.speculative`) both look up and save; a lock makes each call whole.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, NamedTuple


class Hit(NamedTuple):
    """A saved prompt that a new one begins with."""

    cache: Any  # its one-row model cache
    saved_len: int  # its tokens
    reused: int  # of them, those the new prompt takes from it (saved_len down to whole grains)


class PrefixStore:
    """Saved prompts' caches; see the module docstring."""

    def __init__(self, grain: int, entry_bytes: int, budget_bytes: int) -> None:
        if grain < 1:
            raise ValueError(f"grain must be >= 1, got {grain}")
        self.grain, self.entry_bytes, self.budget_bytes = grain, entry_bytes, budget_bytes
        self._entries: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()  # LRU first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prompt: tuple[int, ...]) -> bool:
        return prompt in self._entries

    @property
    def nbytes(self) -> int:
        """Device memory the entries hold."""
        return len(self._entries) * self.entry_bytes

    def lookup(self, prompt: tuple[int, ...]) -> Hit | None:
        """The longest saved prompt that `prompt` begins with (see the module docstring); None on a miss."""
        with self._lock:
            best = max((key for key in self._entries if len(key) <= len(prompt) and prompt[:len(key)] == key),
                       key=len, default=None)
            reused = 0 if best is None else len(best) // self.grain * self.grain
            if best is None or reused == 0:
                return None
            self._entries.move_to_end(best)
            return Hit(self._entries[best], len(best), reused)

    def put(self, prompt: tuple[int, ...], read: Callable[[], Any]) -> Any | None:
        """Save `read()` under `prompt` (see the module docstring); the entry, or None when it cannot be kept."""
        with self._lock:
            if prompt in self._entries:
                self._entries.move_to_end(prompt)
                return self._entries[prompt]
            if len(prompt) < self.grain or self.entry_bytes > self.budget_bytes:
                return None
            while self._entries and (len(self._entries) + 1) * self.entry_bytes > self.budget_bytes:
                self._entries.popitem(last=False)
            self._entries[prompt] = entry = read()
            return entry
