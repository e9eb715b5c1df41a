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
          (`step.pow2_widths`; the cache has G extra padding columns for the overhang). Approximate.
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
from clover_jax.model import cache as kv_cache
from clover_jax.model import masks
from clover_jax.model.forward_fn import ForwardFn
from clover_jax.sampler import step as denoise
from clover_jax.sampler.scoring import guide
from clover_jax.sampler.settings import Knobs
from clover_jax.sampler.speculative import run_speculative

Array = jax.Array


@dataclass(frozen=True)
class ProgramSpec:
    """Everything that changes the compiled program (its shapes or its code)."""

    model: ModelConfig
    batch: int  # batch bucket B
    prompt_len: int  # prompt bucket P
    gen_columns: int  # G: the generated columns (gen_length, one block more on an absolute grid with a prompt tail)
    block_length: int  # L
    cache: str = "none"
    guidance: bool = False  # classifier-free guidance doubles the rows; its scale stays dynamic
    progress: bool = False  # compile in the progress callback
    record_logits: bool = False  # keep the logits each token was committed from (tests, debugging)
    mesh: MeshRules | None = None  # where the program runs (None: one device)
    block_grid: str = "prompt"  # absolute: every block holds L canvas columns from position 0 (see `generate`)
    self_speculative: bool = False  # the block diffusion drafts, the causal model accepts (`speculative`)
    causal: bool = False  # one token a pass, the causal model's (`speculative`)

    @property
    def n_blocks(self) -> int:
        """Generated blocks: gen_columns / block_length."""
        return self.gen_columns // self.block_length

    @property
    def extra_columns(self) -> int:
        """Padding columns after the canvas: G for a bidirectional model's prefix cache (its fixed-width
        [block j .. end] windows overhang the canvas), else 0."""
        return self.gen_columns if (self.cache == "prefix" and not self.model.is_block_causal) else 0

    @property
    def model_rows(self) -> int:
        """Rows each forward pass runs (and the cache holds): 2B with guidance, else B."""
        return 2 * self.batch if self.guidance else self.batch

    @property
    def cache_columns(self) -> int:
        """Columns of the cache the program allocates (P + G + `extra_columns`); 0 with cache `none`."""
        return 0 if self.cache == "none" else self.prompt_len + self.gen_columns + self.extra_columns


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
    if spec.self_speculative or spec.causal:
        return ProgramOut(*run_speculative(spec, forward_fn, weights, prompt, prompt_len, start, knobs)[:4], None)
    cfg = spec.model
    b, p, g, bl = spec.batch, spec.prompt_len, spec.gen_columns, spec.block_length
    t = p + g
    n_blocks = spec.n_blocks
    mode = spec.cache
    bidir = not cfg.is_block_causal
    extra = spec.extra_columns  # fixed-width [block j .. end] windows
    s = t + extra
    mask_id = cfg.mask_token_id
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

    def ids_at(lo: Array | int) -> Array:
        """The block ids while the block at column `lo` is denoised: the canvas's, or for a causal-prefix model
        every column before it clean (causal) and the generated blocks from it on one block each."""
        return rows(masks.prefix_canvas_ids(positions, lo, p, bl)) if cfg.causal_prefix else ids_r

    def model_rows(cv: Array) -> Array:
        if not spec.guidance:
            return cv
        return jnp.concatenate([cv, jnp.where(is_prompt, mask_id, cv)], axis=0)  # unconditional: prompt masked

    def call(cv: Array, cache: Any, lo: Array | int, width: int, logits_start: Array | int,
             commit: Array | int | None = None, noisy_from: Array | int | None = None, logits_len: int = bl,
             prefill: bool = False) -> tuple[Array, Any]:
        """The model on canvas columns [lo, lo + width), logits of `logits_len` of them; `noisy_from`: the column
        of the block being denoised (the block ids follow it for a causal-prefix model; None: the window is all
        clean, a prefill); `prefill`: the window is the prompt's (causal in columns for a causal-prefix model)."""
        ids = ids_r if noisy_from is None else ids_at(noisy_from)
        logits, cache = denoise.window_pass(forward_fn, weights, cfg, model_rows(cv), valid_r, ids, pos_r, cache,
                                            lo, width, logits_start, logits_len, commit, prefill=prefill)
        if spec.guidance:
            logits = guide(logits[:b], logits[b:], knobs.cfg_scale)
        return logits, cache

    def commit(st: _State, logits: Array) -> _State:
        key, k_draw, k_score = jax.random.split(st.key, 3)
        gen = st.canvas[:, p:t]
        gen, chosen = denoise.commit(logits, gen, st.block * bl, knobs, k_draw, k_score, st.n_sched, st.step, cfg,
                                     response=(gen, ~is_prompt[:, p:t]))
        cv = jax.lax.dynamic_update_slice_in_dim(st.canvas, gen, p, axis=1)
        rec = st.logits
        if spec.record_logits:
            old = jax.lax.dynamic_slice_in_dim(rec, st.block * bl, bl, axis=1)
            rec = jax.lax.dynamic_update_slice_in_dim(rec, jnp.where(chosen[..., None], logits, old), st.block * bl,
                                                      axis=1)
        if spec.progress:
            jax.debug.callback(_emit, cv[:, p:t], st.block, st.nfe + 1, ordered=single_device)
        return st._replace(canvas=cv, logits=rec, key=key, step=st.step + 1, nfe=st.nfe + 1,
                           steps=st.steps + 1, committed=st.committed + jnp.sum(chosen, axis=1, dtype=jnp.int32))

    def block_masked(cv: Array, blk_idx: Array) -> Array:
        return _dslice(cv, p + blk_idx * bl, bl) == mask_id

    widths = denoise.pow2_widths(g, bl)

    def refresh(cv: Array, cache: Any, lo: Array) -> tuple[Array, Any]:
        # bidirectional, a block's first step: refresh the whole cache from the current canvas, score block j
        return call(cv, cache, 0, t, lo)

    def suffix(cv: Array, cache: Any, lo: Array) -> tuple[Array, Any]:
        # bidirectional prefix: [block j .. end] in the narrowest static width that holds it (the rest is padding)
        which = jnp.searchsorted(jnp.asarray(widths), t - lo)
        branches = [lambda c, k, x, w=w: call(c, k, x, w, 0) for w in widths]
        return jax.lax.switch(which, branches, cv, cache, lo)

    def step(st: _State) -> _State:
        lo = p + st.block * bl
        if mode == "none":  # a causal-prefix model: the columns before the block are clean, the rest noisy
            logits, _ = call(st.canvas, None, 0, t, lo, lo if cfg.causal_prefix else None, lo)
            return commit(st, logits)
        if bidir:
            later = suffix if mode == "prefix" else (lambda cv, c, lo: call(cv, c, lo, bl, 0))
            logits, cache = jax.lax.cond(st.step == 0, refresh, later, st.canvas, st.cache, lo)
        else:
            # block-causal: [block j-1, block j] at the block's first step (block j-1 final), then block j alone
            first = lambda cv, c: call(cv, c, lo - bl, 2 * bl, bl, commit=bl, noisy_from=lo)
            refine = lambda cv, c: call(cv, c, lo, bl, 0, commit=0, noisy_from=lo)
            logits, cache, _ = denoise.cached_pass(cfg, bl, first, refine, st.canvas, st.cache, st.step == 0,
                                                   st.block == 0)
        return commit(st._replace(cache=cache), logits)

    def inner_cond(st: _State) -> Array:
        return (st.step < knobs.steps_per_block) & jnp.any(block_masked(st.canvas, st.block))

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
        init = getattr(forward_fn, "init_cache", None)
        if init is None:
            raise TypeError("cache modes need a forward function with an init_cache(rows, length) method")
        cache = init(n_rows, s)
        if spec.mesh is not None and isinstance(cache, kv_cache.KVCache):  # placed as the server and the plan do
            cache = jax.lax.with_sharding_constraint(cache, kv_cache.shardings(cache, spec.mesh))
        if not bidir:  # block-causal: the prompt's K/V never change, encode them once (in windows: `prefill`)
            window = lambda c, lo, w: call(canvas, c, lo, w, 0, noisy_from=p, logits_len=1, prefill=True)[1]
            cache = denoise.prefill(window, cache, 0, p, denoise.prefill_columns(cfg, spec.model_rows),
                                    denoise.prefill_overlap(cfg, prompt_block))
            nfe = jnp.int32(1)
    rec = jnp.zeros((b, g, cfg.vocab_size), jnp.float32) if spec.record_logits else None
    st = _State(canvas, cache, rec, jax.random.key(knobs.seed), jnp.int32(0), jnp.int32(0), nfe, jnp.int32(0),
                jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))
    st = jax.lax.while_loop(outer_cond, block_body, st)
    return ProgramOut(st.canvas[:, p:t], st.nfe, st.steps, st.committed, st.logits)
