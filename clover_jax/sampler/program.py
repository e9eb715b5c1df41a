"""The sampling program: one jit-compiled, fixed-shape denoising loop over a canvas [B, P + G].

Layout: prompts left-padded to P columns, then G generated columns that start as the mask token.
Generated block j covers columns [P + j*L, P + (j+1)*L) (L = block_length). On the absolute block
grid (LLaDA2's) a prompt's last n % L tokens open generated block 0 instead (the prompt's partial
block is completed first), every block is L positions from position 0, and each block's schedule
splits L tokens over its steps (LLaDA2) rather than the block's masks (LLaDA). An outer
`lax.while_loop` walks the blocks, an inner one runs the refinement steps of a block; a block ends
when its steps are spent or it has no mask left, the loop ends when every row is done.

Attention metadata comes from `model.masks`: positions count only valid (non-padding) columns, so
left padding never shifts a row; `masks.canvas_block_ids` numbers the prompt's and the generated
blocks so that the first generated block sees the whole prompt and the prompt never sees the
generation. With block-causal models this makes caching exact.

Cache modes (W = width of the window each step runs, NFE = forward passes):
  none    every step runs the whole canvas [B, P+G] (logits only for the current block).
  prefix  block-causal: prefill the prompt once; the first step of block j runs [block j-1, block j]
          (writing block j-1's final K/V and scoring block j in one pass), later steps run only
          block j against the cache. Exact. Bidirectional: the first step of each block is a full
          pass that refreshes the whole cache; later steps run [block j .. end] against the refreshed
          prefix, in the narrowest of the static widths L, 2L, 4L, ..., G that holds it
          (`window_widths`; the cache has G extra padding columns for the overhang). Approximate.
  dual    block-causal: same as prefix (later blocks are invisible anyway). Exact.
          Bidirectional: refresh at block start, then run only block j against the stale prefix
          and suffix (Fast-dLLM's dual cache). Approximate.

Hybrid models (Gated DeltaNet layers, always block-causal here) cache, besides the attention layers'
K/V, each Gated DeltaNet layer's recurrent state and conv tail *after the committed columns*: the
prefill writes the prompt's; refinement passes over block j read it and write nothing back (commit=0);
the first pass of block j > 0 runs [block j-1, block j] from the state before block j-1 and keeps the
state after it. Every pass over block j therefore sees exactly what the cache-free pass over the whole
canvas sees (the committed blocks through the state, block j itself), so the cache is exact, and a
refinement pass costs one block in the Gated DeltaNet layers whatever the context length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import masks, transformer
from clover_jax.sampler.scoring import fill_after_end, guide, sample_and_score, select_commits, transfer_count

Array = jax.Array
CACHE_MODES = ("none", "prefix", "dual")
BLOCK_GRIDS = masks.BLOCK_GRIDS

# forward_fn(weights, tokens [R, W], positions [R, W], mask [R, W, S], cache | None, cache_offset,
#            logits_start, logits_len) -> (logits [R, logits_len, V] float32, cache | None)
ForwardFn = Callable[..., tuple[Array, Any]]
# init_cache_fn(rows, length) -> cache pytree
InitCacheFn = Callable[[int, int], Any]


@dataclass(frozen=True)
class ModelForward:
    """The real model as the sampler's forward function (hashable, so programs can be cached)."""

    cfg: ModelConfig
    dispatch: str | None = None
    mesh: MeshRules | None = None

    def __call__(self, weights: Any, tokens: Array, positions: Array, mask: Array, cache: Any,
                 cache_offset: Array, logits_start: Array | int, logits_len: int, *, valid: Array | None = None,
                 blocks: Array | None = None, commit: Array | int | None = None) -> tuple[Array, Any]:
        """valid / blocks / commit: for Gated DeltaNet layers (hybrid configs), see `transformer.forward`."""
        out = transformer.forward(weights, self.cfg, tokens, positions, mask, cache, cache_offset,
                                  logits_start=logits_start, logits_len=logits_len, dispatch=self.dispatch,
                                  mesh=self.mesh, valid=valid, blocks=blocks, commit=commit)
        return out.logits, out.cache

    def init_cache(self, rows: int, length: int) -> transformer.KVCache:
        """A zeroed K/V cache of `rows` x `length` columns for every layer."""
        return transformer.init_cache(self.cfg, rows, length)


@dataclass(frozen=True)
class ProgramSpec:
    """Everything that changes the compiled program (its shapes or its code)."""

    model: ModelConfig
    batch: int  # batch bucket B
    prompt_len: int  # prompt bucket P
    gen_length: int  # G
    block_length: int  # L
    cache: str = "none"
    guidance: bool = False  # classifier-free guidance doubles the rows; its scale stays dynamic
    progress: bool = False  # compile in the progress callback
    record_logits: bool = False  # keep the logits each token was committed from (tests, debugging)
    mesh: MeshRules | None = None  # where the program runs (None: one device)
    block_grid: str = "prompt"  # absolute: every block holds L canvas columns from position 0 (see `generate`)

    @property
    def n_blocks(self) -> int:
        """Generated blocks: gen_length / block_length."""
        return self.gen_length // self.block_length

    @property
    def extra_columns(self) -> int:
        """Padding columns after the canvas: G for a bidirectional model's prefix cache (its fixed-width
        [block j .. end] windows overhang the canvas), else 0."""
        return self.gen_length if (self.cache == "prefix" and not self.model.is_block_causal) else 0

    @property
    def model_rows(self) -> int:
        """Rows each forward pass runs (and the cache holds): 2B with guidance, else B."""
        return 2 * self.batch if self.guidance else self.batch

    @property
    def cache_columns(self) -> int:
        """Columns of the cache the program allocates (P + G + `extra_columns`); 0 with cache `none`."""
        return 0 if self.cache == "none" else self.prompt_len + self.gen_length + self.extra_columns


class Knobs(NamedTuple):
    """Traced sampling settings: changing any of them reuses the compiled program."""

    steps: Array  # int32, total refinement steps (split evenly over blocks)
    temperature: Array  # float32, 0 = greedy
    top_p: Array  # float32, 1 = off
    top_k: Array  # int32, 0 = off
    threshold: Array  # float32, 0 = off
    entropy_bound: Array  # float32, 0 = off
    cfg_scale: Array  # float32 (used only by a guidance program)
    remasking: Array  # int32 scoring.remasking_index of the strategy
    eos_stop: Array  # bool
    seed: Array  # uint32
    sampled_confidence: Array  # bool: confidence from the tempered, filtered distribution (`scoring.sample`)


def make_knobs(*, steps: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               threshold: float = 0.0, entropy_bound: float = 0.0, cfg_scale: float = 0.0,
               remasking: int = 0, eos_stop: bool = True, seed: int = 0,
               sampled_confidence: bool = False) -> Knobs:
    """Host arrays with fixed dtypes, so every call hits the same compiled signature."""
    return Knobs(np.int32(steps), np.float32(temperature), np.float32(top_p), np.int32(top_k),
                 np.float32(threshold), np.float32(entropy_bound), np.float32(cfg_scale),
                 np.int32(remasking), np.bool_(eos_stop), np.uint32(seed % 2**32), np.bool_(sampled_confidence))


class ProgramOut(NamedTuple):
    """What one run of the program returns (device arrays)."""

    tokens: Array  # [B, G] the generated columns (EOS-filled after a stop)
    nfe: Array  # forward passes (a guided pass over 2B rows counts once; prefill counts)
    steps: Array  # commit steps run
    committed: Array  # [B] tokens committed by the sampler per row (EOS fill not counted)
    logits: Array | None  # [B, G, V] logits each position was committed from (record_logits)


# The progress callback is looked up at run time, so one compiled program serves any callback.
_progress_sink: list[Callable[[np.ndarray, int, int], None] | None] = [None]


def set_progress_sink(fn: Callable[[np.ndarray, int, int], None] | None) -> None:
    """Route the compiled loop's progress callbacks (tokens [B, G], block, nfe) to `fn` (None: drop them)."""
    _progress_sink[0] = fn


def _emit(tokens: np.ndarray, block: np.ndarray, nfe: np.ndarray) -> None:
    fn = _progress_sink[0]
    if fn is not None:
        fn(np.asarray(tokens), int(block), int(nfe))


def window_widths(gen_length: int, block_length: int) -> tuple[int, ...]:
    """The static widths of the bidirectional prefix cache's [block j .. end] windows: L, 2L, 4L, ...
    below G, then G. A window runs in the narrowest one that holds it, so later blocks cost less (one
    compiled branch per width, chosen at run time)."""
    out, w = [], block_length
    while w < gen_length:
        out.append(w)
        w *= 2
    return (*out, gen_length)


def _dslice(x: Array, start: Array | int, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


class _State(NamedTuple):
    canvas: Array
    cache: Any
    logits: Any
    key: Array
    block: Array
    step: Array
    nfe: Array
    steps: Array
    committed: Array
    n_sched: Array


def run_program(spec: ProgramSpec, forward_fn: ForwardFn, weights: Any, prompt: Array, prompt_len: Array,
                start: Array, knobs: Knobs) -> ProgramOut:
    """The whole denoising loop. prompt [B, P] left-padded int32, prompt_len [B] its valid columns (0 = a
    filler row), start [B, G] the generated columns' first tokens: the mask token, after the prompt's
    tail on an absolute block grid (a filler row: any other token, so that it is done from the start)."""
    cfg = spec.model
    b, p, g, bl = spec.batch, spec.prompt_len, spec.gen_length, spec.block_length
    t = p + g
    n_blocks = spec.n_blocks
    mode = spec.cache
    bidir = not cfg.is_block_causal
    extra = spec.extra_columns  # fixed-width [block j .. end] windows
    s = t + extra
    mask_id, eos_id = cfg.mask_token_id, cfg.eos_token_id
    # prompt blocks: the model's blocks, or on the absolute grid the sampler's (LLaDA2 lays both from position 0)
    prompt_block = bl if spec.block_grid == "absolute" else cfg.block_size

    # ordered effects need one device; the loop's steps run in order anyway
    single_device = spec.mesh is None or spec.mesh.n_devices == 1
    col = jnp.arange(s)
    prompt_len = prompt_len.astype(jnp.int32)
    valid = (col[None] >= p - prompt_len[:, None]) & (col[None] < t)
    positions = masks.positions(valid)
    block_ids = masks.canvas_block_ids(positions, p, bl, prompt_block)
    canvas = jnp.concatenate(
        [prompt.astype(jnp.int32), start.astype(jnp.int32), jnp.full((b, extra), cfg.filler_id, jnp.int32)], axis=1)
    is_prompt = valid & ((col[None] < p) | (canvas != mask_id))  # the tail on an absolute grid is prompt too

    rows = (lambda x: jnp.concatenate([x, x], axis=0)) if spec.guidance else (lambda x: x)
    valid_r, pos_r, ids_r = rows(valid), rows(positions), rows(block_ids)

    def model_rows(cv: Array) -> Array:
        if not spec.guidance:
            return cv
        return jnp.concatenate([cv, jnp.where(is_prompt, mask_id, cv)], axis=0)  # unconditional: prompt masked

    def call(cv: Array, cache: Any, lo: Array | int, width: int, logits_start: Array | int,
             commit: Array | int | None = None) -> tuple[Array, Any]:
        toks = _dslice(model_rows(cv), lo, width)
        qv, qi = _dslice(valid_r, lo, width), _dslice(ids_r, lo, width)
        kv, ki = (valid_r, ids_r) if cache is not None else (qv, qi)
        mask = masks.attention_mask(qv, qi, kv, ki, cfg.is_block_causal)
        # Gated DeltaNet layers also need the window's valid columns, its block ids and how many of its
        # columns are final (their state is written back only that far).
        linear = dict(valid=qv, blocks=qi, commit=commit) if cfg.is_hybrid else {}
        logits, cache = forward_fn(weights, toks, _dslice(pos_r, lo, width), mask, cache,
                                   jnp.asarray(lo, jnp.int32), logits_start, bl, **linear)
        logits = logits.astype(jnp.float32)
        if spec.guidance:
            logits = guide(logits[:b], logits[b:], knobs.cfg_scale)
        return logits, cache

    spb = jnp.maximum(knobs.steps // n_blocks, 1)

    def eos_fill(cv: Array) -> Array:
        gen = fill_after_end(cv[:, p:t], eos_id, mask_id, knobs.eos_stop)
        return jax.lax.dynamic_update_slice_in_dim(cv, gen, p, axis=1)

    def commit(st: _State, logits: Array) -> _State:
        lo = p + st.block * bl
        key, k_draw, k_score = jax.random.split(st.key, 3)
        blk = _dslice(st.canvas, lo, bl)
        masked = blk == mask_id
        drawn, scores = sample_and_score(logits, k_draw, k_score, knobs.temperature, knobs.top_k, knobs.top_p,
                                         mask_id, knobs.sampled_confidence, knobs.remasking,
                                         knobs.entropy_bound > 0)
        n = transfer_count(st.n_sched, spb, st.step)
        chosen = select_commits(scores, masked, n, knobs.threshold, knobs.entropy_bound)
        cv = jax.lax.dynamic_update_slice_in_dim(st.canvas, jnp.where(chosen, drawn, blk), lo, axis=1)
        cv = eos_fill(cv)
        rec = st.logits
        if spec.record_logits:
            old = jax.lax.dynamic_slice_in_dim(rec, lo - p, bl, axis=1)
            rec = jax.lax.dynamic_update_slice_in_dim(rec, jnp.where(chosen[..., None], logits, old), lo - p, axis=1)
        if spec.progress:
            jax.debug.callback(_emit, cv[:, p:t], st.block, st.nfe + 1, ordered=single_device)
        return st._replace(canvas=cv, logits=rec, key=key, step=st.step + 1, nfe=st.nfe + 1,
                           steps=st.steps + 1, committed=st.committed + jnp.sum(chosen, axis=1, dtype=jnp.int32))

    def block_masked(cv: Array, blk_idx: Array) -> Array:
        return _dslice(cv, p + blk_idx * bl, bl) == mask_id

    def first_forward(cv: Array, cache: Any, lo: Array) -> tuple[Array, Any]:
        if bidir:  # refresh the whole cache from the current canvas, score block j from the same pass
            return call(cv, cache, 0, t, lo)
        if cfg.is_hybrid:
            # The Gated DeltaNet state must advance over block j-1 exactly once: block j > 0 runs
            # [block j-1, block j] from the state before block j-1 and keeps the state after block j-1
            # (commit = L). Block 0 has nothing to commit (the prefill did the prompt): `step` gives
            # its first pass to `later_forward`.
            return call(cv, cache, lo - bl, 2 * bl, bl, commit=bl)
        # block-causal: re-encode block j-1 (now final) into the cache and score block j in one pass
        return call(cv, cache, lo - bl, 2 * bl, bl)

    widths = window_widths(g, bl)

    def later_forward(cv: Array, cache: Any, lo: Array) -> tuple[Array, Any]:
        if bidir and mode == "prefix":
            # [block j .. end] in the narrowest static width that holds it (the rest is padding)
            which = jnp.searchsorted(jnp.asarray(widths), t - lo)
            branches = [lambda c, k, x, w=w: call(c, k, x, w, 0) for w in widths]
            return jax.lax.switch(which, branches, cv, cache, lo)
        return call(cv, cache, lo, bl, 0, commit=0)  # block j is not final: the Gated DeltaNet state stays

    def step(st: _State) -> _State:
        lo = p + st.block * bl
        if mode == "none":
            logits, _ = call(st.canvas, None, 0, t, lo)
            return commit(st, logits)
        first = (st.step == 0) & (lo > p) if cfg.is_hybrid else st.step == 0
        logits, cache = jax.lax.cond(first, first_forward, later_forward, st.canvas, st.cache, lo)
        return commit(st._replace(cache=cache), logits)

    def inner_cond(st: _State) -> Array:
        return (st.step < spb) & jnp.any(block_masked(st.canvas, st.block))

    def block_body(st: _State) -> _State:
        # Every unfinished row has masks in block j when it starts, so step 0 (which, with a cache,
        # also writes block j-1's final K/V) always runs.
        # the schedule splits the block's masks over its steps (LLaDA); on the absolute grid it splits L (LLaDA2)
        n_masked = jnp.sum(block_masked(st.canvas, st.block), axis=1)
        n_sched = jnp.full_like(n_masked, bl) if spec.block_grid == "absolute" else n_masked
        st = st._replace(step=jnp.int32(0), n_sched=n_sched)
        st = jax.lax.while_loop(inner_cond, step, st)
        return st._replace(block=st.block + 1)

    def outer_cond(st: _State) -> Array:
        return (st.block < n_blocks) & jnp.any(st.canvas[:, p:t] == mask_id)

    n_rows = spec.model_rows
    cache = None
    nfe = jnp.int32(0)
    if mode != "none":
        init = forward_fn.init_cache if hasattr(forward_fn, "init_cache") else None
        if init is None:
            raise TypeError("cache modes need a forward function with an init_cache(rows, length) method")
        cache = init(n_rows, s)
        if not bidir:  # block-causal: the prompt's K/V never change, encode them once
            _, cache = call(canvas, cache, 0, p, 0)
            nfe = jnp.int32(1)
    rec = jnp.zeros((b, g, cfg.vocab_size), jnp.float32) if spec.record_logits else None
    st = _State(canvas, cache, rec, jax.random.key(knobs.seed), jnp.int32(0), jnp.int32(0), nfe, jnp.int32(0),
                jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))
    st = jax.lax.while_loop(outer_cond, block_body, st)
    return ProgramOut(st.canvas[:, p:t], st.nfe, st.steps, st.committed, st.logits)
