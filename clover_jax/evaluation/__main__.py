"""`python -m clover_jax.evaluation ARGS`: lm-eval's own command line with the `clover` model registered.

    python -m clover_jax.evaluation run --model clover --model_args pretrained=checkpoints/clover-tiny \\
        --tasks TASK --include_path DIR
"""

from __future__ import annotations

from clover_jax import platforms
from clover_jax.evaluation.harness import register


def main() -> None:
    """Register `clover`, then run lm-eval's command line on sys.argv (on the backends this host has)."""
    platforms.choose()
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
