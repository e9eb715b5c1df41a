"""Clover-JAX: a masked-diffusion mixture-of-experts language model in JAX."""

__version__ = "0.1.0"
