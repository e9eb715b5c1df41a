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

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from clover_jax import compile_cache, kernels
from clover_jax.config import ModelConfig
from clover_jax.errors import SamplerError
from clover_jax.mesh.rules import MeshRules
from clover_jax.model.forward_fn import ForwardFn, ModelForward
from clover_jax.model.moe import choose_dispatch
from clover_jax.sampler.program import ProgramOut, ProgramSpec, run_program, set_progress_sink
from clover_jax.sampler.settings import (
    Knobs,
    SamplerConfig,
    check_settings,
    knobs,
    resolve_cache,
    resolve_rule,
)


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


def validate(cfg: ModelConfig, sc: SamplerConfig, prompts: Sequence[Sequence[int]],
             spell: Mapping[str, str] | None = None) -> None:
    """Raise SamplerError naming the first problem (settings spelt as `spell` has them, `settings.FLAGS` on the
    command line). Cheap: runs before any tracing."""
    check_settings(sc, spell)
    check_prompts(cfg, sc, prompts, spell)


def check_model(cfg: ModelConfig) -> None:
    """A model the sampler can run (no weights needed)."""
    _need(not cfg.is_hybrid or cfg.is_block_causal,
          f"config {cfg.name!r} has Gated DeltaNet layers but bidirectional attention: the sampler runs hybrid "
          "models block-causally (attention='block_causal')")


def check_block_length(cfg: ModelConfig, block_length: int, spelt: str = "block_length") -> None:
    """SamplerError unless `cfg` can denoise blocks of `block_length`: Clover's block-diffusion Gated DeltaNet sees
    one of its own blocks at a time, so a block may not be longer (`spelt`: the setting as the user wrote it)."""
    if cfg.is_bd_gdn and block_length > cfg.block_size:
        raise SamplerError(f"{spelt} {block_length} is longer than the model's blocks ({cfg.block_size}): its "
                           f"block-diffusion Gated DeltaNet layers see one block at a time; use {spelt} <= "
                           f"{cfg.block_size}", setting="block_length", param=spelt)


def check_prompts(cfg: ModelConfig, sc: SamplerConfig, prompts: Sequence[Sequence[int]],
                  spell: Mapping[str, str] | None = None, labels: Sequence[Any] | None = None) -> None:
    """A model the sampler can run, token ids inside the vocabulary and prompt + generation within the
    model's length. `labels`: what to call each prompt in a message, as written (default "prompt INDEX");
    `spell` as for `validate`."""
    need = _need
    name = (lambda n: (spell or {}).get(n, n))
    check_model(cfg)
    check_block_length(cfg, sc.block_length, name("block_length"))
    need(len(prompts) > 0, "no prompts given")
    for i, pr in enumerate(prompts):
        label = str(labels[i]) if labels is not None else f"prompt {i}"
        need(len(pr) > 0, f"{label} is empty")
        arr = np.asarray(pr)
        need(np.issubdtype(arr.dtype, np.integer), f"{label} must hold integer token ids")
        lo, hi = int(arr.min()), int(arr.max())
        need(lo >= 0 and hi < cfg.vocab_size,
             f"{label} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {cfg.vocab_size})")
        total = len(pr) + sc.gen_length
        if resolve_rule(cfg, "block_grid", sc.block_grid) == "absolute":  # the last block is generated whole
            total = -(-total // sc.block_length) * sc.block_length
        if total > cfg.max_seq_len:
            raise SamplerError(f"{label} has {len(pr)} tokens; with {name('gen_length')} {sc.gen_length} that is "
                               f"{total} > the model's max_seq_len {cfg.max_seq_len}", setting="gen_length",
                               param=name("gen_length"))


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
        on_compile(f"compiling the sampler for {spec.batch} x {spec.prompt_len + spec.gen_columns} tokens "
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


def _check_speculative(cfg: ModelConfig, sc: SamplerConfig, prompts: Sequence[Sequence[int]], progress: bool,
                       record_logits: bool, batch: int | None) -> None:
    """SamplerError for what self-speculative or causal decoding cannot do (`speculative`: a causal-prefix model,
    one sequence a program, the prefix cache, the prompt grid; no progress callback or recorded logits)."""
    mode = "causal" if sc.causal else "self_speculative"
    why = ("the model is not run with a causal prefix (bd_gdn='causal_prefix'): it has no causal model to "
           + ("decode with" if sc.causal else "check the drafts") if not cfg.causal_prefix else
           "it runs one sequence a program" if len(prompts) != 1 or (batch or 1) != 1 else
           "it needs the prefix cache" if resolve_cache(cfg, sc.cache) != "prefix" else
           "it lays blocks right after the prompt (block_grid prompt)"
           if resolve_rule(cfg, "block_grid", sc.block_grid) != "prompt" else
           "it has no progress callback or recorded logits" if progress or record_logits else None)
    if why:
        raise SamplerError(f"{mode}: {why}", setting=mode, param=mode)


def prepare(cfg: ModelConfig, prompts: Sequence[Sequence[int]], sc: SamplerConfig, *,
            forward_fn: ForwardFn | None = None, progress: bool = False, record_logits: bool = False,
            batch: int | None = None, prompt_len: int | None = None, dispatch: str | None = None,
            mesh: MeshRules | None = None) -> Prepared:
    """Check a request (`validate`; SamplerError names the first problem) and lay it out: the static
    `ProgramSpec`, the forward function, the bucketed host inputs and the traced knobs. Nothing is
    traced or compiled. The arguments mean what they mean for `generate` (`progress`: whether a
    progress callback is compiled in)."""
    validate(cfg, sc, prompts)
    if sc.self_speculative or sc.causal:
        _check_speculative(cfg, sc, prompts, progress, record_logits, batch)
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
                       mesh=mesh, block_grid=grid, self_speculative=sc.self_speculative,
                       causal=sc.causal)
    return Prepared(spec, forward_fn, inputs, knobs(sc, cfg))


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
    if (sc.self_speculative or sc.causal) and len(prompts) > 1:  # one sequence a program: the prompts one after another
        parts = [generate(weights, cfg, [pr], sc, forward_fn=forward_fn, progress=progress,
                          record_logits=record_logits, prompt_len=prompt_len, dispatch=dispatch, mesh=mesh,
                          on_compile=on_compile) for pr in prompts]
        st = [r.stats for r in parts]
        stats = SamplerStats(sum(s.nfe for s in st), sum(s.steps for s in st), sum(s.tokens for s in st), len(st),
                             sum(s.wall_s for s in st), sum(s.compile_s for s in st), any(s.compile_cached for s in st))
        return GenerateResult([r.tokens[0] for r in parts], [r.finished[0] for r in parts],
                              np.concatenate([r.raw for r in parts]), stats)
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
    canvas = _on_host(out.tokens)[:n]
    raw = np.stack([canvas[i, t:t + sc.gen_length] for i, t in enumerate(inputs.tail[:n])])
    result_tokens, finished = [], []
    for row in raw:
        hits = np.flatnonzero(row == cfg.eos_token_id) if cfg.eos_token_id is not None else np.zeros(0, int)
        end = int(hits[0]) if hits.size else len(row)
        result_tokens.append([int(x) for x in row[:end]])
        finished.append(bool(hits.size))
    stats = SamplerStats(nfe=int(out.nfe), steps=int(out.steps), tokens=int(_on_host(out.committed)[:n].sum()),
                         rows=n, wall_s=wall, compile_s=compile_s, compile_cached=cached)
    logits = None
    if out.logits is not None:
        every = _on_host(out.logits)  # once: a collective on a multi-host mesh
        logits = np.stack([every[i, t:t + sc.gen_length] for i, t in enumerate(inputs.tail[:n])])
    return GenerateResult(result_tokens, finished, raw, stats, logits)


def _on_host(x: jax.Array) -> np.ndarray:
    """The whole of a program output in this process: as it is when this process holds all of it (one process, or
    replicated), else gathered from every process (a multi-host mesh whose data axis spans processes shards the
    rows across them; a collective, which every process reaches at the same point)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
