"""The functional model: weights as a pytree with logical axes (`params`), layer building blocks
(`layers`), every attention-mask rule (`masks`), the forward pass (`transformer`) and the MoE (`moe`)."""

from clover_jax.model.params import Weights, abstract, count_params, init, named_leaves, weight_shardings
from clover_jax.model.transformer import ForwardOut, KVCache, apply, forward, init_cache

__all__ = ["ForwardOut", "KVCache", "Weights", "abstract", "apply", "count_params", "forward", "init", "init_cache",
           "named_leaves", "weight_shardings"]
