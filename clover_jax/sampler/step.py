"""One denoising step, shared by the sampler's whole-batch loop (`program`) and the serving engine's rows
(`serving.program`): a change to how a block is run, scored or committed is made here, once.

    window_pass   the model on one window of the canvas: the window's tokens, its attention mask (from each
                  column's validity and block id), the Gated DeltaNet extras, float32 logits
    prefill       a prompt's columns written into the cache in windows of `ModelConfig.prefill_chunk` tokens over
                  all rows (`prefill_columns`; activation memory bounded whatever the prompt's length), exact
    cached_pass   which window a block-causal pass with a cache runs: the block's first step runs
                  [block j-1, block j] (block j-1 is final now: its K/V are written and the Gated DeltaNet state
                  advances over it), later steps run block j alone against the cache (nothing written back)
    commit        draw a token at every position of the block, score them, choose which masked positions to
                  commit (the schedule, the threshold, the entropy bound), write them, end rows at their end token

The two callers differ only in layout: the sampler's rows share one block index and one set of knobs (scalars,
one random key per step), the engine's rows each carry their own block, knobs ([B]) and keys, so a request's
tokens never depend on its batch-mates. Each function takes either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.model import cache as kv_cache
from clover_jax.model import masks
from clover_jax.model.forward_fn import ForwardFn
from clover_jax.sampler.scoring import (
    Scores,
    fill_after_end,
    penalize,
    sample_and_score,
    select_commits,
    transfer_count,
)
from clover_jax.sampler.settings import Knobs

Array = jax.Array
PassFn = Callable[[Array, Any], tuple[Array, Any]]  # (canvas, cache) -> (logits [B, L, V], cache)


def pow2_widths(columns: int, unit: int) -> tuple[int, ...]:
    """Static widths unit, 2 unit, 4 unit, ... below `columns`, then `columns`: a variable-width window runs in the
    narrowest that holds it (one compiled branch or program per width)."""
    out, w = [], unit
    while w < columns:
        out.append(w)
        w *= 2
    return (*out, columns)


def window_pass(forward_fn: ForwardFn, weights: Any, cfg: ModelConfig, tokens: Array, valid: Array, blocks: Array,
                positions: Array, cache: Any, lo: Array | int, width: int, logits_start: Array | int,
                logits_len: int, commit: Array | int | None = None, prefill: bool = False) -> tuple[Array, Any]:
    """The model on canvas columns [lo, lo + width) of every row: tokens / valid / blocks / positions are the
    whole canvas [R, S]. Without a cache the window attends to itself; with one it is written at column `lo` and
    attends to all S columns (a hybrid's refinement pass, `commit` the Python int 0, writes nothing: see
    `transformer.forward`). Returns (float32 logits [R, logits_len, V] of window columns
    [logits_start, logits_start + logits_len), the cache). `commit`: how many of the window's columns are final,
    for the Gated DeltaNet state (`transformer.forward`). `prefill`: the caller's promise that the window and every
    valid column before it are clean text and its block ids their positions (a prompt's prefill); for a causal-prefix
    model the mask is then causal in columns, so attention may run through a causal kernel
    (`masks.BlockMask.causal`)."""
    def cut(x: Array) -> Array:
        return jax.lax.dynamic_slice_in_dim(x, lo, width, axis=1)

    qv, qi = cut(valid), cut(blocks)
    kv, ki = (valid, blocks) if cache is not None else (qv, qi)
    mask = masks.BlockMask(qv, qi, kv, ki, cfg.is_block_causal, prefill and cfg.causal_prefix)  # built where read
    linear = dict(valid=qv, blocks=qi, commit=commit) if cfg.is_hybrid else {}
    logits, cache = forward_fn(weights, cut(tokens), cut(positions), mask, cache, jnp.asarray(lo, jnp.int32),
                               logits_start, logits_len, **linear)
    return logits.astype(jnp.float32), cache


def prefill_overlap(cfg: ModelConfig, prompt_block: int) -> int | None:
    """How many columns consecutive prefill windows share so that a windowed prefill writes exactly the cache of
    one pass over the whole prompt, or None when no cut is exact (the prompt then runs in one pass).

    A block-causal model's prompt is in blocks of `prompt_block` positions (the sampler's prompt blocks), or of one
    (causal) when it is a causal-prefix model's clean text. 0: blocks of one, so any cut is exact: each window
    reads what the earlier ones left in the cache (K/V, the Gated DeltaNet state and conv tail). `prompt_block`:
    an attention-only model with longer blocks, on each row's own positions: rows padded differently end their
    blocks at different columns, so a window may cut a row's last block; the next window starts one block earlier
    and writes that block again, whole (a window writes its K/V before it reads the cache, so the block sees all
    of itself; the columns it writes again that were already final get the same values). None: a hybrid with
    longer blocks (a Gated DeltaNet state must pass over each column once, and the block-diffusion form of the
    earlier reconstruction reads a clean block whole)."""
    block = 1 if cfg.causal_prefix else prompt_block
    if block == 1:
        return 0
    return None if cfg.is_hybrid else block


MIN_PREFILL_COLUMNS = 64  # a prefill window is never narrower, however many rows share it


def prefill_columns(cfg: ModelConfig, rows: int) -> int:
    """The columns of a prefill window over `rows` rows: `cfg.prefill_chunk` tokens shared by the rows (so a
    window's activations are the same whatever the batch), at least `MIN_PREFILL_COLUMNS` (or the whole budget
    when it is smaller); 0 (one pass) when `cfg.prefill_chunk` is 0."""
    budget = cfg.prefill_chunk
    return max(budget // max(rows, 1), min(budget, MIN_PREFILL_COLUMNS)) if budget > 0 else 0


def prefill(run: Callable[[Any, Array | int, int], Any], cache: Any, lo: Array | int, width: int, chunk: int,
            overlap: int | None) -> Any:
    """Write canvas columns [lo, lo + width) (a prompt, all clean) into `cache` with `run(cache, start, w)` (the
    caller's pass over columns [start, start + w), returning the cache), in windows of at most `chunk` columns:
    the first holds what the others leave over, the rest are `chunk` wide and each starts `overlap` columns before
    the previous one's end (`prefill_overlap`; at least two blocks' worth of columns are taken, so windows always
    advance). `chunk` 0, a prompt no wider than it, or `overlap` None: one pass. The windows are one compiled
    pass per width (`lax.fori_loop`), so memory is the widest window's."""
    if overlap is None or chunk <= 0 or width <= max(chunk, 2 * overlap):
        return run(cache, lo, width)
    chunk = max(chunk, 2 * overlap)
    stride = chunk - overlap
    rest = -(-(width - chunk) // stride)  # windows after the first
    first = width - rest * stride  # in (overlap, chunk]
    cache = run(cache, lo, first)
    return jax.lax.fori_loop(0, rest, lambda i, c: run(c, lo + first - overlap + i * stride, chunk), cache)


def cached_pass(cfg: ModelConfig, block_length: int, first: PassFn, refine: PassFn, canvas: Array, cache: Any,
                at_start: Array, fresh: Array, active: Array | None = None) -> tuple[Array, Any, Array]:
    """The block-causal cached pass of one step: (logits [B, L, V], cache, model calls run).

    `first` runs [block j-1, block j], `refine` block j alone (both return the logits of block j's `block_length`
    columns) (see the module docstring); `at_start`: the step is
    its block's first; `fresh`: the block is the row's first, which has nothing to commit (the prefill ran the
    prompt): scalar when every row is at the same block (the sampler), else [B] (`active` [B]: the rows that run).
    Attention-only models run `first` at every block start (a first block re-encodes the prompt's last L
    columns, which changes nothing). Hybrid models must advance the Gated DeltaNet state over a block exactly
    once, so a fresh block runs `refine`; a batch that holds fresh and older rows runs both and picks per row."""
    if not cfg.is_hybrid:
        logits, cache = jax.lax.cond(at_start, first, refine, canvas, cache)
        return logits, cache, jnp.int32(1)
    if jnp.ndim(fresh) == 0:
        logits, cache = jax.lax.cond(at_start & ~fresh, first, refine, canvas, cache)
        return logits, cache, jnp.int32(1)
    act = jnp.ones_like(fresh) if active is None else active

    def skip(cv: Array, c: Any) -> tuple[Array, Any]:
        return jnp.zeros((cv.shape[0], block_length, cfg.vocab_size), jnp.float32), c

    run_first = at_start & jnp.any(act & ~fresh)
    run_refine = ~at_start | jnp.any(act & fresh)
    la, ka = jax.lax.cond(run_first, first, skip, canvas, cache)
    lb, kb = jax.lax.cond(run_refine, refine, skip, canvas, cache)
    take_first = at_start & ~fresh
    logits = jnp.where(take_first[:, None, None], la, lb)
    return logits, kv_cache.select_rows(take_first, ka, kb), run_first.astype(jnp.int32) + run_refine.astype(jnp.int32)


def _draw_row(logits: Array, k_draw: Array, k_score: Array, k: Knobs, mask_id: int) -> tuple[Array, Scores]:
    tokens, scores = sample_and_score(logits[None], k_draw, k_score, k.temperature, k.top_k, k.top_p, mask_id,
                                      k.sampled_confidence, k.remasking, k.entropy_bound > 0)
    return tokens[0], Scores(*(x[0] for x in scores))


def draw_rows(logits: Array, k_draw: Array, k_score: Array, knobs: Knobs, mask_id: int) -> tuple[Array, Scores]:
    """`scoring.sample_and_score` for every row under its own knobs ([B] leaves) and keys ([B]). Under vmap a
    per-row predicate turns every lax.cond inside into both branches, so the batch picks the cheapest program that
    serves all its rows: greedy when no row is above temperature 0, unfiltered draws when no row filters by
    top-k / top-p (else the two bisections of `filter_logits` would run at every pass), and the per-row filters
    only when some row asks for them."""
    def run(k: Knobs, shared: dict[str, Array]) -> tuple[Array, Scores]:
        # `shared` knobs are one value for every row (unbatched), so the conds on them stay conds
        axes = Knobs(*(None if f in shared else 0 for f in Knobs._fields))
        return jax.vmap(_draw_row, (0, 0, 0, axes, None))(logits, k_draw, k_score, k._replace(**shared), mask_id)

    branches = [lambda k: run(k, {"temperature": jnp.float32(0)}),
                lambda k: run(k, {"top_k": jnp.int32(0), "top_p": jnp.float32(1)}),
                lambda k: run(k, {})]
    hot, filtered = jnp.any(knobs.temperature > 0), jnp.any((knobs.top_k > 0) | (knobs.top_p < 1))
    return jax.lax.switch(jnp.where(hot, jnp.where(filtered, 2, 1), 0), branches, knobs)


def commit(logits: Array, region: Array, offset: Array | int, knobs: Knobs, k_draw: Array, k_score: Array,
           n_sched: Array, step: Array, cfg: ModelConfig, live: Array | None = None,
           response: tuple[Array, Array] | None = None) -> tuple[Array, Array]:
    """Commit one step in the block of L = logits.shape[1] columns at `offset` of `region` [B, R] (the generated
    columns; the block and everything after it): draw a token at every position of the block (the mask token is
    never drawn), score them by the remasking strategy, commit the masked positions `scoring.select_commits`
    chooses (this step's share of the block's `n_sched` [B] masks under the linear schedule over
    `knobs.steps_per_block`, plus the threshold's and the entropy bound's), and where a row's end token has nothing
    masked before it, end the row there (`fill_after_end`). `knobs` are scalars (every row alike, keys scalar) or
    [B] (per row, keys [B]); `live` [B]: rows that may commit this step (None: all). `response`: (tokens [B, H],
    which of them are the response's) whose committed tokens the presence / frequency / repetition penalties count
    (`scoring.penalize`; masks never count). Returns (region, chosen [B, L])."""
    bl, mask_id = logits.shape[1], cfg.mask_token_id
    if response is not None:
        seen, counted = response
        logits = penalize(logits, seen, counted & (seen != mask_id), knobs.presence_penalty, knobs.frequency_penalty,
                          knobs.repetition_penalty)
    blk = jax.lax.dynamic_slice_in_dim(region, offset, bl, axis=1)
    masked = blk == mask_id
    per_row = jnp.ndim(knobs.temperature) > 0
    if per_row:
        drawn, scores = draw_rows(logits, k_draw, k_score, knobs, mask_id)
        threshold, bound = knobs.threshold[:, None], knobs.entropy_bound[:, None]
    else:
        drawn, scores = sample_and_score(logits, k_draw, k_score, knobs.temperature, knobs.top_k, knobs.top_p,
                                         mask_id, knobs.sampled_confidence, knobs.remasking, knobs.entropy_bound > 0)
        threshold, bound = knobs.threshold, knobs.entropy_bound
    n = transfer_count(n_sched, knobs.steps_per_block, step)
    chosen = select_commits(scores, masked, n, threshold, bound)
    if live is not None:
        chosen &= live[:, None]
    region = jax.lax.dynamic_update_slice_in_dim(region, jnp.where(chosen, drawn, blk), offset, axis=1)
    return fill_after_end(region, cfg.eos_token_id, mask_id, knobs.eos_stop), chosen
