"""Masked-diffusion training: data (`data`), the objective and auxiliary losses (`losses`), the
resumable loop with its deterministic eval (`train`)."""

from clover_jax.errors import DataError
from clover_jax.training.data import Batch, PairDataset, TokenStream, read_text, split_text
from clover_jax.training.train import EvalProtocol, TrainConfig, TrainResult, TrainState, evaluate, train

__all__ = ["Batch", "DataError", "EvalProtocol", "PairDataset", "TokenStream", "TrainConfig", "TrainResult",
           "TrainState", "evaluate", "read_text", "split_text", "train"]
