"""Masked-diffusion sampling: `generate(weights, cfg, prompts, SamplerConfig(...))`.

This module checks the request (before anything compiles), pads prompts into a batch bucket and a
prompt bucket, compiles the loop of `program` once per static shape and runs it. The arithmetic of
one step lives in `scoring`.

    from clover_jax import SamplerConfig, generate
    res = generate(weights, cfg, [[5, 6, 7]], SamplerConfig(gen_length=64, block_length=32, steps=64))
    res.tokens[0], res.stats.nfe

Static (one compiled program each): model config, mesh, batch bucket, prompt bucket, gen_length,
block_length, cache mode, block grid, guidance on/off, progress callback on/off, record_logits. Dynamic
(never a recompile): steps, remasking, threshold, entropy_bound, temperature, top_p, top_k, cfg_scale
(> 0), seed, eos_stop, confidence. Compiled programs are kept per process (the 32 most recently used).

Block grid: `prompt` starts generated blocks at the end of each prompt and lays the prompt's blocks by
the model's `block_size` (LLaDA, Fast-dLLM); `absolute` lays every block of `block_length` positions
from position 0, so a prompt's last partial block is completed first and each block's schedule splits
`block_length` tokens (LLaDA2's `generate`). The two agree when every prompt is a multiple of the block.

Confidence (what low_confidence ranks and the threshold compares): `logits` is the probability of the
drawn token under the model's softmax at temperature 1, unfiltered (LLaDA, Fast-dLLM); `sampling` is
its probability under the tempered, top-k/top-p-filtered distribution it was drawn from (LLaDA2). At
temperature 0 both are the unfiltered softmax and top-k / top-p are ignored. The mask token is never
drawn (see `scoring.sample`).

Cache `auto` (the default) is the fastest exact mode: `prefix` for block-causal models, `none` for
bidirectional ones, where `prefix` / `dual` are approximations (see `program`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from clover_jax import compile_cache, kernels
from clover_jax.config import ModelConfig
from clover_jax.errors import SamplerError
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import masks
from clover_jax.model.moe import choose_dispatch
from clover_jax.sampler.program import (
    BLOCK_GRIDS,
    CACHE_MODES,
    ForwardFn,
    Knobs,
    ModelForward,
    ProgramOut,
    ProgramSpec,
    make_knobs,
    run_program,
    set_progress_sink,
)
from clover_jax.sampler.scoring import REMASKING, remasking_index

CONFIDENCES = ("logits", "sampling")
# What `auto` means per model family: the rules of the family's own reference generator (the block grid's
# is `masks.family_block_grid`, which training shares).
FAMILY_DEFAULTS: dict[str, dict[str, str]] = {"llada2_moe": {"confidence": "sampling"}}


@dataclass(frozen=True)
class SamplerConfig:
    """One sampling request's settings; `check_settings` says what is allowed. Hashable, never mutated."""

    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None  # total refinement steps over all blocks; None = gen_length (one token a step)
    remasking: str = "low_confidence"  # low_confidence | random | margin | entropy
    threshold: float = 0.0  # > 0: also commit every masked position whose confidence exceeds it
    entropy_bound: float = 0.0  # > 0: also commit the EB-sampler lowest-entropy prefix
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    cfg_scale: float = 0.0  # classifier-free guidance; 0 = off
    seed: int = 0
    cache: str = "auto"  # auto | none | prefix | dual (auto: prefix for block-causal models, else none: exact)
    eos_stop: bool = True  # a row stops at its first EOS once nothing before it is masked
    block_grid: str = "auto"  # auto | prompt | absolute (auto: absolute for llada2_moe models, else prompt)
    confidence: str = "auto"  # auto | logits | sampling (auto: sampling for llada2_moe models, else logits)

    @property
    def n_blocks(self) -> int:
        """Semi-autoregressive blocks: gen_length / block_length."""
        return self.gen_length // self.block_length

    @property
    def total_steps(self) -> int:
        """Refinement steps over all blocks (`steps`, or gen_length when unset)."""
        return self.gen_length if self.steps is None else self.steps

    def replace(self, **changes: Any) -> SamplerConfig:
        """A copy with `changes` (a frozen dataclass: the original is never mutated)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SamplerStats:
    """What one `generate` call cost and achieved."""

    nfe: int  # forward passes of the model (a guided cond+uncond pair is one pass over 2B rows)
    steps: int  # commit steps run
    tokens: int  # positions the sampler committed, all real rows (EOS fill excluded)
    rows: int
    wall_s: float  # the compiled loop, excluding compilation
    compile_s: float  # 0 when the program was already compiled
    compile_cached: bool = False  # the traced program came from the on-disk cache (another process traced it)

    @property
    def tokens_per_pass(self) -> float:
        """Tokens committed per forward pass per row: the parallelism of decoding."""
        return self.tokens / max(self.nfe, 1) / max(self.rows, 1)

    @property
    def tokens_per_s(self) -> float:
        """Committed tokens per second of the compiled loop (0 when it took no measurable time)."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """One human-readable line of these figures (what `clover generate` prints)."""
        return (f"{self.nfe} forward passes, {self.tokens_per_pass:.2f} tokens/pass, {self.tokens} tokens in "
                f"{self.wall_s:.2f} s ({self.tokens_per_s:.1f} tokens/s); compile {self.compile_s:.1f} s"
                + (" (from the compile cache)" if self.compile_cached else ""))


@dataclass
class GenerateResult:
    """The generated ids per prompt, with the raw canvas and the statistics."""

    tokens: list[list[int]]  # per prompt: generated ids before the first EOS
    finished: list[bool]  # the row produced an EOS
    raw: np.ndarray  # [n, gen_length] every generated column (masks left if steps ran out)
    stats: SamplerStats
    logits: np.ndarray | None = None  # [n, gen_length, V] with record_logits


# ---- validation ------------------------------------------------------------------------------


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise SamplerError(msg)


def validate(cfg: ModelConfig, sc: SamplerConfig, prompts: Sequence[Sequence[int]]) -> None:
    """Raise SamplerError naming the first problem. Cheap: runs before any tracing."""
    check_settings(sc)
    check_prompts(cfg, sc, prompts)


def check_settings(sc: SamplerConfig) -> None:
    """The sampler settings alone (no model needed)."""
    need = _need
    need(isinstance(sc.gen_length, int) and sc.gen_length > 0, f"gen_length must be a positive integer, got "
         f"{sc.gen_length!r}")
    need(isinstance(sc.block_length, int) and sc.block_length > 0,
         f"block_length must be a positive integer, got {sc.block_length!r}")
    need(sc.gen_length % sc.block_length == 0,
         f"gen_length ({sc.gen_length}) must be a multiple of block_length ({sc.block_length})")
    need(isinstance(sc.total_steps, int) and sc.total_steps >= sc.n_blocks,
         f"steps ({sc.total_steps}) must be at least the number of blocks "
         f"(gen_length / block_length = {sc.n_blocks})")
    need(sc.remasking in REMASKING, f"unknown remasking strategy {sc.remasking!r}; choose one of {tuple(REMASKING)}")
    need(sc.cache in ("auto", *CACHE_MODES),
         f"unknown cache mode {sc.cache!r}; choose one of {('auto', *CACHE_MODES)}")
    need(sc.threshold == 0 or 0 < sc.threshold <= 1, f"threshold must be in (0, 1] (or 0 = off), got {sc.threshold}")
    need(sc.entropy_bound >= 0 and math.isfinite(sc.entropy_bound),
         f"entropy_bound must be >= 0 (0 = off), got {sc.entropy_bound}")
    need(sc.temperature >= 0 and math.isfinite(sc.temperature), f"temperature must be >= 0, got {sc.temperature}")
    need(0 < sc.top_p <= 1, f"top_p must be in (0, 1], got {sc.top_p}")
    need(isinstance(sc.top_k, int) and sc.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {sc.top_k!r}")
    need(sc.cfg_scale >= 0 and math.isfinite(sc.cfg_scale), f"cfg_scale must be >= 0, got {sc.cfg_scale}")
    need(isinstance(sc.seed, int), f"seed must be an integer, got {sc.seed!r}")
    need(sc.block_grid in ("auto", *BLOCK_GRIDS),
         f"unknown block grid {sc.block_grid!r}; choose one of {('auto', *BLOCK_GRIDS)}")
    need(sc.confidence in ("auto", *CONFIDENCES),
         f"unknown confidence rule {sc.confidence!r}; choose one of {('auto', *CONFIDENCES)}")


def check_model(cfg: ModelConfig) -> None:
    """A model the sampler can run (no weights needed)."""
    _need(not cfg.is_hybrid or cfg.is_block_causal,
          f"config {cfg.name!r} has Gated DeltaNet layers but bidirectional attention: the sampler runs hybrid "
          "models block-causally (attention='block_causal')")


def check_prompts(cfg: ModelConfig, sc: SamplerConfig, prompts: Sequence[Sequence[int]]) -> None:
    """A model the sampler can run, token ids inside the vocabulary and prompt + generation within the
    model's length."""
    need = _need
    check_model(cfg)
    need(not cfg.is_bd_gdn or sc.block_length <= cfg.block_size,
         f"block_length {sc.block_length} is longer than the model's blocks ({cfg.block_size}): its block-diffusion "
         f"Gated DeltaNet layers see one block at a time; use block_length <= {cfg.block_size}")
    need(len(prompts) > 0, "no prompts given")
    for i, pr in enumerate(prompts):
        need(len(pr) > 0, f"prompt {i} is empty")
        arr = np.asarray(pr)
        need(np.issubdtype(arr.dtype, np.integer), f"prompt {i} must hold integer token ids")
        lo, hi = int(arr.min()), int(arr.max())
        need(lo >= 0 and hi < cfg.vocab_size,
             f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {cfg.vocab_size})")
        total = len(pr) + sc.gen_length
        if resolve_rule(cfg, "block_grid", sc.block_grid) == "absolute":  # the last block is generated whole
            total = -(-total // sc.block_length) * sc.block_length
        need(total <= cfg.max_seq_len,
             f"prompt {i} has {len(pr)} tokens; with gen_length {sc.gen_length} that is "
             f"{total} > the model's max_seq_len {cfg.max_seq_len}")


# ---- batching --------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def batch_bucket(n: int, mesh: MeshRules | None = None) -> int:
    """Rows: the next power of two, and a multiple of the mesh's data axis on a mesh."""
    b = _next_pow2(n)
    if mesh is not None:
        data = mesh.size("data")
        b = -(-b // data) * data
    return b


def prompt_bucket(longest: int, block_length: int) -> int:
    """Prompt columns: block_length times a power of two, so a few shapes cover many prompts."""
    return block_length * _next_pow2(-(-longest // block_length))


class Batch(NamedTuple):
    """Prompts laid out for the program (host arrays)."""

    prompt: np.ndarray  # [B, P] int32, left-padded
    lengths: np.ndarray  # [B] int32 valid prompt columns (0: a filler row)
    start: np.ndarray  # [B, G'] int32 the generated columns' first tokens
    tail: np.ndarray  # [B] int32 prompt tokens placed in the generated columns (absolute grid), else 0


def prepare_batch(prompts: Sequence[Sequence[int]], block_length: int, cfg: ModelConfig, gen_length: int,
                  batch: int | None = None, prompt_len: int | None = None, mesh: MeshRules | None = None,
                  block_grid: str = "prompt") -> Batch:
    """Left-pad prompts into the batch and prompt buckets; filler rows have length 0.

    On the absolute grid a prompt's last `len % block_length` tokens open the generated columns, which
    then hold one block more (G' = gen_length + block_length) whenever some prompt has such a tail."""
    tails = [len(x) % block_length if block_grid == "absolute" else 0 for x in prompts]
    heads = [len(x) - t for x, t in zip(prompts, tails, strict=True)]
    g = gen_length + (block_length if any(tails) else 0)
    b = batch_bucket(len(prompts), mesh) if batch is None else batch
    p = prompt_bucket(max(heads), block_length) if prompt_len is None else prompt_len
    if b < len(prompts) or p < max(heads):
        raise SamplerError(f"buckets of {b} rows x {p} columns cannot hold {len(prompts)} prompts of up to "
                           f"{max(heads)} tokens")
    out = np.full((b, p), cfg.filler_id, np.int32)
    lens = np.zeros((b,), np.int32)
    start = np.full((b, g), cfg.filler_id, np.int32)
    for i, (pr, n) in enumerate(zip(prompts, heads, strict=True)):
        arr = np.asarray(pr, np.int32)
        if n:
            out[i, p - n:] = arr[:n]
        start[i] = cfg.mask_token_id
        start[i, :len(arr) - n] = arr[n:]
        lens[i] = n
    return Batch(out, lens, start, np.asarray(tails + [0] * (b - len(prompts)), np.int32))


# ---- compiled programs -----------------------------------------------------------------------

# The jitted sampling program: PROGRAM_JIT.lower(spec, forward_fn, weights, prompt, lengths, start, knobs)
# is what `generate` compiles (`compiled_program`) and what `clover plan --generate` compiles for a TPU
# topology without running it (`Prepared.abstract_args`).
PROGRAM_JIT = jax.jit(run_program, static_argnums=(0, 1))

_PROGRAMS: OrderedDict[Any, Any] = OrderedDict()  # least recently used first
_MAX_PROGRAMS = 32
_COMPILES = [0]


def compile_count() -> int:
    """How many sampling programs this process has compiled (tests watch it)."""
    return _COMPILES[0]


def compiled_program(spec: ProgramSpec, forward_fn: ForwardFn, weights: Any, batch: Batch, knobs: Knobs,
                     on_compile: Callable[[str], None] | None = None) -> tuple[Callable[..., ProgramOut], float, bool]:
    """The AOT-compiled program for these static settings, the seconds spent compiling it now, and
    whether it came from the on-disk cache (`compile_cache`; used when it is on, for one-device programs
    without a progress callback, which a serialized program cannot hold)."""
    key = (spec, forward_fn)
    if key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return _PROGRAMS[key], 0.0, False
    t0 = time.perf_counter()
    args = (weights, batch.prompt, batch.lengths, batch.start, knobs)
    from_disk = False
    disk = compile_cache.directory() is not None and not spec.progress and spec.mesh is None
    if on_compile is not None:
        on_compile(f"compiling the sampler for {spec.batch} x {spec.prompt_len + spec.gen_length} tokens "
                   + ("(or loading it from the compile cache) ..." if disk else "(once per shape) ..."))
    if disk:
        exe, from_disk = _cached_program(spec, forward_fn, args)
    else:
        exe = PROGRAM_JIT.lower(spec, forward_fn, *args).compile()
    _PROGRAMS[key] = exe
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    _COMPILES[0] += 1
    return exe, time.perf_counter() - t0, from_disk


def _cached_program(spec: ProgramSpec, forward_fn: ForwardFn, args: tuple) -> tuple[Callable[..., ProgramOut], bool]:
    """The program compiled once per machine and code version (`compile_cache.load_or_compile`); it takes
    and returns flat arrays, wrapped back into the usual signature."""
    leaves, treedef = jax.tree.flatten(args)
    has_logits = spec.record_logits

    def flat(*xs: Any) -> tuple:
        out = run_program(spec, forward_fn, *jax.tree.unflatten(treedef, xs))
        return tuple(out[:4]) + ((out.logits,) if has_logits else ())

    avals = [(tuple(np.shape(x)), str(np.result_type(x))) for x in leaves]
    key = repr((spec, forward_fn, treedef, avals, jax.devices()[0].platform, kernels.available()))
    exe, from_disk = compile_cache.load_or_compile(key, flat, leaves)

    def call(*a: Any) -> ProgramOut:
        out = exe(*jax.tree.leaves(a))
        return ProgramOut(*out[:4], out[4] if has_logits else None)

    return call, from_disk


def resolve_cache(cfg: ModelConfig, cache: str) -> str:
    """`auto` -> the fastest exact mode: prefix for block-causal models, none for bidirectional ones.
    Block-causal `dual` is the `prefix` program (later blocks are invisible anyway)."""
    if cache == "auto":
        return "prefix" if cfg.is_block_causal else "none"
    return "prefix" if (cache == "dual" and cfg.is_block_causal) else cache


def resolve_rule(cfg: ModelConfig, name: str, value: str) -> str:
    """`auto` -> the family's rule for `name`: block_grid by `masks.resolve_block_grid` (the rule training
    shares), confidence by `FAMILY_DEFAULTS` (else logits); anything else is returned as given."""
    if name == "block_grid":
        return masks.resolve_block_grid(cfg, value)
    if value != "auto":
        return value
    return FAMILY_DEFAULTS.get(cfg.family, {}).get(name, CONFIDENCES[0])


def knobs_for(sc: SamplerConfig, cfg: ModelConfig, n_blocks: int | None = None) -> Knobs:
    """The traced knobs of a request (changing them never recompiles); `n_blocks`: the program's blocks
    when the absolute grid adds one (the steps per block stay those of `sc`)."""
    steps = sc.total_steps if n_blocks is None else (sc.total_steps // sc.n_blocks) * n_blocks
    return make_knobs(steps=steps, temperature=sc.temperature, top_p=sc.top_p, top_k=sc.top_k,
                      threshold=sc.threshold, entropy_bound=sc.entropy_bound, cfg_scale=sc.cfg_scale,
                      remasking=remasking_index(sc.remasking), eos_stop=sc.eos_stop, seed=sc.seed,
                      sampled_confidence=resolve_rule(cfg, "confidence", sc.confidence) == "sampling")


@dataclass(frozen=True)
class Prepared:
    """A checked request laid out for the compiled program (`prepare`): `PROGRAM_JIT.lower(spec, forward_fn,
    *args)` with `args` = (weights, inputs.prompt, inputs.lengths, inputs.start, knobs) is the program
    `generate` compiles and runs."""

    spec: ProgramSpec
    forward_fn: ForwardFn
    inputs: Batch
    knobs: Knobs

    def abstract_args(self, weights: Any) -> tuple:
        """The program's arguments after (spec, forward_fn) with the host arrays as unsharded
        ShapeDtypeStructs (`generate` passes host arrays, which the compiled program places itself) and
        `weights` as given (on a mesh: ShapeDtypeStructs in their shardings), for lowering without data."""
        def aval(x: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(np.shape(x), np.result_type(x))

        rest = (self.inputs.prompt, self.inputs.lengths, self.inputs.start, self.knobs)
        return (weights, *jax.tree.map(aval, rest))


def prepare(cfg: ModelConfig, prompts: Sequence[Sequence[int]], sc: SamplerConfig, *,
            forward_fn: ForwardFn | None = None, progress: bool = False, record_logits: bool = False,
            batch: int | None = None, prompt_len: int | None = None, dispatch: str | None = None,
            mesh: MeshRules | None = None) -> Prepared:
    """Check a request (`validate`; SamplerError names the first problem) and lay it out: the static
    `ProgramSpec`, the forward function, the bucketed host inputs and the traced knobs. Nothing is
    traced or compiled. The arguments mean what they mean for `generate` (`progress`: whether a
    progress callback is compiled in)."""
    validate(cfg, sc, prompts)
    if forward_fn is None:
        if dispatch is None and mesh is not None:  # on a mesh: the expert-parallel strategy for it
            dispatch = choose_dispatch(mesh)
        forward_fn = ModelForward(cfg, dispatch, mesh)
    grid = resolve_rule(cfg, "block_grid", sc.block_grid)
    inputs = prepare_batch(prompts, sc.block_length, cfg, sc.gen_length, batch, prompt_len, mesh, grid)
    if inputs.prompt.shape[1] < sc.block_length:  # the cached first step re-encodes the block before block 0
        raise SamplerError(f"prompt_len={inputs.prompt.shape[1]} must be at least block_length ({sc.block_length})")
    cache = resolve_cache(cfg, sc.cache)
    if cache != "none" and not hasattr(forward_fn, "init_cache"):
        raise SamplerError(f"cache={cache!r} needs a forward function with an init_cache(rows, length) method")
    g = inputs.start.shape[1]
    spec = ProgramSpec(cfg, inputs.prompt.shape[0], inputs.prompt.shape[1], g, sc.block_length, cache,
                       guidance=sc.cfg_scale > 0, progress=progress, record_logits=record_logits,
                       mesh=mesh, block_grid=grid)
    return Prepared(spec, forward_fn, inputs, knobs_for(sc, cfg, g // sc.block_length))


def generate(
    weights: Any,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    sc: SamplerConfig,
    *,
    forward_fn: ForwardFn | None = None,
    progress: Callable[[np.ndarray, int, int], None] | None = None,
    record_logits: bool = False,
    batch: int | None = None,
    prompt_len: int | None = None,
    dispatch: str | None = None,
    mesh: MeshRules | None = None,
    on_compile: Callable[[str], None] | None = None,
) -> GenerateResult:
    """Fill `gen_length` masked positions after each prompt (lists of token ids).

    forward_fn: replaces the model (tests inject scripted logits); default `ModelForward(cfg)`.
    progress(tokens [B, G], block, nfe): called after every step from inside the compiled loop.
    batch / prompt_len: force the buckets (default: next power of two rows, block_length * 2^k columns).
    dispatch: the MoE dispatch; default the config's, or `moe.choose_dispatch(mesh)` on a mesh.
    mesh: run sharded on this mesh (weights already in `model.weight_shardings` of it); None: one device.
    on_compile(message): called before a program is compiled (not when this process already has it).
    """
    prep = prepare(cfg, prompts, sc, forward_fn=forward_fn, progress=progress is not None,
                   record_logits=record_logits, batch=batch, prompt_len=prompt_len, dispatch=dispatch, mesh=mesh)
    spec, forward_fn, inputs, knobs = prep.spec, prep.forward_fn, prep.inputs, prep.knobs
    exe, compile_s, cached = compiled_program(spec, forward_fn, weights, inputs, knobs, on_compile)
    if progress is not None and inputs.tail.any():  # report each row's generated columns only
        user, tail = progress, inputs.tail

        def progress(toks: np.ndarray, blk: int, nfe: int) -> None:
            user(np.stack([r[t:t + sc.gen_length] for r, t in zip(toks, tail, strict=True)]), blk, nfe)

    set_progress_sink(progress)
    try:
        t0 = time.perf_counter()
        out = jax.block_until_ready(exe(weights, inputs.prompt, inputs.lengths, inputs.start, knobs))
        if progress is not None:
            jax.effects_barrier()
        wall = time.perf_counter() - t0
    finally:
        set_progress_sink(None)
    n = len(prompts)
    canvas = np.asarray(out.tokens)[:n]
    raw = np.stack([canvas[i, t:t + sc.gen_length] for i, t in enumerate(inputs.tail[:n])])
    result_tokens, finished = [], []
    for row in raw:
        hits = np.flatnonzero(row == cfg.eos_token_id) if cfg.eos_token_id is not None else np.zeros(0, int)
        end = int(hits[0]) if hits.size else len(row)
        result_tokens.append([int(x) for x in row[:end]])
        finished.append(bool(hits.size))
    stats = SamplerStats(nfe=int(out.nfe), steps=int(out.steps), tokens=int(np.asarray(out.committed)[:n].sum()),
                         rows=n, wall_s=wall, compile_s=compile_s, compile_cached=cached)
    logits = None if out.logits is None else np.stack(
        [np.asarray(out.logits)[i, t:t + sc.gen_length] for i, t in enumerate(inputs.tail[:n])])
    return GenerateResult(result_tokens, finished, raw, stats, logits)
