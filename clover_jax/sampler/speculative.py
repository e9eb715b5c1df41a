"""Self-speculative decoding: the block diffusion drafts, the causal model checks, and what comes out is exactly the
causal model's greedy text.

A causal-prefix model (`cfg.causal_prefix`) is two models on one set of weights: the causal Qwen3.5 model over
clean text, and the block diffusion that previews a block over it. This program lets the second draft for the
first: per round

  1. commit: one pass over [the tokens known right (not yet in the cache) | a block of masks]: the known tokens
     run causally into the cache (K/V and Gated DeltaNet state), the block is previewed, and the causal logits of
     the last known token give the causal model's next token (`pred_0`);
  2. draft: refinement passes over the block against the cache, as the sampler's (`step.commit`: remasking,
     threshold, steps per block), until the block is filled;
  3. verify: one causal pass over the drafted block (its state is not kept): the causal model's next token after
     each drafted one (`pred_1 .. pred_L`);
  4. accept the longest prefix of the draft that agrees with `pred_0 ..`, and the causal model's own token after
     it (`pred_a`): at least one token a round, at most L + 1; they are the known tokens of the next round's
     commit pass.

With `spec.causal` there is no draft: each round is one causal pass over the last known token, which commits it
into the cache and gives the causal model's next token, the one token the round accepts. That is decoding as an
autoregressive model does (one token a pass over its cache), on the same weights and program; it writes what
self-speculative decoding writes, and measures what the draft saves.

Every accepted token is the causal model's greedy choice given the tokens before it, so the text is the causal
model's greedy decoding, whatever the draft; a good draft only makes it cheaper (up to L + 1 tokens for the
draft's passes plus two). Greedy only (temperature 0), one sequence a program (the rows of a batch would accept
different lengths), the prefix cache. Layout: [prompt (P, left-padded) | generated (G) | 2L + 1 spare columns for
a round's window overhang], every column of a row from its prompt on valid. The loop stops at an accepted end
token or once the generated columns that `start` leaves masked (its leading run of mask tokens: all G in the
sampler, a request's max_tokens in the serving engine) are filled.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.model import cache as kv_cache
from clover_jax.model import masks
from clover_jax.model.forward_fn import ForwardFn
from clover_jax.sampler import step as denoise
from clover_jax.sampler.settings import Knobs

Array = jax.Array


class Reuse(NamedTuple):
    """A saved prompt's cache for `run_speculative` (the serving engine's prefix cache, `serving.speculative`), in
    the engine's row layout: a one-row cache of S' columns (`saved.length`) whose prompt ends right before its last
    `block_length` columns. The row's prompt begins with the saved one's `saved_len` tokens (0: nothing saved,
    `saved` then zeros); `stem` (saved_len <= stem < the prompt's length) is where the returned cache is taken:
    short of the prompt but its last token only by a chat's assistant opening (the tokens after it are prefilled in
    windows of a block)."""

    saved: Any
    saved_len: Array  # [] int32
    stem: Array  # [] int32


class _Round(NamedTuple):
    canvas: Array  # [1, S]
    cache: Any
    done: Array  # committed columns: [0, done) are in the cache
    known: Array  # tokens at [done, done + known) are right and not yet in the cache (>= 1)
    nfe: Array
    steps: Array
    stopped: Array  # an end token was accepted
    key: Array


def run_speculative(spec: Any, forward_fn: ForwardFn, weights: Any, prompt: Array, prompt_len: Array, start: Array,
                    knobs: Knobs, reuse: Reuse | None = None) -> tuple[Array, Array, Array, Array, Any]:
    """The self-speculative (or causal) loop for one row (see the module docstring): (generated columns [1, G],
    forward passes, commit steps, tokens generated [1], the stem's cache). Arguments as `program.run_program`'s.
    `reuse`: the prompt's first `reuse.saved_len` tokens' cache is taken from `reuse.saved` (rolled to their
    columns; only the rest is prefilled, in windows of `step.prefill_columns`), and the cache after its first
    `reuse.stem` tokens is returned in the same layout (for the prefix cache to save); None: the whole prompt is
    prefilled and the last value is None. Exact: the causal path's state after a prompt depends only on its tokens
    (up to float32 rounding of how the windows cut the sums)."""
    cfg = spec.model
    p, g, bl = spec.prompt_len, spec.gen_columns, spec.block_length
    s = p + g + 2 * bl + 1  # a round's window starts before p + g and is 2L + 1 wide
    mask_id, eos_id = cfg.mask_token_id, cfg.eos_token_id
    col = jnp.arange(s)
    limit = jnp.sum(jnp.cumprod((start[0] == mask_id).astype(jnp.int32)))  # the columns to fill
    first = p - prompt_len.astype(jnp.int32)[0]  # the prompt's first column
    valid = (col >= first)[None]
    positions = masks.positions(valid)
    canvas = jnp.concatenate([prompt.astype(jnp.int32), start.astype(jnp.int32),
                              jnp.full((1, 2 * bl + 1), mask_id, jnp.int32)], axis=1)
    big = s  # the block being denoised: one block id after every clean column's position

    def ids(noisy_from: Array | int) -> Array:
        return jnp.where(col[None] < noisy_from, positions, big + (col[None] >= noisy_from + bl))

    def call(cv: Array, cache: Any, lo: Array | int, width: int, logits_start: Array | int, logits_len: int,
             commit: Array | int | None, noisy_from: Array | int, prefill: bool = False) -> tuple[Array, Any]:
        return denoise.window_pass(forward_fn, weights, cfg, cv, valid, ids(noisy_from), positions, cache, lo, width,
                                   logits_start, logits_len, commit, prefill=prefill)

    stem, prefilled = None, jnp.int32(1 if p > 1 else 0)
    if reuse is None:
        cache = forward_fn.init_cache(1, s)
        if p > 1:  # the prompt but its last token, causally: that token is the first round's known one
            window = lambda c, lo, w: call(canvas, c, lo, w, 0, 1, None, p - 1, True)[1]
            cache = denoise.prefill(window, cache, 0, p - 1, denoise.prefill_columns(cfg, 1), 0)
    else:
        cache, stem = _prefill_reusing(forward_fn, weights, cfg, canvas, positions, first, p, bl, reuse)
        prefilled = (first + reuse.saved_len < p - 1).astype(jnp.int32)  # a pass ran (counted as one, as above)

    def round_(r: _Round) -> _Round:
        lo, n = r.done, r.known
        draft = lo + n  # the block's first column
        cv = jax.lax.dynamic_update_slice_in_dim(r.canvas, jnp.full((1, bl), mask_id, jnp.int32), draft, axis=1)
        # 1. commit the known tokens and preview the block: logits of [last known | block]
        logits, cache = call(cv, r.cache, lo, 2 * bl + 1, n - 1, bl + 1, n, draft)
        pred0 = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        key, k0 = jax.random.split(r.key)
        sched = jnp.full((1,), bl, jnp.int32)

        def fill(c: Array, lg: Array, k: Array, i: Array) -> Array:  # one commit step inside the block
            blk, _ = denoise.commit(lg, jax.lax.dynamic_slice_in_dim(c, draft, bl, 1), 0, knobs, k, k, sched, i, cfg)
            return jax.lax.dynamic_update_slice_in_dim(c, blk, draft, axis=1)

        block = fill(cv, logits[:, 1:], k0, jnp.int32(0))

        # 2. draft: refinement passes over the block until it is filled (or its steps are spent)
        def refine_cond(st: tuple) -> Array:
            c, _, i, _ = st
            return (i < knobs.steps_per_block) & jnp.any(jax.lax.dynamic_slice_in_dim(c, draft, bl, 1) == mask_id)

        def refine(st: tuple) -> tuple:
            c, kv, i, k = st
            lg, kv = call(c, kv, draft, bl, 0, bl, 0, draft)
            k, kd = jax.random.split(k)
            return fill(c, lg, kd, i), kv, i + 1, k

        cv, cache, passes, key = jax.lax.while_loop(refine_cond, refine, (block, cache, jnp.int32(1), key))
        # 3. verify: the drafted block causally, its state not kept
        verify, _ = call(cv, cache, draft, bl, 0, bl, None, draft + bl)
        preds = jnp.concatenate([pred0[:, None], jnp.argmax(verify, axis=-1).astype(jnp.int32)], axis=1)  # [1, L+1]
        drafted = jax.lax.dynamic_slice_in_dim(cv, draft, bl, axis=1)
        agree = jnp.cumprod((drafted == preds[:, :bl]).astype(jnp.int32), axis=1)
        a = jnp.sum(agree[0])
        # 4. the accepted prefix and the causal model's token after it; nothing after an end token counts
        bonus = preds[0, a]
        cv = jax.lax.dynamic_update_slice_in_dim(cv, bonus[None, None], draft + a, axis=1)
        accepted = jax.lax.dynamic_slice_in_dim(cv, draft, bl + 1, axis=1)[0]
        taken = jnp.arange(bl + 1) <= a
        if eos_id is not None:
            at_eos = taken & (accepted == eos_id)
            stop = jnp.any(at_eos)
            a = jnp.where(stop, jnp.argmax(at_eos), a)
        else:
            stop = jnp.bool_(False)
        return _Round(cv, cache, draft, a + 1, r.nfe + passes + 1, r.steps + passes + 1, stop, key)

    def causal_round(r: _Round) -> _Round:  # the one known token into the cache; the causal model's next one
        logits, cache = call(r.canvas, r.cache, r.done, 1, 0, 1, 1, r.done + 1)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        cv = jax.lax.dynamic_update_slice_in_dim(r.canvas, token[:, None], r.done + 1, axis=1)
        stop = token[0] == eos_id if eos_id is not None else jnp.bool_(False)
        return _Round(cv, cache, r.done + 1, jnp.int32(1), r.nfe + 1, r.steps + 1, stop, r.key)

    def more(r: _Round) -> Array:
        return (r.done + r.known < p + limit) & ~r.stopped

    init = _Round(canvas, cache, jnp.int32(p - 1), jnp.int32(1), prefilled, jnp.int32(0),
                  jnp.bool_(False), jax.random.key(knobs.seed))
    r = jax.lax.while_loop(more, causal_round if spec.causal else round_, init)
    gen = r.canvas[:, p:p + g]
    made = jnp.minimum(r.done + r.known - p, limit)
    gen = jnp.where(jnp.arange(g)[None] < made, gen, eos_id if eos_id is not None else mask_id)
    if eos_id is not None:
        gen = denoise.fill_after_end(gen, eos_id, mask_id, jnp.bool_(True))
    return gen, r.nfe, r.steps, made[None], stem


def _prefill_reusing(forward_fn: ForwardFn, weights: Any, cfg: Any, canvas: Array, positions: Array, first: Array,
                     p: int, block_length: int, reuse: Reuse) -> tuple[Any, Any]:
    """`run_speculative`'s prefill from a saved prompt: (the cache of the prompt but its last token, its columns
    `canvas`'s [1, S]; the cache after its first `reuse.stem` tokens in `reuse.saved`'s layout). The saved tokens'
    K/V are rolled from the end of the saved row's prompt to the prompt's first column; the rest runs in windows of
    a fixed width (`step.prefill_columns` up to the stem, a block after it) over a canvas widened by a window, each
    span's columns past its end not valid (a Gated DeltaNet layer passes over them unchanged; their K/V are written
    again before any pass reads them)."""
    s = canvas.shape[1]
    chunk = min(denoise.prefill_columns(cfg, 1) or p, p)
    wide = s + max(chunk, block_length)
    cols = reuse.saved.length  # S': the saved row's columns; its prompt ends at S' - L
    end = cols - block_length
    big = max(cols, wide)
    kv = kv_cache.resize_columns(reuse.saved, big)  # the saved tokens [end - n, end) -> [first, first + n)
    kv = kv_cache.resize_columns(kv_cache.roll_columns(kv, end - reuse.saved_len - first), wide)
    col = jnp.arange(wide)[None]
    cv = jnp.concatenate([canvas, jnp.full((1, wide - s), cfg.filler_id, jnp.int32)], axis=1)
    pos = jnp.concatenate([positions, jnp.zeros((1, wide - s), positions.dtype)], axis=1)

    def span(cache: Any, lo: Array, hi: Array, width: int) -> Any:  # columns [lo, hi), `width` at a time
        valid = (col >= first) & (col < hi)

        def window(st: tuple[Any, Array]) -> tuple[Any, Array]:
            c, at = st
            return (denoise.window_pass(forward_fn, weights, cfg, cv, valid, pos, pos, c, at, width, 0, 1,
                                        prefill=True)[1], at + width)

        return jax.lax.while_loop(lambda st: st[1] < hi, window, (cache, lo))[0]

    at_stem = first + reuse.stem
    kv = span(kv, first + reuse.saved_len, at_stem, chunk)
    # the stem's cache in the saved layout: [first, first + stem) -> [end - stem, end)
    stem = kv_cache.resize_columns(kv_cache.roll_columns(kv_cache.resize_columns(kv, big), at_stem - end), cols)
    kv = span(kv, at_stem, jnp.int32(p - 1), min(block_length, chunk))
    return kv_cache.resize_columns(kv, s), stem
