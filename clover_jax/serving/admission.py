"""Putting queued requests into the serving engine's rows: prefill widths, admission sizes, batched prefill and the
prefix cache. The engine (`serving.engine`) owns the rows and the state; an `Admission` owns the admission programs
and the saved prompts, and turns a round of new rows into program calls.

Contract:
  * `Admission(cfg, forward_fn, block_length, columns, cache, capacity, prefill_rows, prefix_cache_gb, mesh)` fixes
    the prompt widths a new row is prefilled in (`widths`, powers of two times the block; none without a cache), the
    admission sizes (`admit_rows`: powers of two up to `prefill_rows` and the capacity, and that bound), and whether
    the prefix cache is on (`prefix_cache`; else `prefix_cache_note` says why, when it was asked for);
  * `programs(weights, state)` lists its programs as {key: (jitted function, arguments)}: ("prefill", width, rows)
    and, with the prefix cache, ("reuse", width) and ("read", 0); `install(key, compiled)` takes them back compiled;
  * `admit(weights, state, rows)` puts each `NewRow` into its slot and gives the new state and an `AdmissionTally`:
    rows whose prompts share a width go in one call, at most `admit_rows[-1]` at a time, in their order; a prompt
    that begins with a saved one is admitted from it (its own call, `program.admit_reusing`), prefilling only its
    new tokens; every admitted prompt (and a row's `keep` stem, in a call of its own before the rest) is saved
    (`prefix_cache.PrefixStore`, least recently used out first). A row's tokens are those of a full prefill alone;
  * `lane_reuse(prompt, keep)` / `lane_save(...)`: the same store for a request of the engine's causal lane
    (`serving.speculative`), whose program prefills its prompt itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import cache as kv_cache
from clover_jax.model import masks
from clover_jax.model.forward_fn import ForwardFn
from clover_jax.sampler.settings import SamplerConfig, knobs
from clover_jax.sampler.speculative import Reuse
from clover_jax.sampler.step import pow2_widths, prefill_overlap
from clover_jax.serving import program
from clover_jax.serving.prefix_cache import Hit, PrefixStore
from clover_jax.serving.requests import Scaffold
from clover_jax.serving.stats import AdmissionTally


@dataclass
class NewRow:
    """A request taken from the queue into row `slot`."""

    slot: int
    prompt: tuple[int, ...]
    keep: int  # its first tokens a later request will begin with (`Request.keep`; 0: none said)
    settings: SamplerConfig  # its row's settings
    scaffold: Scaffold | None = None  # tokens fixed in its response (`requests.Scaffold`)
    cached: int = 0  # prompt tokens whose cache the prefix cache gave it (set by `Admission.admit`)


class Admission:
    """The engine's admission path; see the module docstring."""

    def __init__(self, cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, columns: int, cache: str,
                 capacity: int, prefill_rows: int, prefix_cache_gb: float, mesh: MeshRules | None,
                 scaffold: tuple[int, int] | None = None) -> None:
        self.cfg, self.forward_fn, self.block_length, self.columns = cfg, forward_fn, block_length, columns
        self.cache, self.capacity, self.mesh = cache, capacity, mesh
        self.scaffold = scaffold  # (generated columns G, token classes C) of a state that takes scaffolds
        top = min(prefill_rows, capacity)
        self.admit_rows = tuple(sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top}))
        self.widths = pow2_widths(columns - block_length, block_length)
        self.row_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
            lambda: forward_fn.init_cache(1, columns)))) if cache == "prefix" else 0
        self.reuse_grain, why = reuse_grain(cfg, cache, mesh)
        budget = int(min(prefix_cache_gb, 1e6) * 1e9)  # (1 PB: "unbounded")
        if self.reuse_grain is not None and self.row_bytes > budget > 0:
            self.reuse_grain, why = None, (f"one saved prompt takes {self.row_bytes / 1e9:.2f} GB (a whole row's "
                                           f"cache), more than prefix_cache_gb {prefix_cache_gb:g}")
        self.prefix_cache = prefix_cache_gb > 0 and self.reuse_grain is not None
        # why the prefix cache is off although asked for (None: on, or not asked for)
        self.prefix_cache_note = why if prefix_cache_gb > 0 and not self.prefix_cache else None
        # the saved prompts' caches (its budget_bytes may be changed while serving)
        self.store = PrefixStore(self.reuse_grain or 1, self.row_bytes, budget)
        self._prefill: dict[tuple[int, int], Any] = {}  # (prompt width, rows) -> the admission program
        self._reuse: dict[int, Any] = {}  # width of the new tokens -> the reusing admission program
        self._read: Any = None
        self._blank: Any = None  # a zero one-row cache: the lane's `Reuse` when nothing is saved

    def width(self, n_tokens: int) -> int:
        """The prefill width for `n_tokens` prompt tokens: the narrowest of `widths` that holds them (0 without a
        cache: nothing is prefilled)."""
        return next(w for w in self.widths if w >= max(n_tokens, 1)) if self.cache == "prefix" else 0

    def programs(self, weights: Any, state: program.SlotState) -> dict[tuple[Any, ...], tuple[Any, tuple]]:
        """The admission programs (see the module docstring) for `weights` and `state`, concrete or abstract."""
        cfg, fwd, bl, mesh = self.cfg, self.forward_fn, self.block_length, self.mesh
        out: dict[tuple[Any, ...], tuple[Any, tuple]] = {}
        for w in (self.widths if self.cache == "prefix" else (0,)):
            fn = program.prefill_program(cfg, fwd, bl, self.cache, w, state, mesh)
            for k in self.admit_rows:
                out["prefill", w, k] = (fn, (weights, state, *program.row_args(state, k)))
        if self.prefix_cache:
            scalar = jax.ShapeDtypeStruct((), jnp.int32)
            saved = jax.eval_shape(kv_cache.read_row, state.cache, scalar)
            for w in self.widths:
                out["reuse", w] = (program.reuse_program(cfg, fwd, bl, w, state, mesh),
                                   (weights, state, *program.row_args(state, 1), saved, scalar, scalar))
            out["read", 0] = (program.read_program(), (state.cache, scalar))
        return out

    def install(self, key: tuple[Any, ...], compiled: Any) -> None:
        """Take the compiled program of `programs()[key]`."""
        if key[0] == "prefill":
            self._prefill[key[1], key[2]] = compiled
        elif key[0] == "reuse":
            self._reuse[key[1]] = compiled
        else:
            self._read = compiled

    def row(self, prompt: Sequence[int], scaffold: Scaffold | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A new row's canvas / valid / block ids [S]: the prompt right before the first block of masks (and of the
        scaffold's fixed tokens)."""
        s, bl, n = self.columns, self.block_length, len(prompt)
        canvas = np.full((s,), self.cfg.filler_id, np.int32)
        canvas[s - bl - n:s - bl] = prompt
        canvas[s - bl:] = self.cfg.mask_token_id
        if scaffold is not None:
            first = np.array(scaffold.tokens[:bl], np.int32)
            canvas[s - bl:s - bl + len(first)] = np.where(first >= 0, first, self.cfg.mask_token_id)
        valid = np.zeros((s,), bool)
        valid[s - bl - n:] = True
        ids = np.zeros((s,), np.int32)
        ids[s - bl - n:s - bl] = masks.clean_block_ids(self.cfg, np.arange(n))
        ids[s - bl:] = s
        return canvas, valid, ids

    def groups(self, rows: Sequence[NewRow]) -> list[list[NewRow]]:
        """`rows` in admission calls: by prompt width (a short prompt never pays for a long one's columns), at
        most `admit_rows[-1]` to a call, in their order."""
        by_width: dict[int, list[NewRow]] = {}
        for r in rows:
            by_width.setdefault(self.width(len(r.prompt)), []).append(r)
        top = self.admit_rows[-1]
        return [rs[i:i + top] for rs in by_width.values() for i in range(0, len(rs), top)]

    def admit(self, weights: Any, state: program.SlotState,
              rows: Sequence[NewRow]) -> tuple[program.SlotState, AdmissionTally]:
        """Put `rows` into their slots; see the module docstring. A row with a `keep` stem not saved yet is admitted
        in two calls: up to the stem (then saved), then the rest from it."""
        tally = AdmissionTally(rows=len(rows))
        fresh = []
        store, g = self.store, self.store.grain
        for r in rows:
            hit = self._lookup(r.prompt, tally)
            keep = r.keep if 0 < r.keep < len(r.prompt) else 0
            r.cached = hit.reused if hit else 0
            tally.hits += hit is not None
            tally.reused += r.cached
            if (self.prefix_cache and keep >= g and r.cached < keep - keep % g
                    and store.entry_bytes <= store.budget_bytes):
                stem = r.prompt[:keep]  # a hit here is a saved prompt no longer than the stem: the stem begins with it
                if hit:
                    state = self._reuse_row(weights, state, r, stem, *hit)
                else:
                    state = self._prefill_rows(weights, state, [r], [stem])
                saved = self._save(state, r.slot, stem)
                if saved is not None:
                    state = self._reuse_row(weights, state, r, r.prompt, saved, keep, keep - keep % g)
                else:  # (not kept: one saved prompt is more than the budget) the whole prompt again
                    state = self._prefill_rows(weights, state, [r], [r.prompt])
                tally.calls += 2
            elif hit:
                state = self._reuse_row(weights, state, r, r.prompt, *hit)
                tally.calls += 1
            else:
                fresh.append(r)
        for group in self.groups(fresh):
            state = self._prefill_rows(weights, state, group, [r.prompt for r in group])
            tally.calls += 1
        if self.prefix_cache:
            for r in rows:
                self._save(state, r.slot, r.prompt)
        return state, tally

    def lane_reuse(self, prompt: tuple[int, ...], keep: int) -> tuple[Reuse, AdmissionTally]:
        """For a request of the causal lane with the prefix cache on: its `Reuse` (the longest saved prompt that its
        prompt but the last token begins with, which the lane's first round commits itself; the stem to give back:
        `keep` when it is past the saved prompt and short of the whole, else all but the last token) and the
        lookup's tally."""
        tally = AdmissionTally()  # (no admission call: the lane's program prefills)
        n = len(prompt)
        hit = self._lookup(prompt[:-1], tally) if n > 1 else None
        saved = hit.saved_len if hit else 0  # (the lane's models cut anywhere: reused == saved_len)
        tally.hits += hit is not None
        tally.reused += saved
        if hit is None and self._blank is None:
            self._blank = self.forward_fn.init_cache(1, self.columns)
        stem = keep if saved < keep < n else max(n - 1, saved)
        return Reuse(hit.cache if hit else self._blank, np.int32(saved), np.int32(stem)), tally

    def lane_save(self, prompt: tuple[int, ...], reuse: Reuse, stem_cache: Any) -> None:
        """Save the cache a lane program gave back for `prompt`'s stem (`lane_reuse`), unless it is no longer than
        what was reused."""
        stem = int(reuse.stem)
        if stem > int(reuse.saved_len):
            self.store.put(tuple(prompt[:stem]), lambda: stem_cache)

    def _lookup(self, prompt: tuple[int, ...], tally: AdmissionTally) -> Hit | None:
        """`store.lookup(prompt)` when the prefix cache is on (counted in `tally`)."""
        if not self.prefix_cache:
            return None
        tally.lookups += 1
        return self.store.lookup(prompt)

    def _reuse_row(self, weights: Any, state: program.SlotState, r: NewRow, prompt: tuple[int, ...], saved: Any,
                   saved_len: int, reused: int) -> program.SlotState:
        """`state` with row `r.slot` := `prompt`, its first `reused` tokens' cache taken from `saved`."""
        canvas, valid, ids = self.row(prompt, r.scaffold)
        row_knobs = jax.tree.map(lambda x: np.stack([x]), knobs(r.settings, self.cfg))
        return self._reuse[self.width(len(prompt) - reused)](
            weights, state, np.array([r.slot], np.int32), canvas[None], valid[None], ids[None], row_knobs,
            np.array([r.settings.n_blocks], np.int32), self._scaffolds([r.scaffold]), saved,
            np.int32(len(prompt) - saved_len), np.int32(reused))

    def _scaffolds(self, scaffolds: Sequence[Scaffold | None]) -> program.Scaffolds | None:
        """The rows' scaffolds as `program.Scaffolds` arrays (None when the state takes none)."""
        if self.scaffold is None:
            return None
        g, c = self.scaffold
        k = len(scaffolds)
        tokens, classes = np.full((k, g), -1, np.int32), np.zeros((k, g), np.int32)
        allowed = np.zeros((k, c, self.cfg.vocab_size), bool)
        for i, sc in enumerate(scaffolds):
            if sc is None:
                continue
            tokens[i, :len(sc.tokens)] = sc.tokens
            classes[i, :len(sc.classes)] = sc.classes
            for j, group in enumerate(sc.allowed):
                allowed[i, j, list(group)] = True
        return program.Scaffolds(tokens, classes, allowed)

    def _save(self, state: program.SlotState, slot: int, prompt: tuple[int, ...]) -> Any | None:
        """Keep row `slot`'s cache (its prompt just admitted) for later prompts that begin with `prompt`
        (`PrefixStore.put`): the entry, or None when it cannot be kept."""
        return self.store.put(prompt, lambda: self._read(state.cache, np.int32(slot)))

    def _prefill_rows(self, weights: Any, state: program.SlotState, group: Sequence[NewRow],
                      prompts: list[tuple[int, ...]]) -> program.SlotState:
        """`state` with the rows of `group` := `prompts` (of one prefill width), in one call whose prefill runs them
        as one batch, padded to an admission size with copies of the first aimed at no row."""
        k = next(n for n in self.admit_rows if n >= len(group))
        pad = k - len(group)
        slots = np.array([r.slot for r in group] + [self.capacity] * pad, np.int32)
        settings = [r.settings for r in group] + [group[0].settings] * pad
        scaffolds = [r.scaffold for r in group] + [group[0].scaffold] * pad
        prompts = prompts + prompts[:1] * pad
        canvas, valid, ids = (np.stack(x) for x in zip(*(self.row(p, sc) for p, sc in zip(prompts, scaffolds,
                                                                                             strict=True)),
                                                       strict=True))
        row_knobs = jax.tree.map(lambda *x: np.stack(x), *(knobs(s, self.cfg) for s in settings))
        n_blocks = np.array([s.n_blocks for s in settings], np.int32)
        return self._prefill[self.width(len(prompts[0])), k](weights, state, slots, canvas, valid, ids, row_knobs,
                                                             n_blocks, self._scaffolds(scaffolds))


def reuse_grain(cfg: ModelConfig, cache: str, mesh: MeshRules | None) -> tuple[int | None, str | None]:
    """(the granularity in tokens at which a saved prompt's cache can be reused exactly, None if it cannot; why
    not). A causal-prefix or causal model: any prompt, whole (grain 1); a block-causal attention-only model: its
    whole prompt blocks; a hybrid with longer clean blocks (the earlier reconstruction) cannot be cut."""
    if cache != "prefix":
        return None, "it needs the prefix cache mode"
    if mesh is not None:
        return None, "it runs on one device for now"
    overlap = prefill_overlap(cfg, cfg.block_size)
    if overlap is None:
        return None, (f"config {cfg.name!r} reads its prompt in blocks of {cfg.block_size} through Gated DeltaNet, "
                      "whose state cannot be cut inside a block")
    return max(overlap, 1), None
