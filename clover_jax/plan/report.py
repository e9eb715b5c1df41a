"""Will a model fit a slice, and what does one denoising pass cost? Answered without the hardware.

TPU layouts (with `libtpu` installed, on any host, even CPU-only): build the slice's topology with
`jax.experimental.topologies`, AOT-compile two passes for it with the weights as ShapeDtypeStructs
in their shardings, and read the TPU compiler's own `memory_analysis()` (per-chip HBM: the figure
to trust; a compiler "Ran out of memory" is the honest "does not fit") and `cost_analysis()`:

- `cached block`: one refinement step of the sampler with a prefix cache: forward over one block
  of W tokens that writes its K/V into a cache of S columns and attends to all of them;
- `full canvas`:  the cache-free step: forward over the whole canvas of S tokens, logits for one block.

FLOPs and bytes are also counted by hand (`analytic_*`): XLA's cost analysis counts a `lax.scan`
body once rather than once per layer, and ragged/collective ops approximately, so the roofline is
printed from the analytic count whenever the two disagree. GPU (and CPU) layouts get the same
plan by arithmetic alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jax.sharding import AbstractMesh

from clover_jax.config import ModelConfig
from clover_jax.errors import PlanError
from clover_jax.mesh.layouts import Layout
from clover_jax.mesh.rules import logical_to_spec
from clover_jax.model import params
from clover_jax.model.moe import get_dispatch
from clover_jax.plan.aot import Compiled, compile_pass, libtpu_available, topology_mesh
from clover_jax.plan.arithmetic import (
    CHIPS,
    GPU_USABLE_FRACTION,
    Chip,
    PassShape,
    analytic_bytes_per_chip,
    analytic_flops,
    analytic_flops_per_chip,
    cache_bytes,
    experts_touched,
    linear_state_bytes,
    mesh_factor,
    passes,
    shards,
    weight_bytes_per_chip,
)


@dataclass
class PassReport:
    """One pass's analytic FLOPs (all chips, busiest chip) and bytes per chip, and its compile result if any."""

    shape: PassShape
    flops_total: float
    flops_per_chip: float
    bytes_per_chip: float
    compiled: Compiled | None = None

    def roofline_s(self, chip: Chip, use_compiler: bool = False) -> tuple[float, float]:
        """(compute s, memory s) of the pass on `chip`: analytic counts, or the compiler's with
        `use_compiler` when it reported FLOPs."""
        if use_compiler and self.compiled and self.compiled.flops:
            return self.compiled.flops / chip.peak_flops, (self.compiled.bytes_accessed or 0) / chip.hbm_bw
        return self.flops_per_chip / chip.peak_flops, self.bytes_per_chip / chip.hbm_bw


@dataclass
class Plan:
    """A config planned on a layout (`make_plan`): weight and cache bytes per chip, pass reports, method."""

    cfg: ModelConfig
    layout: Layout
    chip: Chip
    dispatch: str
    weights_total: int
    weights_per_chip: int
    cache_per_chip: int
    passes: list[PassReport]
    method: str  # "compiled for TPU v5 lite" | "arithmetic"
    note: str = ""

    @property
    def fits(self) -> bool:
        """Arithmetic plans: `estimate_per_chip` within `usable_hbm`; compiled plans: every pass compiled within
        the chip's HBM."""
        if self.method == "arithmetic":
            return self.estimate_per_chip <= self.usable_hbm
        return all(p.compiled is not None and p.compiled.ok and p.compiled.hbm_bytes <= self.chip.hbm_bytes
                   for p in self.passes)

    @property
    def usable_hbm(self) -> float:
        """The chip's HBM bytes, times `GPU_USABLE_FRACTION` on GPU layouts."""
        return self.chip.hbm_bytes * (GPU_USABLE_FRACTION if self.layout.platform == "gpu" else 1.0)

    @property
    def estimate_per_chip(self) -> float:
        """Arithmetic HBM per chip: weights + KV cache + the larger pass's main activations."""
        act = 0.0
        for p in self.passes:
            s = p.shape
            scores = s.batch * self.cfg.n_heads * s.window * s.kv_len * 4  # float32 attention scores
            logits = s.batch * s.logits_len * self.cfg.vocab_size * 4
            act = max(act, (scores + logits) / max(1, self.layout.n_devices // self.layout.shape[0]))
        return self.weights_per_chip + self.cache_per_chip + act


def resolve_chip(cfg: ModelConfig, layout: Layout, chip: str | None = None) -> Chip:
    """The plan table's figures for `chip` (default the layout's); PlanError when the table has no such
    chip or the config's fp8 weights need matrix units the chip lacks."""
    chip_key = chip or layout.chip
    if chip_key not in CHIPS:
        raise PlanError(f"layout {layout.name!r}: chip {chip_key!r} is not in the plan table; "
                        f"pass --chip one of {', '.join(CHIPS)}")
    spec_chip = CHIPS[chip_key]
    if cfg.quantization == "fp8" and not spec_chip.fp8:
        raise PlanError(f"fp8 weights need fp8 matrix units, which {spec_chip.name} does not have; "
                        "plan int8 weights instead (--quantize int8)")
    return spec_chip


def make_plan(cfg: ModelConfig, layout: Layout, *, batch: int | None = None, seq_len: int = 4096,
              block: int | None = None, dispatch: str = "ep_gather", compile_tpu: bool = True,
              chip: str | None = None, progress: Callable[[str], None] | None = None) -> Plan:
    """Check the request, then plan (compile for TPU layouts when possible, else arithmetic)."""
    say = progress or (lambda s: None)
    spec_chip = resolve_chip(cfg, layout, chip)
    block = block or cfg.block_size
    data = shards(layout, "batch")
    batch = batch or data
    if batch % data:
        raise PlanError(f"batch {batch} must be a multiple of the data-parallel size {data} of {layout.name!r}")
    if seq_len % block or seq_len < block:
        raise PlanError(f"sequence length {seq_len} must be a positive multiple of the block length {block}")
    if seq_len > cfg.max_seq_len:
        raise PlanError(f"sequence length {seq_len} exceeds the config's max_seq_len {cfg.max_seq_len}")
    try:
        get_dispatch(dispatch)
    except ValueError as e:
        raise PlanError(str(e)) from e
    # Divisibility first, on an abstract mesh: a bad rule is reported before any compile.
    abstract_mesh = AbstractMesh(layout.shape, layout.axes)
    shardings = params.weight_shardings(cfg, abstract_mesh, layout.rules)
    mesh_shape = dict(zip(layout.axes, layout.shape, strict=True))
    total, per_chip = weight_bytes_per_chip(cfg, shardings, mesh_shape)
    cache_spec = logical_to_spec(("layers", "batch", "seq", "kv_heads", "head_dim"), layout.rules,
                                          abstract_mesh)
    cache_shards = mesh_factor(cache_spec, mesh_shape)
    cache_chip = cache_bytes(cfg, batch, seq_len) // cache_shards

    reports = []
    for ps in passes(cfg, batch, seq_len, block):
        ft = analytic_flops(cfg, ps)
        reports.append(PassReport(ps, ft, analytic_flops_per_chip(cfg, ps, layout),
                                  analytic_bytes_per_chip(cfg, ps, per_chip, cache_shards)))
    method, note = "arithmetic", ""
    if layout.platform == "tpu" and compile_tpu:
        if not libtpu_available():
            note = "libtpu is not installed: arithmetic only (pip install 'jax[tpu]' to compile for the slice)"
        else:
            say(f"building topology {layout.topology}")
            mesh = topology_mesh(layout)
            structs = params.shape_structs(cfg, params.weight_shardings(cfg, mesh, layout.rules))
            for r in reports:
                say(f"compiling the {r.shape.name} pass for {layout.topology}")
                r.compiled = compile_pass(cfg, r.shape, mesh, layout.rules, structs, dispatch)
                if not r.compiled.ok:
                    break
            kind = str(getattr(mesh.devices.flat[0], "device_kind", "TPU"))
            method = f"compiled for {kind}, topology {layout.topology}"
    elif layout.platform == "tpu":
        note = "compile skipped by --no-compile"
    return Plan(cfg, layout, spec_chip, dispatch, total, per_chip, cache_chip, reports, method, note)


CONTEXTS = (4096, 32_768, 131_072)  # the context lengths whose cache size the report prints


def gb(n: float) -> str:
    """Bytes as GB (MB below 0.1 GB), as every plan report prints them."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _gib(n: float) -> str:
    """The suffix ' (16 GiB)' when `n` is a whole number of GiB (TPU HBM is listed so), else ''."""
    return f" ({n / 2**30:.0f} GiB)" if n % 2**30 == 0 else ""


def header_lines(title: str, c: ModelConfig, lay: Layout, chip: Chip, dispatch: str, weights_total: float,
                 weights_per_chip: float, note: str = "") -> list[str]:
    """The first lines of a plan report: `title` with the model, layout, mesh and dispatch; the chip's published
    figures; the weights, in all and per chip (`note` after it)."""
    counts = params.count_params(c)
    mesh = " x ".join(f"{a}={n}" for a, n in zip(lay.axes, lay.shape, strict=True))
    return [
        f"{title}: {c.name} on {lay.name} ({lay.n_devices} x {chip.name}"
        + (f", topology {lay.topology}" if lay.topology else "") + f"; mesh {mesh}; MoE dispatch {dispatch})",
        f"chip: {gb(chip.hbm_bytes)}{_gib(chip.hbm_bytes)} HBM, {chip.peak_flops / 1e12:.0f} TFLOP/s bf16, "
        f"{chip.hbm_bw / 1e9:.0f} GB/s (published)",
        f"weights: {counts.total / 1e9:.2f}B params ({counts.active / 1e9:.2f}B active), {gb(weights_total)} "
        f"in {_weights_kind(c)}; {gb(weights_per_chip)} per chip{note}",
    ]


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


def _weights_kind(c: ModelConfig) -> str:
    if c.quantization == "none":
        return c.dtype
    return (f"{c.quantization} matmul weights with float32 per-channel scales, embeddings and norms as stored "
            f"({c.dtype} / float32)")


def format_plan(plan: Plan) -> str:
    """The report of `plan` as text: chip, weights, cache, per-pass memory, FLOPs and roofline, verdict."""
    c, lay, chip = plan.cfg, plan.layout, plan.chip
    lines = [
        *header_lines("plan", c, lay, chip, plan.dispatch, plan.weights_total, plan.weights_per_chip,
                      " (arithmetic, from the shardings)"),
        f"KV cache: {gb(plan.cache_per_chip)} per chip for batch {plan.passes[0].shape.batch} x "
        f"{plan.passes[0].shape.kv_len} tokens",
        "cache per sequence: " + ", ".join(f"{gb(cache_bytes(c, 1, n))} at {n // 1024}K" for n in CONTEXTS
                                          if n <= c.max_seq_len)
        + (f" (of which {gb(linear_state_bytes(c))} Gated DeltaNet state, the same at any length)"
           if c.is_hybrid else ""),
        f"method: {plan.method}" + (f" ({plan.note})" if plan.note else ""),
    ]
    for r in plan.passes:
        s = r.shape
        what = (f"one block of {s.window} tokens against a {s.kv_len}-column KV cache" if s.cached
                else f"{s.window} tokens, no cache, logits for one block of {s.logits_len}")
        lines.append(f"pass '{s.name}' (batch {s.batch}: {what})")
        cp = r.compiled
        if cp is None and plan.method.startswith("compiled"):
            lines.append("  not compiled: an earlier pass already does not fit")
            continue
        if cp is not None and not cp.ok:
            lines.append(f"  DOES NOT FIT: the TPU compiler refused it after {cp.seconds:.1f} s: {cp.error}")
            continue
        if cp is not None:
            m = cp.memory
            lines.append(
                f"  HBM per chip (compiler): {gb(cp.hbm_bytes)} of {gb(chip.hbm_bytes)} "
                f"({100 * cp.hbm_bytes / chip.hbm_bytes:.0f}%) = arguments {gb(m.get('argument_size_in_bytes', 0))}"
                f" + outputs {gb(m.get('output_size_in_bytes', 0))}"
                f" + temporaries {gb(m.get('temp_size_in_bytes', 0))}"
                f" - aliased {gb(m.get('alias_size_in_bytes', 0))} + code "
                f"{gb(m.get('generated_code_size_in_bytes', 0))}; compiled in {cp.seconds:.1f} s")
            once = analytic_flops_per_chip(c, s, lay, scan_once=True)
            lines.append(f"  FLOPs per chip: analytic {r.flops_per_chip:.3g} (all chips {r.flops_total:.3g}); "
                         f"compiler {cp.flops or 0:.3g} = {(cp.flops or 0) / once:.2f}x the analytic count with "
                         "each layer stack counted once, as XLA counts a scan body")
            lines.append(f"  bytes per chip: analytic {r.bytes_per_chip:.3g} (weights + cache, read once); "
                         f"compiler {cp.bytes_accessed or 0:.3g}")
        else:
            lines.append(f"  FLOPs: {r.flops_total:.3g} in all, {r.flops_per_chip:.3g} on the busiest chip; "
                         f"bytes per chip {r.bytes_per_chip:.3g} (weights + cache, read once)")
        tc, tm = r.roofline_s(chip)
        bound = "HBM-bound" if tm >= tc else "compute-bound"
        line = f"  roofline (analytic): compute {_ms(tc)}, memory {_ms(tm)} -> >= {_ms(max(tc, tm))} per pass, {bound}"
        if cp is not None and cp.flops:
            cc, cm = r.roofline_s(chip, use_compiler=True)
            line += f"; from the compiler's counts {_ms(max(cc, cm))}"
        lines.append(line)
    if any(r.compiled is not None for r in plan.passes):
        lines.append("  (trust: HBM from the compiler; FLOPs/bytes from the analytic count - XLA's cost analysis "
                     "counts a lax.scan body once, not once per layer, and collectives/ragged ops roughly. "
                     "Interconnect time is not in the roofline.)")
    touched = experts_touched(c, plan.passes[0].shape.batch * plan.passes[0].shape.window)
    if c.n_experts:
        lines.append(f"  a {plan.passes[0].shape.window}-token block routes to ~{100 * touched:.0f}% of the experts"
                     + (", so the cached pass reads most expert weights: HBM bandwidth, not FLOPs, sets its speed"
                        if touched > 0.5 else ""))
    if plan.method == "arithmetic":
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        lines.append(f"verdict: {verdict} by arithmetic: ~{gb(plan.estimate_per_chip)} per chip (weights + cache + "
                     f"main activations) vs {gb(plan.usable_hbm)} usable"
                     + (f" ({int(GPU_USABLE_FRACTION * 100)}% of HBM: JAX's default GPU preallocation)"
                        if lay.platform == "gpu" else ""))
    elif plan.fits:
        worst = max(r.compiled.hbm_bytes for r in plan.passes if r.compiled)
        lines.append(f"verdict: FITS: the TPU compiler placed both passes, at most {gb(worst)} of "
                     f"{gb(chip.hbm_bytes)} per chip")
    else:
        lines.append(f"verdict: DOES NOT FIT on {lay.name}: the TPU compiler ran out of HBM")
    return "\n".join(lines)
