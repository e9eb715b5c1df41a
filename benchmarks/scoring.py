"""Milliseconds of the sampler's own per-step arithmetic on one block's logits, without the model.

    python benchmarks/scoring.py                         # [B, 32, 32000] logits, B = 1 and 8
    python benchmarks/scoring.py --vocab 151936 --batch 1

What the sampling program does after every forward pass (`scoring.sample_and_score` then
`scoring.select_commits`): drop the mask token, draw (greedy, or temperature with top-k / top-p), score
(confidence, and the entropy when a setting asks for it), choose the positions to commit. Each setting
runs `--steps` times inside one jitted `lax.fori_loop` (no dispatch in the figure); the best of 5 runs,
per step. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

SETTINGS = {
    "greedy": {},
    "greedy, threshold 0.9": {"threshold": 0.9},
    "greedy, entropy bound 1.0": {"entropy_bound": 1.0},
    "greedy, margin remasking": {"remasking": "margin"},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top-k 50": {"temperature": 0.7, "top_k": 50},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if min(args.batch) <= 0 or args.block <= 0 or args.vocab <= 1 or args.steps <= 0:
        p.error("--batch, --block, --steps must be positive and --vocab at least 2")
    return args


def step_ms(b: int, block: int, vocab: int, steps: int, setting: dict) -> float:
    """Milliseconds per step of `setting` on [b, block, vocab] logits."""
    import jax
    import jax.numpy as jnp

    from clover_jax.config import get_config
    from clover_jax.sampler import SamplerConfig
    from clover_jax.sampler import knobs as knobs_of
    from clover_jax.sampler.scoring import sample_and_score, select_commits

    sc = SamplerConfig(gen_length=block, block_length=block, **setting)
    knobs = knobs_of(sc, get_config("clover-tiny"))  # the family's confidence rule: the drawn token's logits
    logits = jax.random.normal(jax.random.key(0), (b, block, vocab)) * 3
    masked = jnp.ones((b, block), bool)

    @jax.jit
    def run(logits, knobs):
        def body(i, acc):
            x = logits + acc[:, :, None] * 1e-6  # depends on the last step, so nothing is hoisted
            key = jax.random.fold_in(jax.random.key(0), i)
            k_draw, k_score = jax.random.split(key)
            drawn, sc = sample_and_score(x, k_draw, k_score, knobs.temperature, knobs.top_k, knobs.top_p, 0,
                                         knobs.sampled_confidence, knobs.remasking, knobs.entropy_bound > 0)
            chosen = select_commits(sc, masked, jnp.ones((b,), jnp.int32), knobs.threshold, knobs.entropy_bound)
            return acc + chosen.astype(jnp.float32) + drawn.astype(jnp.float32) * 1e-9
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((b, block)))

    run(logits, knobs).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        run(logits, knobs).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    print(f"per-step sampler arithmetic on [B, {args.block}, {args.vocab}] float32 logits; best of 5 runs of "
          f"{args.steps} steps in one fori_loop; jax {jax.__version__} on {jax.default_backend()}, "
          f"{os.cpu_count()} cores", flush=True)
    print(f"{'setting':<30}" + "".join(f"{f'B={b} ms':>10}" for b in args.batch))
    for name, setting in SETTINGS.items():
        row = [step_ms(b, args.block, args.vocab, args.steps, setting) for b in args.batch]
        print(f"{name:<30}" + "".join(f"{ms:>10.2f}" for ms in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
