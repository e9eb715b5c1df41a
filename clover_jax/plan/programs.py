"""`clover plan --generate` / `--serve`: compile the programs a user runs, not single passes.

`plan_generate` lays a request out with the sampler's own `prepare` (the same checks, buckets, cache
mode and MoE dispatch as `generate`) and AOT-compiles `sampler.generate.PROGRAM_JIT`, the jitted
whole-request loop (prefill, every block, every refinement step, the cache allocated inside), for
the layout's TPU topology with the weights as ShapeDtypeStructs in their shardings. `plan_serve`
builds the `serving.Engine` of the same flags (its checks, columns, cache mode and prefill widths)
and compiles the programs `Engine.programs` hands it, the ones `clover serve` compiles: its block program (the
state donated) and its widest prefill program. The TPU compiler's `memory_analysis()` is the per-chip HBM
verdict; a compiler "out of memory" is "does not fit".

Next to it an analytic roofline (`PassCost`): per pass, the weight bytes one chip reads (routed
experts only as far as the pass's tokens reach them, `arithmetic.weights_touched_per_chip`) plus the
cache it reads, against the chip's HBM bandwidth, and the busiest chip's matmul FLOPs against its
peak; the slower of the two bounds the pass. Tokens/s assume one committed token per pass per row
(steps = gen length, the sampler's default).

GPU / CPU layouts (and `--no-compile`) get the same figures by arithmetic, with an estimate of HBM
(weights + cache + the prefill's float32 attention scores + logits) in place of the compiler's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh

from clover_jax.config import ModelConfig
from clover_jax.errors import PlanError
from clover_jax.mesh.layouts import Layout
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import params
from clover_jax.plan.aot import Compiled, compile_jitted, libtpu_available, topology_mesh
from clover_jax.plan.arithmetic import (
    GPU_USABLE_FRACTION,
    Chip,
    PassShape,
    analytic_flops_per_chip,
    cache_bytes,
    cache_bytes_per_chip,
    experts_touched,
    linear_state_bytes,
    shards,
    weight_bytes_by_kind,
    weight_bytes_per_chip,
    weights_touched_per_chip,
)
from clover_jax.plan.report import gb, header_lines, resolve_chip
from clover_jax.sampler import CACHE_MODES, SamplerConfig
from clover_jax.serving import program as serving_program

# `clover_jax.sampler` re-exports the function `generate`, which hides the module of that name
_generate_module = sys.modules["clover_jax.sampler.generate"]


@dataclass(frozen=True)
class PassCost:
    """The analytic cost of one forward pass on the busiest chip: FLOPs and HBM bytes read."""

    name: str
    rows: int
    window: int  # query tokens per row
    kv_len: int  # key columns attended to
    flops: float  # matmul FLOPs of the busiest chip
    weight_bytes: float  # weight bytes read per chip (experts as far as the tokens reach them)
    cache_bytes: float  # cache bytes read per chip
    logits_bytes: float  # float32 logits written per chip
    experts_frac: float = 0.0  # expected fraction of the experts the pass routes to

    @property
    def bytes(self) -> float:
        """HBM bytes per chip: weights + cache + logits."""
        return self.weight_bytes + self.cache_bytes + self.logits_bytes

    def seconds(self, chip: Chip) -> tuple[float, float]:
        """(compute s, memory s) on `chip` at its published peak FLOP/s and HBM bandwidth."""
        return self.flops / chip.peak_flops, self.bytes / chip.hbm_bw

    def bound(self, chip: Chip) -> tuple[float, str]:
        """(seconds, "HBM-bound" | "compute-bound"): the roofline's lower bound on the pass's time."""
        tc, tm = self.seconds(chip)
        return max(tc, tm), ("HBM-bound" if tm >= tc else "compute-bound")


@dataclass
class ProgramCompile:
    """One program compiled for the topology (`compiled` None: not compiled)."""

    name: str
    what: str
    compiled: Compiled | None = None


@dataclass
class ProgramPlan:
    """What `plan_generate` / `plan_serve` found: shapes, weight and cache bytes, compiles, roofline."""

    kind: str  # "generate" | "serve"
    cfg: ModelConfig
    layout: Layout
    chip: Chip
    dispatch: str
    rows: int  # sequences in the program (the batch bucket / the engine's rows)
    prompt_len: int  # prompt tokens asked for
    prompt_cols: int  # columns the program gives the prompt (bucket / max_prompt rounded to blocks)
    gen_len: int  # generated tokens asked for
    gen_cols: int  # generated columns of the program
    block: int
    cache: str  # the resolved cache mode
    cache_rows: int
    cache_columns: int  # 0: no cache
    cache_total: int  # bytes, all chips
    cache_per_chip: int
    weights_total: int
    weights_per_chip: int
    programs: list[ProgramCompile]
    passes: dict[str, PassCost]  # "refine" (and "first", "prefill" when the program runs them)
    method: str  # "compiled for ..." | "arithmetic"
    note: str = ""
    activations_estimate: float = 0.0  # arithmetic plans: the prefill's scores + logits per chip
    steps: int = field(default=0)  # passes a request runs after its prefill (one token per pass per row)

    @property
    def compiled(self) -> bool:
        """Whether the verdict comes from the TPU compiler."""
        return self.method.startswith("compiled")

    @property
    def usable_hbm(self) -> float:
        """The chip's HBM bytes, times `GPU_USABLE_FRACTION` on GPU layouts."""
        return self.chip.hbm_bytes * (GPU_USABLE_FRACTION if self.layout.platform == "gpu" else 1.0)

    @property
    def peak_bytes(self) -> float | None:
        """Per-chip HBM: the largest compiled program's (arguments + outputs + temporaries - aliased + code),
        or the arithmetic estimate; None when a compile was refused."""
        if not self.compiled:
            return self.weights_per_chip + self.cache_per_chip + self.activations_estimate
        done = [p.compiled for p in self.programs if p.compiled is not None]
        if not done or not all(c.ok for c in done):
            return None
        return float(max(c.hbm_bytes for c in done))

    @property
    def fits(self) -> bool:
        """Compiled: every program compiled and within the chip's HBM; arithmetic: the estimate within the
        usable HBM."""
        peak = self.peak_bytes
        if peak is None:
            return False
        if self.compiled:
            return all(p.compiled is not None for p in self.programs) and peak <= self.chip.hbm_bytes
        return peak <= self.usable_hbm

    def request_seconds(self) -> tuple[float, float]:
        """(prefill s, decode s) of one request by the roofline: the prefill once, then per block one
        first pass and refinement passes for the rest of its steps (one token per pass per row)."""
        chip = self.chip
        pre = self.passes["prefill"].bound(chip)[0] if "prefill" in self.passes else 0.0
        n_blocks = self.gen_cols // self.block
        first = self.passes.get("first", self.passes["refine"]).bound(chip)[0]
        refine = self.passes["refine"].bound(chip)[0]
        return pre, n_blocks * first + max(self.steps - n_blocks, 0) * refine

    def tokens_per_s(self) -> float:
        """Generated tokens per second over all rows while decoding (prefill excluded)."""
        _, decode = self.request_seconds()
        return self.rows * self.gen_len / decode if decode > 0 else 0.0


# ---- building the plan -------------------------------------------------------------------------


def _mesh(layout: Layout, compile_tpu: bool, say: Callable[[str], None]) -> tuple[MeshRules, str, str]:
    """(mesh, method, note): the topology's mesh when the plan compiles, else an abstract mesh."""
    if layout.platform == "tpu" and compile_tpu:
        if libtpu_available():
            say(f"building topology {layout.topology}")
            mesh = topology_mesh(layout)
            kind = str(getattr(mesh.devices.flat[0], "device_kind", "TPU"))
            return MeshRules(mesh, layout.rules), f"compiled for {kind}, topology {layout.topology}", ""
        note = "libtpu is not installed: arithmetic only (pip install 'jax[tpu]' to compile for the slice)"
    elif layout.platform == "tpu":
        note = "compile skipped by --no-compile"
    else:
        note = ""
    return MeshRules(AbstractMesh(layout.shape, layout.axes), layout.rules), "arithmetic", note


def _weights(cfg: ModelConfig, layout: Layout, mesh: MeshRules) -> tuple[int, int, dict[str, int], object]:
    """(bytes of all weights, bytes per chip, per chip by kind, weight structs or None on an abstract mesh)."""
    shardings = params.weight_shardings(cfg, mesh.mesh, layout.rules)  # ShardingError before any compile
    mesh_shape = dict(zip(layout.axes, layout.shape, strict=True))
    total, per_chip = weight_bytes_per_chip(cfg, shardings, mesh_shape)
    by_kind = weight_bytes_by_kind(cfg, shardings, mesh_shape)
    structs = None if isinstance(mesh.mesh, AbstractMesh) else params.shape_structs(cfg, shardings)
    return total, per_chip, by_kind, structs


def _pass(cfg: ModelConfig, layout: Layout, by_kind: dict[str, int], name: str, rows: int, window: int,
          kv_len: int, logits_len: int, cache_read: float) -> PassCost:
    """One pass's cost. A pass that denoises (not the prefill) of a causal-prefix model previews one block per row:
    its rows route within the block expert coreset when the config has one."""
    shape = PassShape(name, rows, window, kv_len, logits_len, cache_read > 0)
    logits = rows * logits_len * cfg.vocab_size * 4 / shards(layout, "batch", "vocab")
    preview = cfg.causal_prefix and name != "prefill"
    block_rows, blocks = (rows * logits_len, rows) if preview else (0, 0)
    free = rows * window - block_rows if cfg.moe_block_coreset else rows * window
    return PassCost(name, rows, window, kv_len, analytic_flops_per_chip(cfg, shape, layout),
                    weights_touched_per_chip(cfg, by_kind, rows * window, block_rows, blocks), cache_read, logits,
                    experts_touched(cfg, free, blocks))


def _check_request(layout: Layout, batch: int | None, prompt_len: int, gen_len: int, block: int | None) -> int:
    """The batch (default: the data-parallel size); PlanError for sizes that are not positive."""
    for flag, v in (("--prompt-len", prompt_len), ("--gen-len", gen_len), ("--batch", batch), ("--block", block)):
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise PlanError(f"{flag} must be a positive integer, got {v!r}")
    data = shards(layout, "batch")
    batch = batch or data
    if batch % data:
        raise PlanError(f"batch {batch} must be a multiple of the data-parallel size {data} of {layout.name!r}")
    return batch


def plan_generate(cfg: ModelConfig, layout: Layout, *, prompt_len: int, gen_len: int, batch: int | None = None,
                  block: int | None = None, cache: str = "auto", dispatch: str | None = None,
                  compile_tpu: bool = True, chip: str | None = None,
                  progress: Callable[[str], None] | None = None) -> ProgramPlan:
    """Plan `generate` for `batch` prompts of `prompt_len` tokens and `gen_len` new tokens in blocks of
    `block` (default the config's block_size) with `cache` (auto | none | prefix | dual, as the sampler
    has them) and `dispatch` (default the sampler's choice for the mesh).

    The request is checked and bucketed by the sampler itself (`sampler.generate.prepare`: SamplerError
    for what `generate` would refuse); on a TPU layout with libtpu the whole-request program
    (`PROGRAM_JIT`) is AOT-compiled for the topology, elsewhere the plan is arithmetic."""
    say = progress or (lambda s: None)
    spec_chip = resolve_chip(cfg, layout, chip)
    batch = _check_request(layout, batch, prompt_len, gen_len, block)
    if cache not in ("auto", *CACHE_MODES):
        raise PlanError(f"unknown cache mode {cache!r}; choose one of {('auto', *CACHE_MODES)}")
    block = block or cfg.block_size
    mesh, method, note = _mesh(layout, compile_tpu, say)
    abstract = method == "arithmetic"
    sc = SamplerConfig(gen_length=gen_len, block_length=block, cache=cache)
    prompts = [np.zeros((prompt_len,), np.int32)] * batch  # token ids do not change the program
    prep = _generate_module.prepare(cfg, prompts, sc, mesh=mesh,
                                    dispatch=dispatch or ("ep_gather" if abstract else None))
    spec = prep.spec
    total, per_chip, by_kind, structs = _weights(cfg, layout, mesh)

    p, g, bl, rows = spec.prompt_len, spec.gen_columns, spec.block_length, spec.model_rows
    s = spec.cache_columns
    cache_chip = cache_bytes_per_chip(cfg, layout, rows, s) if s else 0
    passes: dict[str, PassCost] = {}
    if spec.cache == "none":
        passes["refine"] = _pass(cfg, layout, by_kind, "refine", rows, p + g, p + g, bl, 0.0)
    else:
        bidir = not cfg.is_block_causal
        passes["prefill"] = _pass(cfg, layout, by_kind, "prefill", rows, p + g if bidir else p, s, bl, cache_chip)
        passes["first"] = _pass(cfg, layout, by_kind, "first", rows, p + g if bidir else 2 * bl, s, bl, cache_chip)
        # bidirectional prefix: [block j .. end] windows up to G wide (the widest counted)
        width = g if (bidir and spec.cache == "prefix") else bl
        passes["refine"] = _pass(cfg, layout, by_kind, "refine", rows, width, s, bl, cache_chip)

    what = (f"{spec.batch} row{'s' if spec.batch > 1 else ''} x ({p} prompt + {g} generated) columns, blocks of "
            f"{bl}, cache {spec.cache}"
            f"{' (auto)' if cache == 'auto' else ''}")
    prog = ProgramCompile("generate", f"the sampler's whole compiled loop (sampler.generate.PROGRAM_JIT): {what}")
    if not abstract:
        say(f"compiling the generate program ({what}) for {layout.topology}")
        prog.compiled = compile_jitted(_generate_module.PROGRAM_JIT,
                                       (spec, prep.forward_fn, *prep.abstract_args(structs)), mesh.mesh)
    plan = ProgramPlan("generate", cfg, layout, spec_chip, prep.forward_fn.dispatch if not abstract else
                       (dispatch or "chosen on the devices"), spec.batch, prompt_len, p, gen_len, g, bl, spec.cache,
                       rows if s else 0, s, cache_bytes(cfg, rows, s) if s else 0, cache_chip, total, per_chip,
                       [prog], passes, method, note, steps=int(prep.knobs.steps_per_block) * spec.n_blocks)
    plan.activations_estimate = _activations(cfg, layout, rows, p if s else p + g, p + g, bl)
    return plan


def serve_programs(engine: Any, weights: Any) -> dict[tuple[Any, ...], tuple[Any, tuple]]:
    """What `clover plan --serve` compiles: the engine's own programs (`Engine.programs`, the ones `clover serve`
    compiles before it listens) with `weights` and the engine's state as ShapeDtypeStructs in their shardings."""
    state = serving_program.abstract_state(engine.cfg, engine.forward_fn, engine.capacity, engine.columns,
                                           engine.block_length, engine.cache, engine.mesh, engine.scaffold)
    return engine.programs(weights, state)


def plan_serve(cfg: ModelConfig, layout: Layout, *, prompt_len: int, gen_len: int, batch: int | None = None,
               block: int | None = None, cache: str = "auto", dispatch: str | None = None,
               compile_tpu: bool = True, chip: str | None = None,
               progress: Callable[[str], None] | None = None) -> ProgramPlan:
    """Plan `clover serve` with `batch` rows (one batch bucket), prompts up to `prompt_len` tokens and up
    to `gen_len` new tokens: the `serving.Engine` of these settings checks them (ServingError for what
    the engine would refuse) and fixes its columns, cache mode and prefill widths; on a TPU layout with
    libtpu its block program for `batch` rows and its widest prefill program are AOT-compiled."""
    from clover_jax.serving.engine import Engine  # the engine module starts nothing on import

    say = progress or (lambda s: None)
    spec_chip = resolve_chip(cfg, layout, chip)
    batch = _check_request(layout, batch, prompt_len, gen_len, block)
    block = block or cfg.block_size
    mesh, method, note = _mesh(layout, compile_tpu, say)
    abstract = method == "arithmetic"
    total, per_chip, by_kind, structs = _weights(cfg, layout, mesh)
    engine = Engine(structs, cfg, block_length=block, max_prompt=prompt_len, max_tokens=gen_len,
                    batch_sizes=(batch,), cache=cache, mesh=mesh,
                    dispatch=dispatch or ("ep_gather" if abstract else None))
    fwd, mode, s, bl = engine.forward_fn, engine.cache, engine.columns, engine.block_length
    rows = engine.capacity
    cache_chip = cache_bytes_per_chip(cfg, layout, rows, s) if mode == "prefix" else 0
    passes: dict[str, PassCost] = {}
    if mode == "none":
        passes["refine"] = _pass(cfg, layout, by_kind, "refine", rows, s, s, bl, 0.0)
    else:
        one_row = cache_bytes_per_chip(cfg, layout, 1, s)
        passes["prefill"] = _pass(cfg, layout, by_kind, "prefill", 1, engine.admission.widths[-1], s, 1, one_row)
        passes["first"] = _pass(cfg, layout, by_kind, "first", rows, 2 * bl, s, bl, cache_chip)
        passes["refine"] = _pass(cfg, layout, by_kind, "refine", rows, bl, s, bl, cache_chip)

    programs = [ProgramCompile("serve block", f"the engine's block program (serving.program.advance) for {rows} "
                                              f"row{'s' if rows > 1 else ''} x {s} columns, blocks of {bl}, "
                                              f"cache {mode}, state donated")]
    if mode == "prefix":
        k = engine.admission.admit_rows[-1]
        programs.append(ProgramCompile("serve prefill", f"the engine's widest prefill program (serving.program.admit):"
                                                        f" {k} prompt{'s' if k > 1 else ''} of up to "
                                                        f"{engine.admission.widths[-1]} columns"))
    if not abstract:
        compiled = serve_programs(engine, structs)
        say(f"compiling the serving block program ({rows} rows x {s} columns) for {layout.topology}")
        programs[0].compiled = compile_jitted(*compiled["block", rows], mesh.mesh)
        if mode == "prefix" and programs[0].compiled.ok:
            widest = ("prefill", engine.admission.widths[-1], engine.admission.admit_rows[-1])
            say(f"compiling the serving prefill program ({widest[2]} x {widest[1]} columns) for {layout.topology}")
            programs[1].compiled = compile_jitted(*compiled[widest], mesh.mesh)
    g = s - -(-prompt_len // bl) * bl
    plan = ProgramPlan("serve", cfg, layout, spec_chip, fwd.dispatch if not abstract else
                       (dispatch or "chosen on the devices"), rows, prompt_len, s - g, gen_len, g, bl, mode,
                       rows if mode == "prefix" else 0, s if mode == "prefix" else 0,
                       cache_bytes(cfg, rows, s) if mode == "prefix" else 0, cache_chip, total, per_chip,
                       programs, passes, method, note, steps=g)
    plan.activations_estimate = _activations(cfg, layout, 1 if mode == "prefix" else rows,
                                             engine.admission.widths[-1] if mode == "prefix" else s, s, bl)
    return plan


def _activations(cfg: ModelConfig, layout: Layout, rows: int, window: int, kv_len: int, logits_len: int) -> float:
    """The arithmetic plan's activation estimate per chip: one layer's float32 attention scores of the
    widest pass (heads split as the layout splits them) plus its float32 logits."""
    scores = rows * cfg.n_heads * window * kv_len * 4 / shards(layout, "batch", "q_heads")
    logits = rows * logits_len * cfg.vocab_size * 4 / shards(layout, "batch", "vocab")
    return float(scores + logits)


# ---- the report --------------------------------------------------------------------------------


def _time(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


def _memory_line(c: Compiled, chip: Chip) -> str:
    m = c.memory
    line = (f"  HBM per chip (compiler): {gb(c.hbm_bytes)} of {gb(chip.hbm_bytes)} "
            f"({100 * c.hbm_bytes / chip.hbm_bytes:.0f}%) = arguments {gb(m.get('argument_size_in_bytes', 0))}"
            f" + outputs {gb(m.get('output_size_in_bytes', 0))} + temporaries {gb(m.get('temp_size_in_bytes', 0))}"
            f" - aliased {gb(m.get('alias_size_in_bytes', 0))} + code {gb(m.get('generated_code_size_in_bytes', 0))}")
    if m.get("peak_memory_in_bytes"):
        line += f"; compiler's peak_memory {gb(m['peak_memory_in_bytes'])}"
    return line + f"; compiled in {c.seconds:.1f} s"


def _pass_line(label: str, pc: PassCost, chip: Chip, cfg: ModelConfig) -> str:
    t, bound = pc.bound(chip)
    tc, tm = pc.seconds(chip)
    reach = (f" ({100 * pc.experts_frac:.0f}% of experts reached)"
             if cfg.n_experts else "")
    return (f"  {label} ({pc.rows} row{'s' if pc.rows > 1 else ''} x {pc.window} tokens against {pc.kv_len} "
            f"columns): weights {gb(pc.weight_bytes)}{reach} + cache {gb(pc.cache_bytes)} + logits "
            f"{gb(pc.logits_bytes)} read -> memory {_time(tm)}; {pc.flops:.3g} FLOPs -> compute {_time(tc)}; "
            f"{bound}: >= {_time(t)}")


def format_program_plan(plan: ProgramPlan) -> str:
    """The report of a `plan_generate` / `plan_serve` plan as text; its last line is the verdict."""
    c, lay, chip = plan.cfg, plan.layout, plan.chip
    lines = [
        *header_lines(f"plan --{plan.kind}", c, lay, chip, plan.dispatch, plan.weights_total, plan.weights_per_chip),
        f"request: {plan.rows} row{'s' if plan.rows > 1 else ''}, prompt {plan.prompt_len} tokens "
        f"({plan.prompt_cols} columns), {plan.gen_len} generated ({plan.gen_cols} columns), blocks of {plan.block}",
    ]
    if plan.cache_columns:
        state = plan.cache_rows * linear_state_bytes(c)
        lines.append(f"cache ({plan.cache}): {gb(plan.cache_total)} for {plan.cache_rows} "
                     f"row{'s' if plan.cache_rows > 1 else ''} x {plan.cache_columns} "
                     f"columns (attention K/V {gb(plan.cache_total - state)}"
                     + (f" + Gated DeltaNet state {gb(state)}" if c.is_hybrid else "")
                     + f"), {gb(plan.cache_per_chip)} per chip")
    else:
        lines.append(f"cache: none (every pass runs all {plan.prompt_cols + plan.gen_cols} columns)")
    lines.append(f"method: {plan.method}" + (f" ({plan.note})" if plan.note else ""))
    for p in plan.programs:
        lines.append(f"program '{p.name}': {p.what}")
        cp = p.compiled
        if cp is None:
            lines.append("  not compiled" + (": an earlier program already does not fit" if plan.compiled else ""))
        elif not cp.ok:
            lines.append(f"  DOES NOT FIT: the TPU compiler refused it after {cp.seconds:.1f} s: {cp.error}")
        else:
            lines.append(_memory_line(cp, chip))
    lines.append("roofline (analytic, per chip; published peak FLOP/s and HBM bandwidth, interconnect not counted):")
    labels = {"refine": "refinement pass", "first": "first pass of a block", "prefill": "prefill, once a request"}
    for key in ("refine", "first", "prefill"):
        if key in plan.passes:
            lines.append(_pass_line(labels[key], plan.passes[key], chip, c))
    pre, decode = plan.request_seconds()
    tps = plan.tokens_per_s()
    lines.append(f"  decode: ~{tps:.1f} tokens/s over {plan.rows} row{'s' if plan.rows > 1 else ''} "
                 f"({tps / plan.rows:.1f} per row) at one token per pass per row ({plan.steps} passes a request "
                 "after the prefill; fewer steps or --threshold commit more tokens per pass)")
    lines.append(f"  one request: prefill {_time(pre)} + decode {_time(decode)} = {_time(pre + decode)}")
    peak = plan.peak_bytes
    if not plan.compiled:
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        lines.append(f"verdict: {verdict} by arithmetic: ~{gb(peak or 0)} per chip (weights + cache + the widest "
                     f"pass's attention scores and logits) vs {gb(plan.usable_hbm)} usable")
    elif plan.fits:
        lines.append(f"verdict: FITS: the TPU compiler placed the {plan.kind} program"
                     f"{'s' if len(plan.programs) > 1 else ''}, at most {gb(peak or 0)} of "
                     f"{gb(chip.hbm_bytes)} per chip")
    elif peak is not None:
        lines.append(f"verdict: DOES NOT FIT on {lay.name}: the compiled program needs {gb(peak)} of "
                     f"{gb(chip.hbm_bytes)} per chip")
    else:
        lines.append(f"verdict: DOES NOT FIT on {lay.name}: the TPU compiler ran out of HBM")
    return "\n".join(lines)
