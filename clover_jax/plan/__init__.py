"""`clover plan`: will a model fit a slice and what does a pass cost, without the hardware.

`arithmetic` counts bytes and FLOPs, `aot` compiles for a TPU topology with libtpu on any host,
`report` puts both into a `Plan` and prints it; `programs` compiles the whole programs `clover generate`
and `clover serve` run (`plan_generate`, `plan_serve`).
"""

from clover_jax.errors import PlanError
from clover_jax.plan.aot import libtpu_available
from clover_jax.plan.arithmetic import CHIPS, Chip, analytic_flops_per_chip, weight_bytes_per_chip
from clover_jax.plan.programs import PassCost, ProgramPlan, format_program_plan, plan_generate, plan_serve
from clover_jax.plan.report import Plan, format_plan, make_plan

__all__ = ["CHIPS", "Chip", "PassCost", "Plan", "PlanError", "ProgramPlan", "analytic_flops_per_chip", "format_plan",
           "format_program_plan", "libtpu_available", "make_plan", "plan_generate", "plan_serve",
           "weight_bytes_per_chip"]
