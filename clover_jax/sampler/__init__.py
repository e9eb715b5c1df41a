"""The masked-diffusion sampler: `generate(weights, cfg, prompts, SamplerConfig(...))`.

`settings` is the table of the sampler's settings (`SamplerConfig`, their rules, the traced `Knobs`); `generate`
checks and batches a request and runs it as one compiled program (`program`); `step` is one denoising step
(window, pass, commit), shared with the serving engine; the per-step arithmetic (filters, draws, remasking
scores, the commit rule) is in `scoring`; `CanvasRecorder` (`canvas`) is a progress callback that tells the pass
in which each position was committed.
"""

from clover_jax.errors import SamplerError
from clover_jax.sampler.canvas import CanvasRecorder
from clover_jax.sampler.generate import (
    GenerateResult,
    SamplerStats,
    batch_bucket,
    check_model,
    check_prompts,
    compile_count,
    generate,
    prepare_batch,
    validate,
)
from clover_jax.sampler.program import ProgramSpec
from clover_jax.sampler.scoring import REMASKING, remasking_index
from clover_jax.sampler.settings import (
    BLOCK_GRIDS,
    CACHE_MODES,
    CONFIDENCES,
    Knobs,
    SamplerConfig,
    check_settings,
    knobs,
    resolve_cache,
    resolve_rule,
)

__all__ = [
    "BLOCK_GRIDS",
    "CACHE_MODES",
    "CONFIDENCES",
    "REMASKING",
    "CanvasRecorder",
    "GenerateResult",
    "Knobs",
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
    "knobs",
    "prepare_batch",
    "remasking_index",
    "resolve_cache",
    "resolve_rule",
    "validate",
]
