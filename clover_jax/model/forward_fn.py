"""The forward-function protocol: how the sampler and the serving engine run a model.

Both programs call a `ForwardFn` on one window of their canvas at a time and never see the model's weights
layout or its layers; `ModelForward` is the real model behind it, and tests put scripted models (fixed logits,
counters) in its place.

    logits, cache = forward_fn(weights, tokens [R, W], positions [R, W], mask [R, W, S], cache | None,
                               cache_offset, logits_start, logits_len, *, valid=, blocks=, commit=)

returns float logits [R, logits_len, V] for window columns [logits_start, logits_start + logits_len) and the
cache with the window written at column `cache_offset` (None without one). The keywords are passed for hybrid
models only (Gated DeltaNet layers need the window's real columns, its block ids and how many of its columns
are final: `transformer.forward`). A forward function that supports the cache modes also has
`init_cache(rows, length)`. It must be hashable: it is part of a compiled program's static key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import transformer
from clover_jax.model.cache import KVCache, init_cache

Array = jax.Array


class ForwardFn(Protocol):
    """What the sampler and the serving engine call (see the module docstring)."""

    def __call__(self, weights: Any, tokens: Array, positions: Array, mask: Array, cache: Any,
                 cache_offset: Array, logits_start: Array | int, logits_len: int, **linear: Any
                 ) -> tuple[Array, Any]: ...


@dataclass(frozen=True)
class ModelForward:
    """The real model as a `ForwardFn` (hashable, so compiled programs can be kept per forward function)."""

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

    def init_cache(self, rows: int, length: int) -> KVCache:
        """A zeroed cache of `rows` x `length` columns for every layer (`cache.init_cache`)."""
        return init_cache(self.cfg, rows, length)
