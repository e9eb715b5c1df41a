"""The mixture-of-experts layer: routing, the sort by expert, the grouped SwiGLU and the dispatch table."""

from clover_jax.model.moe.dispatch import (
    DISPATCH,
    LAYER_STACK,
    choose_dispatch,
    dispatch_dense,
    dispatch_ragged,
    dispatch_tiled,
    get_dispatch,
    known_dispatches,
    moe_block,
    takes_layer_stack,
)
from clover_jax.model.moe.grouped_swiglu import MAX_TILE, MIN_TILE, grouped_swiglu, tile_heights
from clover_jax.model.moe.routing import MoEStats, Routing, route, stats
from clover_jax.model.moe.sorting import SortedCopies, combine_sorted, expert_positions, sort_by_expert

__all__ = [
    "DISPATCH", "LAYER_STACK", "MAX_TILE", "MIN_TILE", "MoEStats", "Routing", "SortedCopies", "choose_dispatch",
    "combine_sorted", "dispatch_dense", "dispatch_ragged", "dispatch_tiled", "expert_positions", "get_dispatch",
    "grouped_swiglu", "known_dispatches", "moe_block", "route", "sort_by_expert", "stats", "takes_layer_stack",
    "tile_heights",
]
