"""Worked examples built on `clover_jax`: not part of the library, and not shipped in its wheel.

They live in the repository, next to `benchmarks/` and `scripts/`; import them with the repository root on
`sys.path` (as the benchmarks, scripts, tests and notebooks that use them do): `from examples import toy_agent`.
"""
