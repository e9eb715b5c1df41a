"""Clover-JAX: a masked-diffusion mixture-of-experts language model in JAX.

    import clover_jax
    cfg, weights = clover_jax.load_model(str(clover_jax.shipped.MODEL_DIR))  # the shipped clover-tiny
    logits = clover_jax.forward(weights, cfg, tokens).logits          # tokens [B, T] int32
    res = clover_jax.generate(weights, cfg, [ids], clover_jax.SamplerConfig(gen_length=64))

Everything else lives in the subpackages: `model`, `mesh`, `sampler`, `training`, `tokenizer`,
`checkpoint`, `convert`, `plan`, `kernels`, `commands`.
"""

from clover_jax import shipped
from clover_jax.checkpoint import load_model, save_model
from clover_jax.config import ModelConfig, get_config
from clover_jax.errors import CloverError
from clover_jax.model import forward
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.version import __version__

__all__ = ["CloverError", "ModelConfig", "SamplerConfig", "__version__", "forward", "generate", "get_config",
           "load_model", "save_model",
           "shipped"]
