"""The serving engine: a queue of requests, rows that join and leave at block boundaries, and a
scheduler thread that runs one compiled block program per batch bucket (`serving.program`).

Contract:
  * `Engine(weights, cfg, ...)` checks the model and the settings (ServingError, before any compile);
    `warm_up(log)` compiles every program the rows will ever run (one `advance` per batch bucket,
    one `admit` per prompt width and admission size, one `move`), so nothing compiles while serving rows; the
    lane's programs (below) compile on their first request, one per kind and prompt width, each logged;
  * `submit(request, on_event)` validates the request (BadRequest), queues it (QueueFull when the queue
    holds `queue_size`, Draining once `drain` began) and returns its id. `on_event(Event)` is called
    from the scheduler thread after every block the request committed; its last event has a
    finish_reason ("stop", "length", "cancelled", or "error" if the device program failed) and every
    event says how long the request waited for a row (`Event.queued_s`);
  * between two block calls the scheduler admits queued requests into free rows and drops cancelled
    ones; requests whose prompts share a prefill width are admitted together, up to `prefill_rows` in
    one call whose prefill runs their prompts as one batch; running rows stay in [0, n) and the call runs the
    smallest bucket that holds n, so one request alone runs at batch 1;
  * with `prefix_cache_gb` (and a model whose prompt can be cut: `admission.reuse_grain`), every admitted prompt's
    cache row is saved and a prompt that begins with a saved one is admitted from it, prefilling only its new tokens;
    a request's `keep` (a chat's conversation before the assistant's opening) is saved too (`serving.admission`).
    Exact: the tokens are those of a full prefill;
  * a request's tokens depend only on itself (its own knobs and random key, exact caches), never on
    what else shares the batch or what was served before it (up to float32 rounding: the batch bucket, the
    admission size and a reused prefix change how some sums are cut and ordered);
  * with `self_speculative` (a causal-prefix model), a request that asks for self-speculative or causal decoding
    (`SamplerConfig.self_speculative`, `SamplerConfig.causal`) runs alone on a lane of its own beside the rows,
    through the sampler's program of that kind (`serving.speculative`), and gets its whole response in one event.
    That program compiles when the lane first needs it (a kind and prompt width no request used before): a server
    starts without compiling all of them (two kinds times every prompt width), and only its first such request
    waits.
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
from clover_jax.model.forward_fn import ForwardFn, ModelForward
from clover_jax.model.moe import choose_dispatch
from clover_jax.sampler.generate import check_block_length
from clover_jax.sampler.settings import SamplerConfig, knobs, resolve_cache
from clover_jax.serving import program, speculative
from clover_jax.serving.admission import Admission, NewRow
from clover_jax.serving.requests import Draining, Event, QueueFull, Request, ServingError
from clover_jax.serving.stats import Counters, EngineStats


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
    self_speculative: bool = False  # also serve self-speculative and causal requests (a causal-prefix model's)
    prefill_rows: int = 4  # queued requests admitted (and their prompts prefilled) together in one call, at most
    prefix_cache_gb: float = 0.0  # device memory for saved prompts' caches (the prefix cache; 0: off); see above
    scaffold_classes: int = 0  # token classes a request's scaffold may define (0: requests carry no scaffold)
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
        need(isinstance(self.scaffold_classes, int) and self.scaffold_classes >= 0,
             f"scaffold_classes must be a non-negative integer, got {self.scaffold_classes!r}")
        if self.forward_fn is None:
            if self.dispatch is None and self.mesh is not None:  # on a mesh: its expert-parallel strategy
                self.dispatch = choose_dispatch(self.mesh)
            self.forward_fn = ModelForward(cfg, self.dispatch, self.mesh)
        self.spec_columns = _round_up(self.max_tokens, bl)  # a self-speculative request's generated columns
        # rows' scaffolds: (generated columns and one block more, token classes)
        self.scaffold = (self.spec_columns + bl, self.scaffold_classes) if self.scaffold_classes else None
        self.admission = Admission(cfg, self.forward_fn, bl, self.columns, self.cache, sizes[-1], self.prefill_rows,
                                   self.prefix_cache_gb, self.mesh, self.scaffold)
        self._queue: collections.deque[_Job] = collections.deque()
        self._slots: list[_Job | None] = [None] * sizes[-1]
        self._by_id: dict[int, _Job] = {}
        self._next_id = 0
        self._count = Counters()
        self._draining = False
        self._stopping = False
        self._freed = 0  # rows the last block call freed
        self._block_s = 0.0  # wall time of the last block call
        self._thread: threading.Thread | None = None
        self._advance: dict[int, Any] = {}
        self._move: Any = None
        self._state: program.SlotState | None = None
        self._spec_queue: collections.deque[_Job] = collections.deque()
        self._spec: dict[tuple[str, int], Any] = {}  # (speculative.KIND or CAUSAL, prompt width) -> the program
        self._spec_todo: dict[tuple[str, int], tuple[Any, tuple]] = {}  # the lane's programs not compiled yet
        self._say: Callable[[str], None] = lambda _msg: None  # warm_up's log
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
        out: dict[tuple[Any, ...], tuple[Any, tuple]] = {}
        for b in self.batch_sizes:
            out["block", b] = (program.block_program(cfg, fwd, bl, mode, b, state, mesh),
                               (weights, state, jax.ShapeDtypeStruct((b,), jnp.bool_)))
        out.update(self.admission.programs(weights, state))
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        out["move", 0] = (program.move_program(state, mesh), (state, scalar, scalar))
        if self.self_speculative:
            out.update(speculative.programs(cfg, fwd, bl, self.admission.widths, self.spec_columns, weights, mesh,
                                            self.columns if self.admission.prefix_cache else None))
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
        if kind in speculative.KINDS:
            what = "self-speculative" if kind == speculative.KIND else "causal (one token a pass)"
            return f"{what} program for prompts up to {n} tokens"
        if kind == "reuse":
            return f"prefix-cache program for up to {n} new prompt tokens"
        return "row move program" if kind == "move" else "prefix-cache save program"

    def warm_up(self, log: Callable[[str], None] | None = None, lane: bool = False) -> None:
        """Compile every program of `programs` but the lane's (idempotent); `log` gets one line per block and prefill
        program: "DESCRIPTION: SECONDS s [i/n]" with, before the last, an estimate of the time left (the mean so
        far), and later one line per lane program as its first request compiles it ("DESCRIPTION: SECONDS s (first
        use)"). `lane`: compile the lane's programs now too (a benchmark that times requests, not compiles)."""
        if self._move is None:
            self._say = log or (lambda _msg: None)
            state = self._empty_state()
            programs = self.programs(self.weights, state)
            self._spec_todo = {k: programs.pop(k) for k in list(programs) if k[0] in speculative.KINDS}
            start, n = time.perf_counter(), len(programs)
            for i, (key, (fn, args)) in enumerate(programs.items(), 1):
                t0 = time.perf_counter()
                exe = fn.lower(*args).compile()
                kind, size = key[:2]  # rows of a block program, prompt width of a prefill program
                if kind == "block":
                    self._advance[size] = exe
                elif kind == "move":
                    self._move = exe
                else:
                    self.admission.install(key, exe)
                if kind not in ("move", "read") and (kind != "prefill" or self.cache == "prefix"):
                    now = time.perf_counter()
                    left = f", about {(now - start) / i * (n - i):.0f} s left" if i < n else ""
                    self._say(f"{self.describe(key)}: {now - t0:.1f} s [{i}/{n} programs{left}]")
            self._state = state
        if lane:
            for key in list(self._spec_todo):
                self._lane_program(key)

    def _empty_state(self) -> program.SlotState:
        """A state with no running row, placed on the mesh when there is one."""
        state = program.empty_state(self.cfg, self.forward_fn, self.capacity, self.columns, self.block_length,
                                    self.cache, self.scaffold)
        return state if self.mesh is None else jax.device_put(state, program.state_shardings(state, self.mesh))

    # ---- the client side --------------------------------------------------------------------------

    def submit(self, req: Request, on_event: Callable[[Event], None]) -> int:
        """Queue `req`; see the module docstring. Raises BadRequest, QueueFull or Draining."""
        req.check(self.block_length, self.cache, self.cfg.vocab_size, self.max_prompt, self.max_tokens,
                  speculative=self.self_speculative, scaffold_classes=self.scaffold_classes or None,
                  mask_id=self.cfg.mask_token_id)
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFull(f"the queue holds {len(self._queue)} requests already; try again later")
            rid = self._next_id
            self._next_id += 1
            job = _Job(rid, req, on_event, req.row_settings(self.block_length))
            (self._spec_queue if speculative.kind(req.sampling) else self._queue).append(job)
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
            store = self.admission.store
            return self._count.snapshot(len(self._queue) + len(self._spec_queue),
                                        sum(j is not None for j in self._slots) + self._count.spec_running,
                                        self.capacity, len(store), store.nbytes)

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
        width = self.admission.width(len(req.prompt))
        batch = speculative.inputs(self.cfg, req.prompt, width, self.spec_columns, req.max_tokens, bl)
        run = self._lane_program((speculative.kind(job.settings), width))
        args = (self.weights, batch.prompt, batch.lengths, batch.start, knobs(job.settings, self.cfg))
        if not self.admission.prefix_cache:
            return speculative.event(self.cfg, jax.device_get(run(*args)), req.max_tokens, job.queued_s)
        reuse, tally = self.admission.lane_reuse(req.prompt, req.keep)
        out, stem = run(*args, reuse)
        self.admission.lane_save(req.prompt, reuse, stem)
        with self._lock:
            self._count.add(tally)
        return speculative.event(self.cfg, jax.device_get(out), req.max_tokens, job.queued_s, int(reuse.saved_len))

    def _lane_program(self, key: tuple[str, int]) -> Any:
        """The lane's compiled program `key`, compiled now if no request used it before (the lane thread only)."""
        if key not in self._spec:
            fn, args = self._spec_todo[key]
            t0 = time.perf_counter()
            self._spec[key] = fn.lower(*args).compile()
            self._spec_todo.pop(key, None)
            self._say(f"{self.describe(key)}: {time.perf_counter() - t0:.1f} s (first use)")
        return self._spec[key]

    def _n_running(self) -> int:
        """Rows in use: running requests are kept in slots [0, n)."""
        return next((i for i, j in enumerate(self._slots) if j is None), len(self._slots))

    def _admit_all(self, admitted: list[tuple[int, _Job]]) -> None:
        """Admit the rows just taken from the queue (`Admission.admit`) and count them."""
        rows = [NewRow(slot, job.req.prompt, job.req.keep, job.settings, job.req.scaffold) for slot, job in admitted]
        self._state, tally = self.admission.admit(self.weights, self._state, rows)
        for (_, job), r in zip(admitted, rows, strict=True):
            job.cached = r.cached
        with self._lock:
            self._count.add(tally)

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


def _deliver(job: _Job, event: Event) -> None:
    """Call the request's callback; an exception in it is the client's problem, never the scheduler's."""
    try:
        job.on_event(event)
    except Exception:
        logging.getLogger(__name__).exception("the event callback of request %d raised", job.rid)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ServingError(msg)
