"""Every error a user can cause, under one base class.

`clover` prints any `CloverError` as one line (`clover COMMAND: error: ...`, exit code 2) and lets
everything else through as a traceback: an exception that is not a `CloverError` is a bug. Each
subclass names the concern that raises it; all are `ValueError`s, so code that caught the old
per-module errors as `ValueError` keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class CloverError(ValueError):
    """Bad input that Clover-JAX refuses with a message naming the problem."""


class ConfigError(CloverError):
    """A model config that cannot describe a working model (raised before anything is traced)."""


class ShardingError(CloverError):
    """A mesh, a layout file or a rules table that cannot shard the model."""


class CheckpointError(CloverError):
    """A checkpoint directory that is missing, malformed, or disagrees with its config."""


class ConversionError(CloverError):
    """A HuggingFace checkpoint or conversion request that cannot be converted faithfully."""


class SamplerError(CloverError):
    """A sampling request that cannot run; raised before anything is compiled. `setting`: the sampler setting at
    fault (a `SamplerConfig` field) and `param`: that setting as the user wrote it (a flag, a request field), when
    one setting is."""

    def __init__(self, message: str, *, setting: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.setting, self.param = setting, param


class PlanError(CloverError):
    """A planning request that cannot be answered (unknown chip, bad shapes, no libtpu)."""


class DataError(CloverError):
    """Training data that cannot be read or does not fit the requested shapes."""


class TokenizerError(CloverError):
    """A checkpoint's tokenizer or chat template file that cannot be read (named in the message)."""


class TokenizerTrainError(CloverError):
    """A tokenizer training request that cannot run."""


class UsageError(CloverError):
    """A command-line request that cannot run (flags that contradict each other, missing files)."""


class EvaluationError(CloverError):
    """A likelihood or evaluation request that cannot run (an empty answer, too long, bad model arguments)."""


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """" (did you mean X?)" for the option closest to a mistyped `word`, or "" when none is close."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
