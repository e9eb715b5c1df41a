"""The serving engine: a queue of requests, rows that join and leave at block boundaries, and a
scheduler thread that runs one compiled block program per batch bucket (`serving.program`).

Contract:
  * `Engine(weights, cfg, ...)` checks the model and the settings (ServingError, before any compile);
    `warm_up(log)` compiles every program the engine will ever run (one `advance` per batch bucket,
    one `admit` per prompt width and admission size, one `move`), so nothing compiles while serving;
  * `submit(request, on_event)` validates the request (BadRequest), queues it (QueueFull when the queue
    holds `queue_size`, Draining once `drain` began) and returns its id. `on_event(Event)` is called
    from the scheduler thread after every block the request committed; its last event has a
    finish_reason ("stop", "length", "cancelled", or "error" if the device program failed) and every
    event says how long the request waited for a row (`Event.queued_s`);
  * between two block calls the scheduler admits queued requests into free rows and drops cancelled
    ones; requests whose prompts share a prefill width are admitted together, up to `prefill_rows` in
    one call whose prefill runs their prompts as one batch; running rows stay in [0, n) and the call runs the
    smallest bucket that holds n, so one request alone runs at batch 1;
  * with `prefix_cache_gb` (and a model whose prompt can be cut: `_reuse_grain`), every admitted prompt's cache
    row is saved (`prefix_cache.PrefixStore`, least recently used out first) and a prompt that begins with a saved
    one is admitted from it, prefilling only its new tokens (`program.admit_reusing`); a request's `keep` (a chat's
    conversation before the assistant's opening) is saved too. Exact: the tokens are those of a full prefill;
  * a request's tokens depend only on itself (its own knobs and random key, exact caches), never on
    what else shares the batch or what was served before it (up to float32 rounding: the batch bucket, the
    admission size and a reused prefix change how some sums are cut and ordered);
  * with `self_speculative` (a causal-prefix model), a request that asks for it (`SamplerConfig.self_speculative`)
    runs alone on a lane of its own beside the rows, through the sampler's self-speculative program
    (`serving.speculative`), and gets its whole response in one event.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.errors import SamplerError
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import cache as kv_cache
from clover_jax.model import masks
from clover_jax.model.forward_fn import ForwardFn, ModelForward
from clover_jax.model.moe import choose_dispatch
from clover_jax.sampler.generate import check_block_length
from clover_jax.sampler.settings import SamplerConfig, knobs, resolve_cache
from clover_jax.sampler.step import pow2_widths, prefill_overlap
from clover_jax.serving import program, speculative
from clover_jax.serving.prefix_cache import Hit, PrefixStore
from clover_jax.serving.requests import Draining, Event, QueueFull, Request, ServingError


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters."""

    requests_admitted: int
    requests_finished: int
    tokens_generated: int
    program_passes: int  # forward passes the device ran (each over a whole batch bucket)
    row_passes: int  # sum over requests of the passes they took part in
    queue_depth: int
    active_rows: int
    capacity: int  # the largest batch bucket
    blocks_run: int  # block-program calls
    rows_in_blocks: int  # sum over block calls of the rows that ran a request
    prefill_calls: int = 0  # admission calls (each prefills one or more new requests' prompts together)
    rows_prefilled: int = 0  # requests admitted by them
    prefix_lookups: int = 0  # admissions that looked in the prefix cache (it is on)
    prefix_hits: int = 0  # ... and reused a saved prompt's cache
    prefix_tokens_reused: int = 0  # prompt tokens those hits did not prefill
    prefix_entries: int = 0  # saved prompts held now
    prefix_bytes: int = 0  # their device memory

    @property
    def tokens_per_pass(self) -> float:
        """Tokens committed per forward pass per request: the parallelism of decoding."""
        return self.tokens_generated / self.row_passes if self.row_passes else 0.0

    @property
    def mean_rows_per_prefill(self) -> float:
        """Requests per admission call: how many queued prompts each prefill took together."""
        return self.rows_prefilled / self.prefill_calls if self.prefill_calls else 0.0

    @property
    def mean_rows_per_block(self) -> float:
        """Requests per block call: how full the batches were."""
        return self.rows_in_blocks / self.blocks_run if self.blocks_run else 0.0


@dataclass(eq=False)
class _Job:
    rid: int
    req: Request
    on_event: Callable[[Event], None]
    settings: SamplerConfig  # its row's settings (`Request.row_settings`)
    produced: int = 0
    passes: int = 0
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    queued_s: float = 0.0  # seconds from `submit` until it got a row (until now while it waits)
    cached: int = 0  # prompt tokens whose cache the prefix cache gave it


@dataclass
class _Counters:
    admitted: int = 0
    finished: int = 0
    tokens: int = 0
    program_passes: int = 0
    row_passes: int = 0
    blocks: int = 0
    rows_in_blocks: int = 0
    prefill_calls: int = 0
    rows_prefilled: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    spec_running: int = 0  # self-speculative requests on their lane now


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class Engine:
    """Continuous batching over the rows of one compiled state; see the module docstring."""

    weights: Any
    cfg: ModelConfig
    block_length: int = 32
    max_prompt: int = 256
    max_tokens: int = 256
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)
    cache: str = "auto"
    queue_size: int = 256
    dispatch: str | None = None
    mesh: MeshRules | None = None
    forward_fn: ForwardFn | None = None
    admit_window_s: float = 0.02  # after rows freed: wait this long (at most 5% of a block) for new requests
    self_speculative: bool = False  # also serve self-speculative requests (a causal-prefix model's; see above)
    prefill_rows: int = 4  # queued requests admitted (and their prompts prefilled) together in one call, at most
    prefix_cache_gb: float = 0.0  # device memory for saved prompts' caches (the prefix cache; 0: off); see above
    _lock: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)

    def __post_init__(self) -> None:
        cfg, bl = self.cfg, self.block_length
        need = _need
        need(cfg.is_block_causal, f"config {cfg.name!r} has bidirectional attention: `clover serve` runs "
             "block-causal models (a bidirectional model's blocks see the future, so rows cannot join at block "
             "boundaries)")
        need(isinstance(bl, int) and bl > 0, f"block_length must be a positive integer, got {bl!r}")
        try:
            check_block_length(cfg, bl)
        except SamplerError as e:
            raise ServingError(str(e)) from None
        need(self.max_prompt >= 1 and self.max_tokens >= 1, "max_prompt and max_tokens must be >= 1")
        self.columns = _round_up(self.max_prompt, bl) + _round_up(self.max_tokens, bl)
        need(self.columns <= cfg.max_seq_len,
             f"max_prompt {self.max_prompt} + max_tokens {self.max_tokens} (rounded to blocks of {bl}: "
             f"{self.columns}) exceed the model's max_seq_len {cfg.max_seq_len}")
        sizes = tuple(sorted(set(self.batch_sizes)))
        need(bool(sizes) and all(isinstance(b, int) and b > 0 for b in sizes),
             f"batch sizes must be positive integers, got {list(self.batch_sizes)}")
        if self.mesh is not None:
            data = self.mesh.size("data")
            need(all(b % data == 0 for b in sizes),
                 f"batch sizes {list(sizes)} must be multiples of the mesh's data axis ({data})")
        self.batch_sizes = sizes
        need(self.cache in ("auto", "dual", *program.SERVE_CACHE_MODES),
             f"unknown cache mode {self.cache!r}; choose one of auto, {', '.join(program.SERVE_CACHE_MODES)}")
        self.cache = resolve_cache(cfg, self.cache)
        if self.self_speculative:
            need(cfg.causal_prefix, f"config {cfg.name!r} is not run with a causal prefix (bd_gdn='causal_prefix'): "
                 "self-speculative decoding needs its causal model to check the drafts")
            need(self.cache == "prefix", f"self-speculative decoding needs the prefix cache, not {self.cache!r}")
        need(self.queue_size >= 1, f"queue_size must be >= 1, got {self.queue_size}")
        need(isinstance(self.prefill_rows, int) and self.prefill_rows >= 1,
             f"prefill_rows must be a positive integer, got {self.prefill_rows!r}")
        need(self.prefix_cache_gb >= 0, f"prefix_cache_gb must be >= 0, got {self.prefix_cache_gb}")
        # the admission programs' rows: powers of two up to prefill_rows (and the capacity), and prefill_rows
        top = min(self.prefill_rows, sizes[-1])
        self.admit_rows = tuple(sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top}))
        if self.forward_fn is None:
            if self.dispatch is None and self.mesh is not None:  # on a mesh: its expert-parallel strategy
                self.dispatch = choose_dispatch(self.mesh)
            self.forward_fn = ModelForward(cfg, self.dispatch, self.mesh)
        self.widths = pow2_widths(self.columns - bl, bl)  # the prompt widths a new row is prefilled in
        self.row_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
            lambda: self.forward_fn.init_cache(1, self.columns)))) if self.cache == "prefix" else 0
        self.reuse_grain, why = _reuse_grain(cfg, self.cache, self.mesh)
        budget = int(min(self.prefix_cache_gb, 1e6) * 1e9)  # (1 PB: "unbounded")
        if self.reuse_grain is not None and self.row_bytes > budget > 0:
            self.reuse_grain, why = None, (f"one saved prompt takes {self.row_bytes / 1e9:.2f} GB (a whole row's "
                                           f"cache), more than prefix_cache_gb {self.prefix_cache_gb:g}")
        self.prefix_cache = self.prefix_cache_gb > 0 and self.reuse_grain is not None
        # why the prefix cache is off although asked for (None: on, or not asked for)
        self.prefix_cache_note = why if self.prefix_cache_gb > 0 and not self.prefix_cache else None
        # the saved prompts' caches (its budget_bytes may be changed while serving)
        self.prefix_store = PrefixStore(self.reuse_grain or 1, self.row_bytes, budget)
        self._reuse: dict[int, Any] = {}  # width of the new tokens -> the reusing admission program
        self._read: Any = None
        self.spec_columns = _round_up(self.max_tokens, bl)  # a self-speculative request's generated columns
        self._queue: collections.deque[_Job] = collections.deque()
        self._slots: list[_Job | None] = [None] * sizes[-1]
        self._by_id: dict[int, _Job] = {}
        self._next_id = 0
        self._count = _Counters()
        self._draining = False
        self._stopping = False
        self._freed = 0  # rows the last block call freed
        self._block_s = 0.0  # wall time of the last block call
        self._thread: threading.Thread | None = None
        self._advance: dict[int, Any] = {}
        self._admit: dict[tuple[int, int], Any] = {}  # (prompt width, rows) -> the admission program
        self._move: Any = None
        self._state: program.SlotState | None = None
        self._spec_queue: collections.deque[_Job] = collections.deque()
        self._spec: dict[int, Any] = {}  # prompt width -> the self-speculative program
        self._spec_thread: threading.Thread | None = None

    # ---- compiled programs ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows: the largest batch bucket."""
        return self.batch_sizes[-1]

    def programs(self, weights: Any, state: program.SlotState) -> dict[tuple[Any, ...], tuple[Any, tuple]]:
        """Every program the engine runs, as {key: (jitted function, its arguments)}: ("block", rows) per batch
        bucket, ("prefill", width, rows) per prompt width (width 0 with cache none) and admission size
        (`admit_rows`), ("move", 0) and, serving self-speculative requests, (`speculative.KIND`, width). `weights`
        and `state` may be concrete (`warm_up` compiles them to run) or abstract (`clover plan --serve` compiles
        them for a TPU slice): both compile the same functions with the same shardings."""
        cfg, fwd, bl, mode, mesh = self.cfg, self.forward_fn, self.block_length, self.cache, self.mesh
        out: dict[tuple[str, int], tuple[Any, tuple]] = {}
        for b in self.batch_sizes:
            out["block", b] = (program.block_program(cfg, fwd, bl, mode, b, state, mesh),
                               (weights, state, jax.ShapeDtypeStruct((b,), jnp.bool_)))
        for w in (self.widths if mode == "prefix" else (0,)):
            fn = program.prefill_program(cfg, fwd, bl, mode, w, state, mesh)
            for k in self.admit_rows:
                out["prefill", w, k] = (fn, (weights, state, *program.row_args(state, k)))
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        if self.prefix_cache:
            saved = jax.eval_shape(kv_cache.read_row, state.cache, scalar)
            for w in self.widths:
                out["reuse", w] = (program.reuse_program(cfg, fwd, bl, w, state, mesh),
                                   (weights, state, *program.row_args(state, 1), saved, scalar, scalar))
            out["read", 0] = (program.read_program(), (state.cache, scalar))
        out["move", 0] = (program.move_program(state, mesh), (state, scalar, scalar))
        if self.self_speculative:
            out.update(speculative.programs(cfg, fwd, bl, self.widths, self.spec_columns, weights, mesh))
        return out

    def describe(self, key: tuple[Any, ...]) -> str:
        """What a program of `programs` is, in words."""
        kind, n = key[:2]
        if kind == "block":
            return f"block program for {n} row{'s' if n > 1 else ''} x {self.columns} columns ({self.cache} cache)"
        if kind == "prefill":
            k = key[2]
            together = f", {k} at a time" if k > 1 else ""
            return (f"prefill program for prompts up to {n} tokens{together}" if self.cache == "prefix"
                    else f"admission program for {k} row{'s' if k > 1 else ''}")
        if kind == speculative.KIND:
            return f"self-speculative program for prompts up to {n} tokens"
        if kind == "reuse":
            return f"prefix-cache program for up to {n} new prompt tokens"
        return "row move program" if kind == "move" else "prefix-cache save program"

    def warm_up(self, log: Callable[[str], None] | None = None) -> None:
        """Compile every program of `programs` (idempotent); `log` gets one line per block and prefill program:
        "DESCRIPTION: SECONDS s [i/n]" with, before the last, an estimate of the time left (the mean so far)."""
        if self._move is not None:
            return
        say = log or (lambda _msg: None)
        state = self._empty_state()
        programs = self.programs(self.weights, state)
        start, n = time.perf_counter(), len(programs)
        for i, (key, (fn, args)) in enumerate(programs.items(), 1):
            t0 = time.perf_counter()
            exe = fn.lower(*args).compile()
            kind, size = key[:2]  # rows of a block program, prompt width of a prefill program
            if kind == "block":
                self._advance[size] = exe
            elif kind == "prefill":
                self._admit[size, key[2]] = exe
            elif kind == speculative.KIND:
                self._spec[size] = exe
            elif kind == "reuse":
                self._reuse[size] = exe
            elif kind == "read":
                self._read = exe
            else:
                self._move = exe
            if kind not in ("move", "read") and (kind != "prefill" or self.cache == "prefix"):
                now = time.perf_counter()
                left = f", about {(now - start) / i * (n - i):.0f} s left" if i < n else ""
                say(f"{self.describe(key)}: {now - t0:.1f} s [{i}/{n} programs{left}]")
        self._state = state

    def _empty_state(self) -> program.SlotState:
        """A state with no running row, placed on the mesh when there is one."""
        state = program.empty_state(self.cfg, self.forward_fn, self.capacity, self.columns, self.block_length,
                                    self.cache)
        return state if self.mesh is None else jax.device_put(state, program.state_shardings(state, self.mesh))

    def _row(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A new row's canvas / valid / block ids [S]: the prompt right before the first block of masks."""
        s, bl, n = self.columns, self.block_length, len(prompt)
        canvas = np.full((s,), self.cfg.filler_id, np.int32)
        canvas[s - bl - n:s - bl] = prompt
        canvas[s - bl:] = self.cfg.mask_token_id
        valid = np.zeros((s,), bool)
        valid[s - bl - n:] = True
        ids = np.zeros((s,), np.int32)
        ids[s - bl - n:s - bl] = masks.clean_block_ids(self.cfg, np.arange(n))
        ids[s - bl:] = s
        return canvas, valid, ids

    # ---- the client side --------------------------------------------------------------------------

    def submit(self, req: Request, on_event: Callable[[Event], None]) -> int:
        """Queue `req`; see the module docstring. Raises BadRequest, QueueFull or Draining."""
        req.check(self.block_length, self.cache, self.cfg.vocab_size, self.max_prompt, self.max_tokens,
                  speculative=self.self_speculative)
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFull(f"the queue holds {len(self._queue)} requests already; try again later")
            rid = self._next_id
            self._next_id += 1
            job = _Job(rid, req, on_event, req.row_settings(self.block_length))
            (self._spec_queue if req.sampling.self_speculative else self._queue).append(job)
            self._by_id[rid] = job
            self._lock.notify_all()
        return rid

    def cancel(self, rid: int) -> None:
        """Drop request `rid`: at once if it is still queued, else at the next block boundary; its last
        event has finish_reason "cancelled". Unknown or finished ids are ignored."""
        with self._lock:
            job = self._by_id.get(rid)
            if job is None:
                return
            job.cancelled = True
            queue = next((q for q in (self._queue, self._spec_queue) if job in q), None)
            if queue is not None:
                queue.remove(job)
                del self._by_id[rid]
                self._count.finished += 1
            else:
                job = None
            self._lock.notify_all()
        if job is not None:
            _deliver(job, Event((), "cancelled", 0, time.monotonic() - job.submitted))

    def stats(self) -> EngineStats:
        """The counters now."""
        with self._lock:
            c = self._count
            return EngineStats(c.admitted, c.finished, c.tokens, c.program_passes, c.row_passes,
                               len(self._queue) + len(self._spec_queue), sum(j is not None for j in self._slots)
                               + c.spec_running, self.capacity, c.blocks, c.rows_in_blocks, c.prefill_calls,
                               c.rows_prefilled, c.prefix_lookups, c.prefix_hits, c.prefix_tokens_reused,
                               len(self.prefix_store), self.prefix_store.nbytes)

    @property
    def draining(self) -> bool:
        """True once `drain` began."""
        return self._draining

    def start(self) -> None:
        """Compile (if not yet) and start the scheduler thread."""
        self.warm_up()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="clover-engine", daemon=True)
            self._thread.start()
        if self.self_speculative and self._spec_thread is None:
            self._spec_thread = threading.Thread(target=self._run_speculative, name="clover-speculative",
                                                 daemon=True)
            self._spec_thread.start()

    def drain(self, timeout: float | None = None) -> None:
        """Admit nothing new, let queued and running requests finish (starting the scheduler if it never
        was), then stop the scheduler thread."""
        if self._thread is None and (self._queue or self._spec_queue):
            self.start()
        with self._lock:
            self._draining = True
            self._stopping = True
            self._lock.notify_all()
        for thread in (self._thread, self._spec_thread):
            if thread is not None:
                thread.join(timeout)

    # ---- the scheduler ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not any(self._slots) and not self._stopping:
                    self._lock.wait()
                if self._stopping and not self._queue and not any(self._slots):
                    return
                # rows just freed: their clients' next requests are usually a few ms away, and a row left
                # empty now stays empty for a whole block; wait a little for as many requests as rows freed
                end = time.perf_counter() + min(self.admit_window_s, 0.05 * self._block_s)
                while (len(self._queue) < self._freed and any(self._slots) and not self._stopping
                       and time.perf_counter() < end):
                    self._lock.wait(end - time.perf_counter())
                self._freed = 0
                admitted = []
                while self._queue and self._n_running() < self.capacity:
                    slot = self._n_running()
                    job = self._queue.popleft()
                    job.queued_s = time.monotonic() - job.submitted
                    self._slots[slot] = job
                    admitted.append((slot, job))
                    self._count.admitted += 1
                running = list(self._slots[:self._n_running()])
            try:
                self._admit_all(admitted)
                self._block(running)
            except Exception as e:  # a device failure: every running request ends, the engine goes on
                self._fail(running, e)

    def _run_speculative(self) -> None:
        """The self-speculative lane: one request at a time, whole (`serving.speculative`)."""
        while True:
            with self._lock:
                while not self._spec_queue and not self._stopping:
                    self._lock.wait()
                if not self._spec_queue:
                    return
                job = self._spec_queue.popleft()
                job.queued_s = time.monotonic() - job.submitted
                self._count.admitted += 1
                self._count.spec_running += 1
            try:
                ev, passes = self._speculate(job)
            except Exception as e:  # a device failure ends this request; the lane goes on
                self.last_error = e
                logging.getLogger(__name__).error("the self-speculative program failed: %r", e)
                ev, passes = Event((), "error", 0, job.queued_s), 0
            with self._lock:
                c = self._count
                c.spec_running -= 1
                c.finished += 1
                c.tokens += len(ev.tokens)
                c.program_passes += passes
                c.row_passes += passes
                self._by_id.pop(job.rid, None)
            _deliver(job, ev._replace(finish_reason="cancelled") if job.cancelled else ev)

    def _speculate(self, job: _Job) -> tuple[Event, int]:
        req, bl = job.req, self.block_length
        width = next(w for w in self.widths if w >= len(req.prompt))
        batch = speculative.inputs(self.cfg, req.prompt, width, self.spec_columns, req.max_tokens, bl)
        out = self._spec[width](self.weights, batch.prompt, batch.lengths, batch.start,
                                knobs(job.settings, self.cfg))
        return speculative.event(self.cfg, jax.device_get(out), req.max_tokens, job.queued_s)

    def _n_running(self) -> int:
        """Rows in use: running requests are kept in slots [0, n)."""
        return next((i for i, j in enumerate(self._slots) if j is None), len(self._slots))

    def _width(self, job: _Job) -> int:
        """The prefill width of `job`'s prompt (0 without a cache: nothing is prefilled)."""
        n = len(job.req.prompt)
        return next(w for w in self.widths if w >= n) if self.cache == "prefix" else 0

    def _admit_all(self, admitted: list[tuple[int, _Job]]) -> None:
        """Admit the rows just taken from the queue: a prompt that begins with a saved one reuses its cache (a call
        of its own), the rest go in groups (`_groups`); then every admitted prompt's cache is saved. A request that
        says which of its first tokens a later one will begin with (`Request.keep`, a chat's conversation before the
        assistant's opening) is admitted in two calls when those tokens are not saved yet: up to there (saved),
        then the rest from it."""
        fresh = []
        for slot, job in admitted:
            prompt, g = job.req.prompt, self.prefix_store.grain
            hit = self._lookup(prompt, count=True)
            keep = job.req.keep if 0 < job.req.keep < len(prompt) else 0
            store = self.prefix_store
            if (self.prefix_cache and keep >= g and (hit.reused if hit else 0) < keep - keep % g
                    and store.entry_bytes <= store.budget_bytes):
                stem = prompt[:keep]  # a hit here is a saved prompt no longer than the stem: the stem begins with it
                if hit:
                    self._reuse_row(slot, job, stem, *hit)
                else:
                    self._prefill_rows([(slot, job)], [stem])
                saved = self._save(slot, stem)
                if saved is not None:
                    self._reuse_row(slot, job, prompt, saved, keep, keep - keep % g)
                else:  # (not kept: one saved prompt is more than the budget) the whole prompt again
                    self._prefill_rows([(slot, job)], [prompt])
                self._counted(job, hit, calls=2)
            elif hit:
                self._reuse_row(slot, job, prompt, *hit)
                self._counted(job, hit, calls=1)
            else:
                fresh.append((slot, job))
        for group in self._groups(fresh):
            self._prefill_rows(group, [job.req.prompt for _, job in group])
            with self._lock:
                self._count.prefill_calls += 1
                self._count.rows_prefilled += len(group)
        if self.prefix_cache:
            for slot, job in admitted:
                self._save(slot, job.req.prompt)

    def _counted(self, job: _Job, hit: Hit | None, calls: int) -> None:
        """The counters of a request admitted through the prefix cache in `calls` calls; `hit`: what it reused of
        what was saved before it came."""
        job.cached = hit.reused if hit else 0
        with self._lock:
            c = self._count
            c.prefill_calls += calls
            c.rows_prefilled += 1
            c.prefix_hits += hit is not None
            c.prefix_tokens_reused += job.cached

    def _lookup(self, prompt: tuple[int, ...], count: bool = False) -> Hit | None:
        """`prefix_store.lookup(prompt)` when the prefix cache is on (`count`: a lookup /metrics counts, one per
        request)."""
        if not self.prefix_cache:
            return None
        if count:
            with self._lock:
                self._count.prefix_lookups += 1
        return self.prefix_store.lookup(prompt)

    def _reuse_row(self, slot: int, job: _Job, prompt: tuple[int, ...], saved: Any, saved_len: int,
                   reused: int) -> None:
        """Row `slot` := `job` with `prompt`, its first `reused` tokens' cache taken from `saved`."""
        width = next(w for w in self.widths if w >= max(len(prompt) - reused, 1))
        canvas, valid, ids = self._row(prompt)
        row_knobs = jax.tree.map(lambda x: np.stack([x]), knobs(job.settings, self.cfg))
        self._state = self._reuse[width](self.weights, self._state, np.array([slot], np.int32), canvas[None],
                                         valid[None], ids[None], row_knobs,
                                         np.array([job.settings.n_blocks], np.int32), saved,
                                         np.int32(len(prompt) - saved_len), np.int32(reused))

    def _save(self, slot: int, prompt: tuple[int, ...]) -> Any | None:
        """Keep row `slot`'s cache (its prompt just admitted) for later prompts that begin with `prompt`
        (`PrefixStore.put`): the entry, or None when it cannot be kept."""
        return self.prefix_store.put(prompt, lambda: self._read(self._state.cache, np.int32(slot)))

    def _groups(self, admitted: list[tuple[int, _Job]]) -> list[list[tuple[int, _Job]]]:
        """The admitted rows in admission calls: by prompt width (a short prompt never pays for a long one's
        columns), at most `admit_rows[-1]` to a call, in the order they were queued."""
        by_width: dict[int, list[tuple[int, _Job]]] = {}
        for slot, job in admitted:
            by_width.setdefault(self._width(job), []).append((slot, job))
        top = self.admit_rows[-1]
        return [rows[i:i + top] for rows in by_width.values() for i in range(0, len(rows), top)]

    def _prefill_rows(self, group: list[tuple[int, _Job]], prompts: list[tuple[int, ...]]) -> None:
        """Rows of `group` := their requests with `prompts` (of one prefill width), in one call whose prefill runs
        them as one batch, padded to an admission size with copies of the first aimed at no row."""
        k = next(r for r in self.admit_rows if r >= len(group))
        pad = k - len(group)
        slots = np.array([slot for slot, _ in group] + [self.capacity] * pad, np.int32)
        jobs = [job for _, job in group] + [group[0][1]] * pad
        prompts = prompts + prompts[:1] * pad
        canvas, valid, ids = (np.stack(x) for x in zip(*(self._row(p) for p in prompts), strict=True))
        row_knobs = jax.tree.map(lambda *x: np.stack(x), *(knobs(j.settings, self.cfg) for j in jobs))
        n_blocks = np.array([j.settings.n_blocks for j in jobs], np.int32)
        width = next(w for w in self.widths if w >= len(prompts[0])) if self.cache == "prefix" else 0
        self._state = self._admit[width, k](self.weights, self._state, slots, canvas, valid, ids, row_knobs, n_blocks)

    def _block(self, running: list[_Job | None]) -> None:
        n = len(running)
        b = next(size for size in self.batch_sizes if size >= n)
        keep = np.zeros((b,), bool)
        keep[:n] = [j is not None and not j.cancelled for j in running]
        t0 = time.perf_counter()
        self._state, out = self._advance[b](self.weights, self._state, keep)
        tokens, finished, stopped, passes, row_passes = jax.device_get(tuple(out))
        self._block_s = time.perf_counter() - t0
        passes = int(passes)
        events: list[tuple[_Job, Event]] = []
        with self._lock:
            c = self._count
            c.blocks += 1
            c.program_passes += passes
            c.rows_in_blocks += int(keep.sum())
            for slot, job in enumerate(running):
                if job is None:
                    continue
                if not keep[slot]:
                    events.append((job, Event((), "cancelled", job.passes, job.queued_s)))
                    self._free(slot)
                    continue
                job.passes += int(row_passes[slot])
                c.row_passes += int(row_passes[slot])
                new = [int(t) for t in tokens[slot]]
                reason = None
                if stopped[slot]:
                    new = new[:new.index(self.cfg.eos_token_id)]
                    reason = "stop"
                room = job.req.max_tokens - job.produced
                if len(new) > room:  # cut at max_tokens before the end token: the length ran out first
                    new, reason = new[:room], "length"
                elif len(new) == room or finished[slot]:
                    reason = reason or "length"
                job.produced += len(new)
                c.tokens += len(new)
                events.append((job, Event(tuple(new), reason, job.passes, job.queued_s, job.cached)))
                if reason is not None:
                    self._free(slot)
            self._compact()
        for job, ev in events:
            _deliver(job, ev)

    def _free(self, slot: int) -> None:
        job = self._slots[slot]
        self._slots[slot] = None
        self._freed += 1
        if job is not None:
            self._by_id.pop(job.rid, None)
            self._count.finished += 1

    def _compact(self) -> None:
        """Move the last running rows into the holes, so running rows are [0, n) again."""
        while True:
            holes = [i for i, j in enumerate(self._slots) if j is None]
            last = max((i for i, j in enumerate(self._slots) if j is not None), default=-1)
            if not holes or holes[0] > last:
                return
            self._state = self._move(self._state, np.int32(last), np.int32(holes[0]))
            self._slots[holes[0]], self._slots[last] = self._slots[last], None

    def _fail(self, running: list[_Job | None], error: Exception) -> None:
        with self._lock:
            jobs = [j for j in running if j is not None]
            for slot, j in enumerate(self._slots):
                if j is not None:
                    self._free(slot)
        self.last_error = error
        logging.getLogger(__name__).error("the block program failed: %r", error)
        try:  # the failed call may have consumed the donated state: start again from an empty one
            self._state = self._empty_state()
        except Exception:
            logging.getLogger(__name__).exception("cannot rebuild the engine state")
        for job in jobs:
            _deliver(job, Event((), "error", job.passes, job.queued_s))


def _reuse_grain(cfg: ModelConfig, cache: str, mesh: MeshRules | None) -> tuple[int | None, str | None]:
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


def _deliver(job: _Job, event: Event) -> None:
    """Call the request's callback; an exception in it is the client's problem, never the scheduler's."""
    try:
        job.on_event(event)
    except Exception:
        logging.getLogger(__name__).exception("the event callback of request %d raised", job.rid)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ServingError(msg)
