"""Every attention mask and block-id rule of the project, in one place.

A block-diffusion model attends by blocks: `bidirectional` models see every valid key,
`block_causal` ones see full attention inside a block and causal attention across blocks
(a query sees keys whose block id is <= its own). A causal-prefix model (`cfg.causal_prefix`, Clover as its
ports run it) is causal on clean text, which is block-causal with every clean token a block of its own
(`clean_block_ids`); only the block being denoised is one block, after every clean column
(`prefix_canvas_ids`). Masks are boolean [B, Tq, Tk], True where the
query may attend to the key. Positions count only valid (non-padding) tokens, so left padding never
shifts a row; block ids follow each row's own positions (LLaDA2's absolute blocks).

Three callers build masks from these rules: a plain forward pass (`full_mask`), the sampler's
canvas (`canvas_block_ids` + `BlockMask`, `attention_mask`'s rule left unevaluated so that chunked attention builds
only the chunk it reads: a long prompt's [Tq, Tk] mask is never held whole) and block-diffusion training
(`training_block_ids` + `block_diffusion_mask`).

Where a generation's blocks start is the block grid (`BLOCK_GRIDS`): `prompt` opens the first generated
block right after the prompt (Clover, LLaDA-style samplers), `absolute` keeps position // block size, so
the prompt's last partial block is the first generated block's head (LLaDA2's generator). Training on
prompt / response pairs lays its blocks on the grid its sampler will use.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from clover_jax.config import ModelConfig

Array = jax.Array


def positions(valid: Array) -> Array:
    """Rotary positions [B, T] counting only valid tokens, so left padding does not shift a row."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def block_ids(cfg: ModelConfig, valid: Array) -> Array:
    """Block ids [B, T] aligned to each row's own positions: position // cfg.block_size."""
    return positions(valid) // cfg.block_size


def clean_block_ids(cfg: ModelConfig, pos: Array) -> Array:
    """The block ids of clean (committed) columns at positions `pos`, as the model's attention reads them:
    position // block_size; for a causal-prefix model the position itself (causal attention)."""
    return pos if cfg.causal_prefix else pos // cfg.block_size


def prefix_canvas_ids(pos: Array, first_noisy: Array | int, prompt_len: int, block_length: int) -> Array:
    """A causal-prefix model's block ids on the sampler's canvas [B, S] while the block at column `first_noisy`
    is denoised: every column before it is clean (its own position: causal), generated block j (columns
    prompt_len + j*L ...) from there on is block S + j, after every clean one."""
    col = jnp.arange(pos.shape[-1])[None]
    return jnp.where(col < first_noisy, pos, pos.shape[-1] + (col - prompt_len) // block_length)


BLOCK_GRIDS = ("prompt", "absolute")


def family_block_grid(cfg: ModelConfig) -> str:
    """The block grid of the family's own generator: `absolute` for LLaDA2, `prompt` for every other."""
    return "absolute" if cfg.family == "llada2_moe" else "prompt"


def resolve_block_grid(cfg: ModelConfig, grid: str) -> str:
    """`auto` -> `family_block_grid(cfg)`; any other grid as given (training and the sampler share this rule)."""
    return family_block_grid(cfg) if grid == "auto" else grid


def training_block_ids(cfg: ModelConfig, valid: Array, scored: Array, grid: str) -> Array:
    """Block ids [B, T] of a training row: `absolute` is `block_ids`; `prompt` keeps the prompt's (the valid
    columns before a row's first scored one) and opens a fresh block at the first scored column, as the
    sampler's canvas does (`canvas_block_ids`: same order, so the same attention). A row scored from its
    first valid column (plain text) gets the same ids on both grids. Ids are < n_blocks + 1 for T columns."""
    if grid not in BLOCK_GRIDS:
        raise ValueError(f"unknown block grid {grid!r}; choose one of {BLOCK_GRIDS}")
    pos = positions(valid)
    if grid == "absolute":
        return pos // cfg.block_size
    bs = cfg.block_size
    prompt = jnp.sum(valid & (jnp.cumsum(scored & valid, axis=-1) == 0), axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(pos < prompt, pos // bs, -(-prompt // bs) + (pos - prompt) // bs)


def canvas_block_ids(pos: Array, prompt_len: int, block_length: int, block_size: int) -> Array:
    """Block ids of the sampler's canvas [B, P + G (+ padding)]: prompt columns get
    position // block_size; generated block j (columns P + j*L ...) gets P + j, larger than every
    prompt block, so the first generated block sees the whole prompt and the prompt never sees the
    generation (which is what makes caching exact for block-causal models)."""
    col = jnp.arange(pos.shape[-1])[None]
    return jnp.where(col < prompt_len, pos // block_size, prompt_len + (col - prompt_len) // block_length)


def attention_mask(q_valid: Array, q_block: Array, k_valid: Array, k_block: Array, block_causal: bool) -> Array:
    """Boolean mask [B, Tq, Tk]: True where query may attend to key.

    Keys must be valid (not padding). Block-causal: a query sees keys whose block id is <= its own
    (full attention inside a block, causal across blocks). Queries that are padding still see every
    valid key so that their (discarded) rows stay finite.
    """
    mask = jnp.broadcast_to(k_valid[:, None, :], (q_valid.shape[0], q_valid.shape[1], k_valid.shape[1]))
    if block_causal:
        mask = mask & (k_block[:, None, :] <= q_block[:, :, None])
    return mask


@dataclass(frozen=True)
class BlockMask:
    """`attention_mask(q_valid, q_block, k_valid, k_block, block_causal)` unevaluated (a pytree: the four [B, T]
    vectors are its leaves): `full()` builds the [B, Tq, Tk] mask, `rows` / `cols` narrow it to a query or key
    range, so a chunked attention builds one chunk of it at a time.

    `causal` is the builder's promise that, for every valid query, the mask is "valid keys at columns <= the
    query's own" (its column in the cache when there is one): clean text of a causal-prefix model, whose block ids
    are positions, and nothing after the window valid and earlier. Attention may then run through a causal kernel
    (`model.splash`); the vectors still give the same mask. A narrowed mask (`rows`, `cols`) makes no promise."""

    q_valid: Array
    q_block: Array
    k_valid: Array
    k_block: Array
    block_causal: bool
    causal: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, Tq, Tk) of the full mask."""
        return (self.q_valid.shape[0], self.q_valid.shape[1], self.k_valid.shape[1])

    def full(self) -> Array:
        """The boolean mask [B, Tq, Tk]."""
        return attention_mask(self.q_valid, self.q_block, self.k_valid, self.k_block, self.block_causal)

    def rows(self, start: Array | int, n: int) -> BlockMask:
        """The mask of queries [start, start + n)."""
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, start, n, axis=1)
        return BlockMask(cut(self.q_valid), cut(self.q_block), self.k_valid, self.k_block, self.block_causal)

    def cols(self, start: Array | int, n: int) -> BlockMask:
        """The mask of keys [start, start + n)."""
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, start, n, axis=1)
        return BlockMask(self.q_valid, self.q_block, cut(self.k_valid), cut(self.k_block), self.block_causal)


jax.tree_util.register_dataclass(BlockMask, data_fields=["q_valid", "q_block", "k_valid", "k_block"],
                                 meta_fields=["block_causal", "causal"])


def full_mask(cfg: ModelConfig, valid: Array, blocks: Array | None = None) -> Array:
    """Mask for a cache-free pass over [B, T] clean tokens: padding keys hidden, block-causal if configured (a
    causal-prefix model: causal, `clean_block_ids`)."""
    if blocks is None:
        blocks = clean_block_ids(cfg, positions(valid))
    return attention_mask(valid, blocks, valid, blocks, cfg.is_block_causal)


def clean_mask(cfg: ModelConfig, valid: Array) -> BlockMask:
    """`full_mask(cfg, valid)` unevaluated (built where attention reads it); a causal-prefix model's carries the
    causal promise (`BlockMask.causal`), so its attention may run through a causal kernel."""
    blocks = clean_block_ids(cfg, positions(valid))
    return BlockMask(valid, blocks, valid, blocks, cfg.is_block_causal, cfg.causal_prefix)


def block_diffusion_mask(valid: Array, blocks: Array, causal_clean: bool = False) -> Array:
    """[B, 2L, 2L] mask for block-diffusion training's concatenated (noisy, clean) sequence, from
    valid / block ids [B, L]:

        queries \\ keys     noisy block j          clean block j
        noisy block i      j == i                 j <  i
        clean block i      never                  j <= i  (causal_clean: the clean keys at or before the query)
    """
    qb, kb = blocks[:, :, None], blocks[:, None, :]
    key_ok = valid[:, None, :]
    noisy_noisy = (qb == kb) & key_ok
    noisy_clean = (kb < qb) & key_ok
    clean_noisy = jnp.zeros_like(noisy_noisy)
    if causal_clean:
        pos = positions(valid)
        clean_clean = (pos[:, None, :] <= pos[:, :, None]) & key_ok
    else:
        clean_clean = (kb <= qb) & key_ok
    top = jnp.concatenate([noisy_noisy, noisy_clean], axis=2)
    bottom = jnp.concatenate([clean_noisy, clean_clean], axis=2)
    return jnp.concatenate([top, bottom], axis=1)
