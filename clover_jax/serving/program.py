"""The serving programs: rows that each run their own request, advanced one block per call.

`sampler.program` runs a whole batch from the first block to the last in one loop; a server needs
rows that join and leave at block boundaries. Here every row of a fixed-capacity state is one
request, laid out *right-aligned* in S columns:

    [ padding | prompt | committed blocks | current block ]       current block = columns [S-L, S)

so the block being denoised sits at the same columns in every row, whatever its index: the model
runs the same windows for all rows (fixed shapes, one compiled program per batch bucket) while each
row carries its own block index, its own settings (`RowKnobs`, all traced) and its own random key.
After a block is committed the row shifts left by L (canvas, valid columns, block ids and the K/V
cache together) and a fresh block of masks opens at the right. Positions count valid columns
(`masks.positions`), so the shift never moves a token's position, and block ids are kept per column:
prompt columns have position // block_size, generated block j has S + j (above every prompt block),
so attention is exactly the block-causal attention of `sampler.program`'s canvas.

Programs (all take and return the whole `SlotState`, whose buffers they donate):
  admit(state, slot, row..., knobs)   write a new request into row `slot`; with a cache, run its
                                      prompt (the rightmost W columns before the first block, W one of
                                      the static `prefill_widths`) and keep its K/V / Gated DeltaNet state
  advance_b(state, keep)              one block for rows [0, b): `keep` = False drops a row first
                                      (a cancelled request); returns the committed block's tokens and
                                      which rows finished (end token, or their last block)
  move(state, src, dst)               copy a row (the engine keeps its running rows in [0, n))

Cache modes (block-causal models only; the engine refuses bidirectional ones):
  none    every pass runs all S columns (the prompt and every committed block).
  prefix  the first pass of a block runs [block j-1, block j] (writing block j-1's final K/V and, in
          Gated DeltaNet layers, advancing the state over it), later passes run block j against the
          cache. A row's first block has nothing to commit (its prefill ran the prompt): attention-only
          models re-encode the prompt's last L columns instead (idempotent), hybrid ones run it as a
          refinement pass; a batch that mixes such rows with running ones runs both passes and picks per
          row. Exact, as in `sampler.program`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import masks
from clover_jax.sampler.program import ForwardFn
from clover_jax.sampler.scoring import Scores, fill_after_end, sample_and_score, select_commits, transfer_count

Array = jax.Array
SERVE_CACHE_MODES = ("none", "prefix")


class RowKnobs(NamedTuple):
    """Per-row sampling settings, each [B] (traced: any mix of values shares one program)."""

    temperature: Array  # float32, 0 = greedy
    top_p: Array  # float32, 1 = off
    top_k: Array  # int32, 0 = off
    threshold: Array  # float32, 0 = off
    steps: Array  # int32 refinement steps per block (>= 1)
    remasking: Array  # int32 scoring.remasking_index
    eos_stop: Array  # bool
    seed: Array  # uint32
    n_blocks: Array  # int32 blocks the request runs at most
    sampled_confidence: Array  # bool: confidence from the tempered, filtered distribution (`scoring.sample`)


class SlotState(NamedTuple):
    """Every row of the engine, on device. Cache leaves are [layers, B, ...] (`transformer.KVCache`)."""

    canvas: Array  # [B, S] int32
    valid: Array  # [B, S] bool
    blocks: Array  # [B, S] int32 block id per column
    cache: Any  # transformer.KVCache or None (cache "none")
    active: Array  # [B] bool: the row runs a request
    fresh: Array  # [B] bool: the row's current block is its first
    block: Array  # [B] int32 index of the current generated block
    knobs: RowKnobs


class BlockOut(NamedTuple):
    """What one `advance` call reports (rows [0, b))."""

    tokens: Array  # [b, L] the committed block (end-token filled after a stop)
    finished: Array  # [b] bool: the row ended with this block (end token or its last block)
    stopped: Array  # [b] bool: ... because of an end token
    passes: Array  # int32 forward passes this call ran
    row_passes: Array  # [b] int32 of them, the passes each row took part in (it still had masks to fill)


def prefill_widths(columns: int, block_length: int) -> tuple[int, ...]:
    """Static prompt widths a new row is prefilled in: L, 2L, 4L, ... below `columns`, then `columns`
    (= S - L, everything before the first block)."""
    out, w = [], block_length
    while w < columns:
        out.append(w)
        w *= 2
    return (*out, columns)


def state_shardings(state: SlotState, mesh: MeshRules) -> SlotState:
    """Where a state lives on `mesh`: rows over the mesh's batch axes (per-row leaves [B, ...], cache
    leaves [layers, B, ...]); the cache also split by heads as the model's weights are: attention K/V by KV
    head, the Gated DeltaNet state [layers, B, Hv, dk, dv] by value head and its conv tail [layers, B, K-1, C]
    by key-head group (C is grouped by key head, `params.GatedDeltaNetWeights`), so no pass reshards it."""
    def rows(x: Array) -> Any:
        return mesh.sharding(("batch",) + (None,) * (x.ndim - 1))

    def kv(x: Array | None) -> Any:
        return None if x is None else mesh.sharding((None, "batch", None, "kv_heads", None))

    cache = state.cache
    if cache is not None:
        linear = cache.linear
        if linear is not None:
            linear = linear._replace(recurrent=mesh.sharding((None, "batch", "linear_heads", None, None)),
                                     conv_tail=mesh.sharding((None, "batch", None, "linear_key_heads")))
        cache = cache.replace(dense_k=kv(cache.dense_k), dense_v=kv(cache.dense_v), moe_k=kv(cache.moe_k),
                              moe_v=kv(cache.moe_v), linear=linear)
    return SlotState(rows(state.canvas), rows(state.valid), rows(state.blocks), cache, rows(state.active),
                     rows(state.fresh), rows(state.block), RowKnobs(*(rows(x) for x in state.knobs)))


def _cache_rows(cache: Any, fn: Any) -> Any:
    return None if cache is None else jax.tree.map(fn, cache)


def _select_rows(pick: Array, a: Any, b: Any) -> Any:
    """Per row: `a` where pick [B] else `b`, for [B, ...] arrays."""
    def sel(x: Array, y: Array) -> Array:
        return jnp.where(pick.reshape(pick.shape + (1,) * (x.ndim - 1)), x, y)
    return jax.tree.map(sel, a, b)


def _select_cache_rows(pick: Array, a: Any, b: Any) -> Any:
    """Per row for cache leaves, whose rows are axis 1."""
    def sel(x: Array, y: Array) -> Array:
        return jnp.where(pick.reshape((1,) + pick.shape + (1,) * (x.ndim - 2)), x, y)
    return jax.tree.map(sel, a, b)


def empty_state(cfg: ModelConfig, forward_fn: ForwardFn, capacity: int, columns: int, block_length: int,
                cache: str) -> SlotState:
    """A state with no running row. Idle rows hold one valid filler token and a block of masks, so
    every row's attention has a key and stays finite."""
    s, bl = columns, block_length
    col = jnp.arange(s)
    canvas = jnp.where(col >= s - bl, cfg.mask_token_id, cfg.filler_id).astype(jnp.int32)
    valid = col >= s - bl - 1
    blocks = jnp.where(col >= s - bl, s, 0).astype(jnp.int32)
    rep = lambda x: jnp.broadcast_to(x, (capacity, s))
    kv = forward_fn.init_cache(capacity, s) if cache == "prefix" else None
    zi, zf = jnp.zeros((capacity,), jnp.int32), jnp.zeros((capacity,), jnp.float32)
    no = jnp.zeros((capacity,), bool)
    knobs = RowKnobs(zf, zf + 1, zi, zf, zi + 1, zi, ~no, jnp.zeros((capacity,), jnp.uint32), zi + 1, no)
    # every leaf its own buffer: the programs donate the state
    return jax.tree.map(jnp.copy, SlotState(rep(canvas), rep(valid), rep(blocks), kv, no, no, zi, knobs))


def abstract_state(cfg: ModelConfig, forward_fn: ForwardFn, capacity: int, columns: int, block_length: int,
                   cache: str, mesh: MeshRules | None = None) -> SlotState:
    """`empty_state`'s shapes as ShapeDtypeStructs (nothing allocated), in `state_shardings` on a mesh:
    the state argument for lowering the programs without data."""
    shapes = jax.eval_shape(lambda: empty_state(cfg, forward_fn, capacity, columns, block_length, cache))
    if mesh is None:
        return shapes
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                        state_shardings(shapes, mesh))


def row_args(state: SlotState) -> tuple:
    """The arguments of `admit` after the state, as unsharded ShapeDtypeStructs: slot [], canvas / valid /
    blocks [S] and one row's knobs ([] leaves of the state's knob dtypes)."""
    s = state.canvas.shape[1]
    sds = jax.ShapeDtypeStruct
    return (sds((), jnp.int32), sds((s,), jnp.int32), sds((s,), jnp.bool_), sds((s,), jnp.int32),
            RowKnobs(*(sds((), x.dtype) for x in state.knobs)))


def _jit(fn: Any, out_shardings: Any, mesh: MeshRules | None) -> Any:
    kw = {} if mesh is None else {"out_shardings": out_shardings}
    return jax.jit(fn, donate_argnums=(1,), **kw)


def block_program(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, cache: str, rows: int,
                  state: SlotState, mesh: MeshRules | None = None) -> Any:
    """The jitted `advance` for rows [0, rows), as the engine compiles it: lower it with (weights, state,
    keep [rows] bool); the state (argument 1) is donated and, on a mesh, handed back in its
    `state_shardings` (`state` may be abstract) with the BlockOut replicated."""
    where = None if mesh is None else state_shardings(state, mesh)
    anywhere = None if mesh is None else mesh.sharding(())
    fn = functools.partial(advance, cfg, forward_fn, block_length, cache, rows)
    return _jit(fn, (where, BlockOut(*[anywhere] * 5)), mesh)


def prefill_program(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, cache: str, width: int,
                    state: SlotState, mesh: MeshRules | None = None) -> Any:
    """The jitted `admit` for prompts in `width` columns (one of `prefill_widths`; any with cache `none`),
    as the engine compiles it: lower it with (weights, state, *row_args(state)); the state is donated and,
    on a mesh, handed back in its `state_shardings`."""
    where = None if mesh is None else state_shardings(state, mesh)
    return _jit(functools.partial(admit, cfg, forward_fn, block_length, cache, width), where, mesh)


def admit(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, cache: str, width: int, weights: Any,
          state: SlotState, slot: Array, canvas: Array, valid: Array, blocks: Array, knobs: RowKnobs) -> SlotState:
    """Row `slot` := a new request (canvas / valid / blocks [S], knobs with [] leaves). With the prefix
    cache, also its prompt's K/V (and Gated DeltaNet state): one pass over the `width` columns before
    its first block, which hold the whole prompt (`width` is static, one of `prefill_widths`)."""
    s, bl = canvas.shape[0], block_length

    def put(x: Array, row: Array) -> Array:
        return jax.lax.dynamic_update_index_in_dim(x, jnp.asarray(row, x.dtype), slot, axis=0)

    kv = state.cache
    if cache == "prefix":
        lo, hi = s - bl - width, s - bl
        v, ids = valid[None], blocks[None]
        qv, qi = v[:, lo:hi], ids[:, lo:hi]
        linear = dict(valid=qv, blocks=qi) if cfg.is_hybrid else {}
        _, one = forward_fn(weights, canvas[None, lo:hi], masks.positions(v)[:, lo:hi],
                            masks.attention_mask(qv, qi, v, ids, True), forward_fn.init_cache(1, s),
                            jnp.int32(lo), 0, 1, **linear)
        kv = jax.tree.map(lambda big, row: jax.lax.dynamic_update_index_in_dim(big, row[:, 0].astype(big.dtype),
                                                                               slot, axis=1), kv, one)
    return SlotState(put(state.canvas, canvas), put(state.valid, valid), put(state.blocks, blocks), kv,
                     put(state.active, True), put(state.fresh, True), put(state.block, 0),
                     RowKnobs(*(put(x, k) for x, k in zip(state.knobs, knobs, strict=True))))


def move(state: SlotState, src: Array, dst: Array) -> SlotState:
    """Row `dst` := row `src` (every field, the cache included); row `src` is left idle."""
    def row(x: Array) -> Array:
        return jax.lax.dynamic_update_index_in_dim(x, jax.lax.dynamic_index_in_dim(x, src, 0, False), dst, 0)

    def cache_row(x: Array) -> Array:
        return jax.lax.dynamic_update_index_in_dim(x, jax.lax.dynamic_index_in_dim(x, src, 1, False), dst, 1)

    return state._replace(
        canvas=row(state.canvas), valid=row(state.valid), blocks=row(state.blocks),
        cache=_cache_rows(state.cache, cache_row), active=row(state.active).at[src].set(False),
        fresh=row(state.fresh), block=row(state.block), knobs=RowKnobs(*(row(x) for x in state.knobs)))


def _commit_row(logits: Array, key: Array, k: RowKnobs, mask_id: int) -> tuple[Array, Array, Array]:
    """One row's draw and scores: (tokens [L], confidence-ranked score [L], confidence [L])."""
    k_draw, k_score = jax.random.split(key)
    tokens, scores = sample_and_score(logits[None], k_draw, k_score, k.temperature, k.top_k, k.top_p, mask_id,
                                      k.sampled_confidence, k.remasking, False)
    return tokens[0], scores.rank_score[0], scores.confidence[0]


def _commit_rows(logits: Array, keys: Array, k: RowKnobs, mask_id: int) -> tuple[Array, Array, Array]:
    """`_commit_row` for every row. Under vmap a per-row predicate turns every lax.cond inside into
    both branches, so the batch picks the cheapest program that serves all its rows: greedy when no row
    is above temperature 0, unfiltered draws when no row filters by top-k / top-p (else the two
    bisections of `filter_logits` would run at every pass, costing clover-tiny more than its 1-row pass),
    and the per-row filters only when some row asks for them."""
    def run(k: RowKnobs, shared: dict[str, Array]) -> tuple[Array, Array, Array]:
        # `shared` knobs are one value for every row (unbatched), so the conds on them stay conds
        axes = RowKnobs(*(None if f in shared else 0 for f in RowKnobs._fields))
        return jax.vmap(_commit_row, (0, 0, axes, None))(logits, keys, k._replace(**shared), mask_id)

    branches = [lambda k: run(k, {"temperature": jnp.float32(0)}),
                lambda k: run(k, {"top_k": jnp.int32(0), "top_p": jnp.float32(1)}),
                lambda k: run(k, {})]
    hot, filtered = jnp.any(k.temperature > 0), jnp.any((k.top_k > 0) | (k.top_p < 1))
    return jax.lax.switch(jnp.where(hot, jnp.where(filtered, 2, 1), 0), branches, k)


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
    hybrid = cfg.is_hybrid
    active = state.active[:b] & keep
    fresh = state.fresh[:b]
    blk_idx = state.block[:b]
    knobs = RowKnobs(*(x[:b] for x in state.knobs))
    valid, ids = state.valid[:b], state.blocks[:b]
    pos = masks.positions(valid)
    kv0 = _cache_rows(state.cache, lambda x: x[:, :b])
    base_keys = jax.vmap(lambda sd, j: jax.random.fold_in(jax.random.key(sd), j))(knobs.seed, blk_idx)

    def call(cv: Array, kv: Any, lo: int, width: int, logits_start: int, commit: int | None) -> tuple[Array, Any]:
        qv, qi = valid[:, lo:lo + width], ids[:, lo:lo + width]
        kvalid, kid = (valid, ids) if kv is not None else (qv, qi)
        linear = dict(valid=qv, blocks=qi, commit=commit) if hybrid else {}
        logits, kv = forward_fn(weights, cv[:, lo:lo + width], pos[:, lo:lo + width],
                                masks.attention_mask(qv, qi, kvalid, kid, True), kv,
                                jnp.int32(lo), logits_start, bl, **linear)
        return logits.astype(jnp.float32), kv

    def full(cv: Array, kv: Any) -> tuple[Array, Any]:  # cache "none": the whole row
        return call(cv, None, 0, s, s - bl, None)[0], kv

    def refine(cv: Array, kv: Any) -> tuple[Array, Any]:  # block j against the cache, nothing final
        return call(cv, kv, s - bl, bl, 0, 0)

    def first(cv: Array, kv: Any) -> tuple[Array, Any]:  # [block j-1, block j]: block j-1 is final now
        return call(cv, kv, s - 2 * bl, 2 * bl, bl, bl)

    def skip(cv: Array, kv: Any) -> tuple[Array, Any]:
        return jnp.zeros((b, bl, cfg.vocab_size), jnp.float32), kv

    def passes(st: _Loop) -> tuple[Array, Any, Array]:
        """This step's logits [b, L, V], cache and model calls. Step 0 runs `first` for rows past their
        first block and `refine` for rows in it (a hybrid batch holding both runs both); later steps
        run `refine`. Each model call appears once in the program."""
        if cache == "none":
            return *full(st.canvas, st.cache), jnp.int32(1)
        at0 = st.step == 0
        if not hybrid:  # attention only: a first block re-encodes the prompt's last L columns instead
            logits, kv = jax.lax.cond(at0, first, refine, st.canvas, st.cache)
            return logits, kv, jnp.int32(1)
        run_first = at0 & jnp.any(active & ~fresh)
        run_refine = ~at0 | jnp.any(active & fresh)
        la, ka = jax.lax.cond(run_first, first, skip, st.canvas, st.cache)
        lb, kb = jax.lax.cond(run_refine, refine, skip, st.canvas, st.cache)
        take_first = at0 & ~fresh
        return (_select_rows(take_first, la, lb), _select_cache_rows(take_first, ka, kb),
                run_first.astype(jnp.int32) + run_refine.astype(jnp.int32))

    def masked_of(cv: Array) -> Array:
        return cv[:, s - bl:] == mask_id

    def live(st: _Loop) -> Array:
        return active & (st.step < knobs.steps) & jnp.any(masked_of(st.canvas), axis=1)

    def step(st: _Loop) -> _Loop:
        logits, kv, calls = passes(st)
        keys = jax.vmap(jax.random.fold_in, (0, None))(base_keys, st.step)
        drawn, rank, conf = _commit_rows(logits, keys, knobs, mask_id)
        blk = st.canvas[:, s - bl:]
        masked = blk == mask_id
        n = transfer_count(st.n_sched, knobs.steps, st.step)
        scores = Scores(rank, conf, jnp.zeros_like(conf))
        chosen = select_commits(scores, masked, n, knobs.threshold[:, None], 0.0) & live(st)[:, None]
        blk = jnp.where(chosen, drawn, blk)
        # earlier blocks hold no end token (a row stops at its first), so the block alone decides
        blk = fill_after_end(blk, eos_id, mask_id, knobs.eos_stop)
        cv = st.canvas.at[:, s - bl:].set(blk)
        return _Loop(cv, kv, st.step + 1, st.passes + calls, st.row_passes + live(st), st.n_sched)

    cv0 = state.canvas[:b]
    n_sched = jnp.sum(masked_of(cv0), axis=1)
    st = _Loop(cv0, kv0, jnp.int32(0), jnp.int32(0), jnp.zeros((b,), jnp.int32), n_sched)
    st = jax.lax.while_loop(lambda st: jnp.any(live(st)), step, st)

    out_blk = st.canvas[:, s - bl:]
    stopped = active & jnp.any(out_blk == eos_id, axis=1) & knobs.eos_stop if eos_id is not None else active & False
    finished = active & (stopped | (blk_idx + 1 >= knobs.n_blocks))
    go_on = active & ~finished

    # rows that go on: shift left by L and open block j+1 (mask tokens, valid, id S + j + 1)
    def shift(x: Array, new: Array, axis: int = 1) -> Array:
        rolled = jnp.concatenate([jax.lax.slice_in_dim(x, bl, s, axis=axis), new], axis=axis)
        pick = go_on.reshape((1,) * (axis - 1) + (b,) + (1,) * (x.ndim - axis))
        return jnp.where(pick, rolled, x)

    canvas = shift(st.canvas, jnp.full((b, bl), mask_id, jnp.int32))
    valid_n = shift(valid, jnp.ones((b, bl), bool))
    ids_n = shift(ids, jnp.broadcast_to((s + blk_idx + 1)[:, None], (b, bl)).astype(jnp.int32))
    kv = st.cache
    if kv is not None:  # the attention layers' K/V move with their columns; Gated DeltaNet state has none
        def shift_kv(x: Array | None) -> Array | None:
            return None if x is None else shift(x, jnp.zeros((*x.shape[:2], bl, *x.shape[3:]), x.dtype), axis=2)
        kv = kv.replace(dense_k=shift_kv(kv.dense_k), dense_v=shift_kv(kv.dense_v), moe_k=shift_kv(kv.moe_k),
                        moe_v=shift_kv(kv.moe_v))
        kv = jax.tree.map(lambda big, small: big.at[:, :b].set(small), state.cache, kv)

    new = SlotState(
        state.canvas.at[:b].set(canvas), state.valid.at[:b].set(valid_n), state.blocks.at[:b].set(ids_n), kv,
        state.active.at[:b].set(go_on), state.fresh.at[:b].set(fresh & ~active),
        state.block.at[:b].set(jnp.where(go_on, blk_idx + 1, blk_idx)), state.knobs)
    return new, BlockOut(out_blk, finished, stopped, st.passes, st.row_passes)
