"""Native checkpoints: the directory format (`format`), atomic writes (`atomic`) and chunk-at-a-time
streaming for conversion (`streaming`), and the check that a checkpoint is whole before anything reads
it (`verify`)."""

from clover_jax.checkpoint.atomic import atomic_directory, check_destination, stale_temporaries
from clover_jax.checkpoint.format import (
    CONFIG_FILE,
    WEIGHTS_DIR,
    check_leaves,
    copy_tokenizer_files,
    expected_leaves,
    flatten_weights,
    load_checkpoint_config,
    load_model,
    save_model,
    stored_leaves,
    unflatten_weights,
)
from clover_jax.checkpoint.streaming import LazyLeaf, WeightReader, save_streaming
from clover_jax.checkpoint.verify import MANIFEST_FILE, verify
from clover_jax.errors import CheckpointError

__all__ = [
    "CONFIG_FILE",
    "MANIFEST_FILE",
    "WEIGHTS_DIR",
    "CheckpointError",
    "LazyLeaf",
    "WeightReader",
    "atomic_directory",
    "check_destination",
    "check_leaves",
    "copy_tokenizer_files",
    "expected_leaves",
    "flatten_weights",
    "load_checkpoint_config",
    "load_model",
    "save_model",
    "save_streaming",
    "stale_temporaries",
    "stored_leaves",
    "unflatten_weights",
    "verify",
]
