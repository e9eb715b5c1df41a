"""The masked-diffusion sampler: `generate(weights, cfg, prompts, SamplerConfig(...))`.

`generate` checks and batches a request and runs it as one compiled program (`program`); the
per-step arithmetic (filters, draws, remasking scores, the commit rule) is in `scoring`; `CanvasRecorder`
(`canvas`) is a progress callback that tells the pass in which each position was committed.
"""

from clover_jax.errors import SamplerError
from clover_jax.sampler.canvas import CanvasRecorder
from clover_jax.sampler.generate import (
    CONFIDENCES,
    GenerateResult,
    SamplerConfig,
    SamplerStats,
    batch_bucket,
    check_model,
    check_prompts,
    check_settings,
    compile_count,
    generate,
    prepare_batch,
    resolve_cache,
    resolve_rule,
    validate,
)
from clover_jax.sampler.program import BLOCK_GRIDS, CACHE_MODES, ModelForward, ProgramSpec
from clover_jax.sampler.scoring import REMASKING, remasking_index

__all__ = [
    "BLOCK_GRIDS",
    "CACHE_MODES",
    "CONFIDENCES",
    "REMASKING",
    "CanvasRecorder",
    "GenerateResult",
    "ModelForward",
    "ProgramSpec",
    "SamplerConfig",
    "SamplerError",
    "SamplerStats",
    "batch_bucket",
    "check_model",
    "check_prompts",
    "check_settings",
    "compile_count",
    "generate",
    "prepare_batch",
    "remasking_index",
    "resolve_cache",
    "resolve_rule",
    "validate",
]
