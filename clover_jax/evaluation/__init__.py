"""Evaluation: the masked-diffusion likelihood estimator (`likelihood`) and an lm-evaluation-harness model
(`harness`, which alone imports lm_eval: install the `eval` extra).

    from clover_jax.evaluation import estimate
    est = estimate(weights, cfg, prompt_ids, answer_ids, mc_num=64, batch_size=16)
    est.mean, est.stderr
"""

from clover_jax.errors import EvaluationError
from clover_jax.evaluation.likelihood import Estimate, estimate, llada_draws, sample_losses

__all__ = ["Estimate", "EvaluationError", "estimate", "llada_draws", "sample_losses"]
