"""The functional model: weights as a pytree with logical axes (`params`), layer building blocks
(`layers`), every attention-mask rule (`masks`), the forward pass (`transformer`), its cache (`cache`), the
forward-function protocol the sampler and the server run a model through (`forward_fn`) and the MoE (`moe`)."""

from clover_jax.model.cache import KVCache, init_cache
from clover_jax.model.forward_fn import ForwardFn, ModelForward
from clover_jax.model.params import Weights, abstract, count_params, init, named_leaves, weight_shardings
from clover_jax.model.transformer import ForwardOut, apply, forward

__all__ = ["ForwardFn", "ForwardOut", "KVCache", "ModelForward", "Weights", "abstract", "apply", "count_params",
           "forward", "init", "init_cache", "named_leaves", "weight_shardings"]
