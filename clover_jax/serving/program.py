"""The serving programs: rows that each run their own request, advanced one block per call.

`sampler.program` runs a whole batch from the first block to the last in one loop; a server needs
rows that join and leave at block boundaries. Here every row of a fixed-capacity state is one
request, laid out *right-aligned* in S columns:

    [ padding | prompt | committed blocks | current block ]       current block = columns [S-L, S)

so the block being denoised sits at the same columns in every row, whatever its index: the model
runs the same windows for all rows (fixed shapes, one compiled program per batch bucket) while each
row carries its own block index, its own settings (`settings.Knobs` with [B] leaves, all traced) and its own
random key.
After a block is committed the row shifts left by L (canvas, valid columns, block ids and the K/V
cache together) and a fresh block of masks opens at the right. Positions count valid columns
(`masks.positions`), so the shift never moves a token's position, and block ids are kept per column:
prompt columns have position // block_size, generated block j has S + j (above every prompt block),
so attention is exactly the block-causal attention of `sampler.program`'s canvas. A causal-prefix model
(`cfg.causal_prefix`) gives clean columns their positions instead (`masks.clean_block_ids`: causal attention),
the prompt's at admission and a block's when it is committed.

Programs (all take and return the whole `SlotState`, whose buffers they donate):
  admit(state, slots, rows..., knobs, n_blocks, scaffolds)
                                      write k new requests into rows `slots` [k] (k static: the engine
                                      admits queued requests together); with a cache, run their prompts in
                                      one batched prefill (the rightmost W columns before the first block,
                                      W one of the engine's static prefill widths) and keep their K/V /
                                      Gated DeltaNet states
  advance_b(state, keep)              one block for rows [0, b): `keep` = False drops a row first
                                      (a cancelled request); returns the committed block's tokens and
                                      which rows finished (end token, or their last block)
  move(state, src, dst)               copy a row (the engine keeps its running rows in [0, n))

Each step of a block is `sampler.step`'s, the sampler's own: the same window pass, the same choice of window
with a cache and the same commit, per row. The cache's layout, placement and row moves are `model.cache`'s.

Cache modes (block-causal models only; the engine refuses bidirectional ones):
  none    every pass runs all S columns (the prompt and every committed block).
  prefix  the first pass of a block runs [block j-1, block j] (writing block j-1's final K/V and, in
          Gated DeltaNet layers, advancing the state over it), later passes run block j against the
          cache (`step.cached_pass`). Exact, as in `sampler.program`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import cache as kv_cache
from clover_jax.model import masks
from clover_jax.model.forward_fn import ForwardFn
from clover_jax.sampler import step as denoise
from clover_jax.sampler.settings import Knobs, SamplerConfig, knobs

Array = jax.Array
SERVE_CACHE_MODES = ("none", "prefix")


class Scaffolds(NamedTuple):
    """Each row's scaffold (`requests.Scaffold`) over its generated columns G (the engine's generated columns and
    one block more, so the next block's slice is always in range), [B, ...] leaves."""

    tokens: Array  # [B, G] int32: a token fixed at the column (committed before the model runs the block), or -1
    classes: Array  # [B, G] int32: 0 any token; c >= 1 only the tokens of allowed[:, c - 1]
    allowed: Array  # [B, C, V] bool: each row's token classes


class SlotState(NamedTuple):
    """Every row of the engine, on device. Cache leaves are [layers, B, ...] (`model.cache.KVCache`)."""

    canvas: Array  # [B, S] int32
    valid: Array  # [B, S] bool
    blocks: Array  # [B, S] int32 block id per column
    cache: Any  # model.cache.KVCache or None (cache "none")
    active: Array  # [B] bool: the row runs a request
    fresh: Array  # [B] bool: the row's current block is its first
    block: Array  # [B] int32 index of the current generated block
    n_blocks: Array  # [B] int32 blocks the request runs at most
    knobs: Knobs  # [B] leaves: each row's traced settings
    scaffold: Scaffolds | None = None  # with an engine that takes scaffolds: each row's


class BlockOut(NamedTuple):
    """What one `advance` call reports (rows [0, b))."""

    tokens: Array  # [b, L] the committed block (end-token filled after a stop)
    finished: Array  # [b] bool: the row ended with this block (end token or its last block)
    stopped: Array  # [b] bool: ... because of an end token
    passes: Array  # int32 forward passes this call ran
    row_passes: Array  # [b] int32 of them, the passes each row took part in (it still had masks to fill)


def state_shardings(state: SlotState, mesh: MeshRules) -> SlotState:
    """Where a state lives on `mesh`: rows over the mesh's batch axes (per-row leaves [B, ...]); the cache where
    `model.cache.shardings` places it (split by heads as the weights are, so no pass reshards it)."""
    def rows(x: Array) -> Any:
        return mesh.sharding(("batch",) + (None,) * (x.ndim - 1))

    cache = None if state.cache is None else kv_cache.shardings(state.cache, mesh)
    scaffold = None if state.scaffold is None else Scaffolds(*(rows(x) for x in state.scaffold))
    return SlotState(rows(state.canvas), rows(state.valid), rows(state.blocks), cache, rows(state.active),
                     rows(state.fresh), rows(state.block), rows(state.n_blocks), Knobs(*(rows(x) for x in state.knobs)),
                     scaffold)


def empty_state(cfg: ModelConfig, forward_fn: ForwardFn, capacity: int, columns: int, block_length: int,
                cache: str, scaffold: tuple[int, int] | None = None) -> SlotState:
    """A state with no running row. Idle rows hold one valid filler token and a block of masks, so
    every row's attention has a key and stays finite; their knobs are the defaults'. `scaffold`: (generated
    columns G, token classes C) of rows that take scaffolds (none fixed, every token allowed)."""
    s, bl = columns, block_length
    col = jnp.arange(s)
    canvas = jnp.where(col >= s - bl, cfg.mask_token_id, cfg.filler_id).astype(jnp.int32)
    valid = col >= s - bl - 1
    blocks = jnp.where(col >= s - bl, s, 0).astype(jnp.int32)
    rep = lambda x: jnp.broadcast_to(x, (capacity, s))
    kv = forward_fn.init_cache(capacity, s) if cache == "prefix" else None
    idle = knobs(SamplerConfig(gen_length=bl, block_length=bl), cfg)
    zi, no = jnp.zeros((capacity,), jnp.int32), jnp.zeros((capacity,), bool)
    rows = Knobs(*(jnp.full((capacity,), x) for x in idle))
    scaffolds = None
    if scaffold is not None:
        g, c = scaffold
        scaffolds = Scaffolds(jnp.full((capacity, g), -1, jnp.int32), jnp.zeros((capacity, g), jnp.int32),
                              jnp.ones((capacity, c, cfg.vocab_size), bool))
    # every leaf its own buffer: the programs donate the state
    return jax.tree.map(jnp.copy, SlotState(rep(canvas), rep(valid), rep(blocks), kv, no, no, zi, zi + 1, rows,
                                            scaffolds))


def abstract_state(cfg: ModelConfig, forward_fn: ForwardFn, capacity: int, columns: int, block_length: int,
                   cache: str, mesh: MeshRules | None = None, scaffold: tuple[int, int] | None = None) -> SlotState:
    """`empty_state`'s shapes as ShapeDtypeStructs (nothing allocated), in `state_shardings` on a mesh:
    the state argument for lowering the programs without data."""
    shapes = jax.eval_shape(lambda: empty_state(cfg, forward_fn, capacity, columns, block_length, cache, scaffold))
    if mesh is None:
        return shapes
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                        state_shardings(shapes, mesh))


def row_args(state: SlotState, rows: int = 1) -> tuple:
    """The arguments of `admit` after the state for `rows` new requests, as unsharded ShapeDtypeStructs: slots
    [rows], canvas / valid / blocks [rows, S], their knobs ([rows] leaves of the state's knob dtypes), their
    blocks [rows] and their scaffolds (None when the state takes none)."""
    s = state.canvas.shape[1]
    sds = jax.ShapeDtypeStruct
    scaffold = None if state.scaffold is None else Scaffolds(
        *(sds((rows, *x.shape[1:]), x.dtype) for x in state.scaffold))
    return (sds((rows,), jnp.int32), sds((rows, s), jnp.int32), sds((rows, s), jnp.bool_), sds((rows, s), jnp.int32),
            Knobs(*(sds((rows,), x.dtype) for x in state.knobs)), sds((rows,), jnp.int32), scaffold)


def _jit(fn: Any, donate: int, out_shardings: Any, mesh: MeshRules | None) -> Any:
    kw = {} if mesh is None else {"out_shardings": out_shardings}
    return jax.jit(fn, donate_argnums=(donate,), **kw)


def block_program(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, cache: str, rows: int,
                  state: SlotState, mesh: MeshRules | None = None) -> Any:
    """The jitted `advance` for rows [0, rows): lower it with (weights, state, keep [rows] bool); the state
    (argument 1) is donated and, on a mesh, handed back in its `state_shardings` (`state` may be abstract) with
    the BlockOut replicated."""
    where = None if mesh is None else state_shardings(state, mesh)
    anywhere = None if mesh is None else mesh.sharding(())
    fn = functools.partial(advance, cfg, forward_fn, block_length, cache, rows)
    return _jit(fn, 1, (where, BlockOut(*[anywhere] * 5)), mesh)


def prefill_program(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, cache: str, width: int,
                    state: SlotState, mesh: MeshRules | None = None) -> Any:
    """The jitted `admit` for prompts in `width` columns (one of the engine's prefill widths; any with cache
    `none`): lower it with (weights, state, *row_args(state, rows)), one program per number of rows; the state is
    donated and, on a mesh, handed back in its `state_shardings`."""
    where = None if mesh is None else state_shardings(state, mesh)
    return _jit(functools.partial(admit, cfg, forward_fn, block_length, cache, width), 1, where, mesh)


def move_program(state: SlotState, mesh: MeshRules | None = None) -> Any:
    """The jitted `move`: lower it with (state, src [] int32, dst [] int32); the state (argument 0) is donated
    and, on a mesh, handed back in its `state_shardings`."""
    return _jit(move, 0, None if mesh is None else state_shardings(state, mesh), mesh)


def admit(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, cache: str, width: int, weights: Any,
          state: SlotState, slots: Array, canvas: Array, valid: Array, blocks: Array, row_knobs: Knobs,
          n_blocks: Array, scaffold: Scaffolds | None = None) -> SlotState:
    """Rows `slots` [k] := k new requests (canvas / valid / blocks [k, S], their knobs with [k] leaves, their blocks
    [k], their scaffolds, whose first block's fixed tokens the canvas already holds); a slot outside the state's
    rows is a padding row (the engine repeats a real request there) and writes nothing. With the prefix cache, also
    their prompts' K/V (and Gated DeltaNet states), written in one batched prefill from the `width` columns before
    the first block, which hold every prompt (`width` is static, one of the
    engine's prefill widths), in windows of `cfg.prefill_chunk` tokens shared by the k rows (`step.prefill`)."""
    k, s, bl = canvas.shape[0], canvas.shape[1], block_length
    kv = state.cache
    if cache == "prefix":
        pos = masks.positions(valid)

        def run(c: Any, lo: Array | int, w: int) -> Any:
            return denoise.window_pass(forward_fn, weights, cfg, canvas, valid, blocks, pos, c, lo, w, 0, 1,
                                       prefill=True)[1]

        new = denoise.prefill(run, forward_fn.init_cache(k, s), s - bl - width, width, denoise.prefill_columns(cfg, k),
                              denoise.prefill_overlap(cfg, cfg.block_size))
        kv = kv_cache.write_rows(kv, new, slots)
    return _install(state, slots, canvas, valid, blocks, row_knobs, n_blocks, kv, scaffold)


def _install(state: SlotState, slots: Array, canvas: Array, valid: Array, blocks: Array, row_knobs: Knobs,
             n_blocks: Array, kv: Any, scaffold: Scaffolds | None) -> SlotState:
    """`state` with rows `slots` [k] running new requests (cache `kv` already written); see `admit`."""
    def put(x: Array, rows: Array) -> Array:
        return x.at[slots].set(jnp.asarray(rows, x.dtype), mode="drop")

    scaffolds = state.scaffold
    if scaffolds is not None:
        scaffolds = Scaffolds(*(put(x, new) for x, new in zip(scaffolds, scaffold, strict=True)))
    return SlotState(put(state.canvas, canvas), put(state.valid, valid), put(state.blocks, blocks), kv,
                     put(state.active, True), put(state.fresh, True), put(state.block, 0),
                     put(state.n_blocks, n_blocks),
                     Knobs(*(put(x, kn) for x, kn in zip(state.knobs, row_knobs, strict=True))), scaffolds)


def admit_reusing(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, width: int, weights: Any,
                  state: SlotState, slots: Array, canvas: Array, valid: Array, blocks: Array, row_knobs: Knobs,
                  n_blocks: Array, scaffold: Scaffolds | None, saved: Any, shift: Array, reused: Array) -> SlotState:
    """`admit` for one request (`admit`'s arguments with one row) whose prompt begins with `reused` tokens that an
    earlier admission already ran: `saved` is `model.cache.read_row` of that row right after it (the K/V at its
    prompt's columns, the Gated DeltaNet state after its prompt). Only the rest of the prompt is prefilled.

    Every row's prompt ends right before its first block (column S - L); this prompt is `shift` tokens longer than
    the saved one, so the reused tokens sit `shift` columns further left: their K/V are rolled there. The new
    tokens [reused, n) are then prefilled from that cache in a window of the static `width` >= n - reused columns
    starting at their first column, on a canvas widened by `width` columns on the right whose block and added
    columns are not valid (a Gated DeltaNet layer passes over invalid columns unchanged; their K/V land in the
    block's columns, which every pass of the block writes before it reads them). Exact when the saved state is the
    state after the first `reused` tokens and nothing they wrote depends on later ones: the whole saved prompt of a
    causal-prefix or causal model, or its whole prompt blocks in a block-causal attention-only model (the engine
    chooses `reused` so)."""
    s, bl = canvas.shape[1], block_length
    n = jnp.sum(valid[0, :s - bl])
    lo = s - bl - (n - reused)
    col = jnp.arange(s + width)
    wide = lambda x, fill: jnp.concatenate([x, jnp.full((1, width), fill, x.dtype)], axis=1)
    cv, ids = wide(canvas, cfg.filler_id), wide(blocks, 0)
    ok = wide(valid, False) & (col < s - bl)[None]
    pos = masks.positions(ok)

    def run(c: Any, start: Array | int, w: int) -> Any:
        return denoise.window_pass(forward_fn, weights, cfg, cv, ok, ids, pos, c, start, w, 0, 1,
                                   prefill=True)[1]

    kv = kv_cache.resize_columns(kv_cache.roll_columns(saved, shift), s + width)
    kv = denoise.prefill(run, kv, lo, width, denoise.prefill_columns(cfg, 1),
                         denoise.prefill_overlap(cfg, cfg.block_size))
    kv = kv_cache.write_rows(state.cache, kv_cache.resize_columns(kv, s), slots)
    return _install(state, slots, canvas, valid, blocks, row_knobs, n_blocks, kv, scaffold)


def reuse_program(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, width: int, state: SlotState,
                  mesh: MeshRules | None = None) -> Any:
    """The jitted `admit_reusing` for at most `width` new prompt tokens: lower it with (weights, state,
    *row_args(state, 1), saved (a one-row cache), shift [] int32, reused [] int32); the state is donated."""
    where = None if mesh is None else state_shardings(state, mesh)
    return _jit(functools.partial(admit_reusing, cfg, forward_fn, block_length, width), 1, where, mesh)


def read_program() -> Any:
    """The jitted `model.cache.read_row`: lower it with (cache, row [] int32)."""
    return jax.jit(kv_cache.read_row)


def move(state: SlotState, src: Array, dst: Array) -> SlotState:
    """Row `dst` := row `src` (every field, the cache included); row `src` is left idle."""
    def row(x: Array) -> Array:
        return jax.lax.dynamic_update_index_in_dim(x, jax.lax.dynamic_index_in_dim(x, src, 0, False), dst, 0)

    return state._replace(
        canvas=row(state.canvas), valid=row(state.valid), blocks=row(state.blocks),
        cache=kv_cache.move_row(state.cache, src, dst), active=row(state.active).at[src].set(False),
        fresh=row(state.fresh), block=row(state.block), n_blocks=row(state.n_blocks),
        knobs=Knobs(*(row(x) for x in state.knobs)),
        scaffold=None if state.scaffold is None else Scaffolds(*(row(x) for x in state.scaffold)))


class _Loop(NamedTuple):
    canvas: Array  # [b, S]
    cache: Any
    step: Array
    passes: Array
    row_passes: Array  # [b]
    n_sched: Array  # [b]


def advance(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, cache: str, rows: int, weights: Any,
            state: SlotState, keep: Array) -> tuple[SlotState, BlockOut]:
    """Run one block for rows [0, rows) of `state` (`rows` is the static batch bucket): every active row
    denoises its current block (columns [S-L, S)) under its own knobs, then rows that go on shift left
    by L and open a new block. `keep` [rows] False drops a row first (its request was cancelled)."""
    b, bl, mask_id, eos_id = rows, block_length, cfg.mask_token_id, cfg.eos_token_id
    s = state.canvas.shape[1]
    active = state.active[:b] & keep
    fresh = state.fresh[:b]
    blk_idx = state.block[:b]
    row_knobs = Knobs(*(x[:b] for x in state.knobs))
    valid, ids = state.valid[:b], state.blocks[:b]
    pos = masks.positions(valid)
    kv0 = kv_cache.take_rows(state.cache, b)
    base_keys = jax.vmap(lambda sd, j: jax.random.fold_in(jax.random.key(sd), j))(row_knobs.seed, blk_idx)

    def call(cv: Array, kv: Any, lo: int, width: int, logits_start: int, commit: int | None) -> tuple[Array, Any]:
        return denoise.window_pass(forward_fn, weights, cfg, cv, valid, ids, pos, kv, lo, width, logits_start, bl,
                                   commit)

    def passes(st: _Loop) -> tuple[Array, Any, Array]:
        """This step's logits [b, L, V], cache and model calls."""
        if cache == "none":  # the whole row (a causal-prefix model: clean up to the block, which is noisy)
            return call(st.canvas, None, 0, s, s - bl, s - bl if cfg.causal_prefix else None)[0], st.cache, \
                jnp.int32(1)
        first = lambda cv, kv: call(cv, kv, s - 2 * bl, 2 * bl, bl, bl)  # [block j-1, block j]: j-1 is final now
        refine = lambda cv, kv: call(cv, kv, s - bl, bl, 0, 0)  # block j against the cache, nothing final
        return denoise.cached_pass(cfg, bl, first, refine, st.canvas, st.cache, st.step == 0, fresh, active)

    def masked_of(cv: Array) -> Array:
        return cv[:, s - bl:] == mask_id

    def live(st: _Loop) -> Array:
        # a block opened with every column fixed by its scaffold still runs one pass: the pass that commits the
        # block before it (its K/V, the Gated DeltaNet state over it)
        return active & (st.step < row_knobs.steps_per_block) & (jnp.any(masked_of(st.canvas), axis=1)
                                                                 | (st.step == 0))

    def step(st: _Loop) -> _Loop:
        logits, kv, calls = passes(st)
        if allowed is not None:
            logits = jnp.where(allowed, logits, -jnp.inf)
        keys = jax.vmap(jax.random.split)(jax.vmap(jax.random.fold_in, (0, None))(base_keys, st.step))
        # earlier blocks hold no end token (a row stops at its first), so the block alone decides the stop
        blk, _ = denoise.commit(logits, st.canvas[:, s - bl:], 0, row_knobs, keys[:, 0], keys[:, 1], st.n_sched,
                                st.step, cfg, live(st), (st.canvas, response))
        cv = st.canvas.at[:, s - bl:].set(blk)
        return _Loop(cv, kv, st.step + 1, st.passes + calls, st.row_passes + live(st), st.n_sched)

    at = lambda x, j: jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i * bl, bl))(x[:b], j)  # [b, L] of block j
    allowed = None
    if state.scaffold is not None:  # the tokens each column of the block may take: [b, L, V]
        cls = at(state.scaffold.classes, blk_idx)
        allowed = state.scaffold.allowed[jnp.arange(b)[:, None], jnp.maximum(cls - 1, 0)] | (cls == 0)[..., None]
    cv0 = state.canvas[:b]
    n_sched = jnp.sum(masked_of(cv0), axis=1)
    # the response so far: the committed blocks and the current one, the last (block + 1) L columns of a row
    response = jnp.arange(s)[None] >= s - bl * (blk_idx[:, None] + 1)
    st = _Loop(cv0, kv0, jnp.int32(0), jnp.int32(0), jnp.zeros((b,), jnp.int32), n_sched)
    st = jax.lax.while_loop(lambda st: jnp.any(live(st)), step, st)

    out_blk = st.canvas[:, s - bl:]
    stopped = (active & jnp.any(out_blk == eos_id, axis=1) & row_knobs.eos_stop if eos_id is not None
               else active & False)
    finished = active & (stopped | (blk_idx + 1 >= state.n_blocks[:b]))
    go_on = active & ~finished

    # rows that go on: shift left by L and open block j+1 (mask tokens, valid, id S + j + 1)
    def shift(x: Array, new: Array) -> Array:
        rolled = jnp.concatenate([x[:, bl:], new], axis=1)
        return jnp.where(go_on[:, None], rolled, x)

    opened = jnp.full((b, bl), mask_id, jnp.int32)
    if state.scaffold is not None:  # block j+1 opens with its scaffold's fixed tokens
        fixed = at(state.scaffold.tokens, blk_idx + 1)
        opened = jnp.where(fixed >= 0, fixed, opened)
    canvas = shift(st.canvas, opened)
    valid_n = shift(valid, jnp.ones((b, bl), bool))
    # the committed block is clean from now on: its ids become those of clean columns (for a causal-prefix model
    # its positions: causal attention), the new block's S + j + 1
    done = ids.at[:, s - bl:].set(masks.clean_block_ids(cfg, pos[:, s - bl:])) if cfg.causal_prefix else ids
    ids_n = shift(done, jnp.broadcast_to((s + blk_idx + 1)[:, None], (b, bl)).astype(jnp.int32))
    kv = st.cache
    if kv is not None:  # the attention K/V move with their columns; the Gated DeltaNet state has none
        kv = kv_cache.put_rows(state.cache, kv_cache.shift_left(kv, bl, go_on))

    new = SlotState(
        state.canvas.at[:b].set(canvas), state.valid.at[:b].set(valid_n), state.blocks.at[:b].set(ids_n), kv,
        state.active.at[:b].set(go_on), state.fresh.at[:b].set(fresh & ~active),
        state.block.at[:b].set(jnp.where(go_on, blk_idx + 1, blk_idx)), state.n_blocks, state.knobs, state.scaffold)
    return new, BlockOut(out_blk, finished, stopped, st.passes, st.row_passes)
