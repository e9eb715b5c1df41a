"""`clover plan`: AOT compile for a TPU topology (needs libtpu, no TPU), GPU plans by arithmetic."""

import numpy as np
import pytest

from clover_jax import plan as clover_plan
from clover_jax.config import get_config
from clover_jax.mesh import layouts
from clover_jax.model import params

needs_libtpu = pytest.mark.skipif(not clover_plan.libtpu_available(),
                                  reason="libtpu is not installed (pip install 'jax[tpu]==0.10.2' to plan for TPUs)")


def _tpu_layout(tmp_path, shape=(1, 2, 2), topology="v5e:2x2"):
    path = tmp_path / "small-tpu.toml"
    path.write_text(f'platform = "tpu"\nchip = "v5e"\ntopology = "{topology}"\n'
                    f'[mesh]\nshape = {list(shape)}\naxes = ["data", "expert", "tensor"]\n')
    return layouts.load_layout(str(path))


@needs_libtpu
def test_plan_compiles_a_small_config_for_a_tpu_topology(tmp_path):
    # conftest sets JAX_PLATFORMS=cpu: the planner must still reach the TPU compiler through libtpu.
    cfg = get_config("test-clover")
    lay = _tpu_layout(tmp_path)
    plan = clover_plan.make_plan(cfg, lay, seq_len=64, block=8)
    assert plan.method.startswith("compiled for TPU v5") and plan.fits
    for r in plan.passes:
        cp = r.compiled
        assert cp is not None and cp.ok
        # the compiler's per-chip arguments hold at least this chip's share of the weights
        assert cp.memory["argument_size_in_bytes"] >= plan.weights_per_chip
        assert 0 < cp.hbm_bytes < clover_plan.CHIPS["v5e"].hbm_bytes
        # XLA counts the scan body once: its FLOPs match the analytic count taken the same way
        once = clover_plan.analytic_flops_per_chip(cfg, r.shape, lay, scan_once=True)
        assert 0.8 < cp.flops / once < 1.6, (r.shape.name, cp.flops, once)
    text = clover_plan.format_plan(plan)
    assert "HBM per chip (compiler)" in text and "verdict: FITS" in text


@needs_libtpu
def test_compiler_out_of_memory_is_reported_as_does_not_fit(tmp_path):
    # 40M-token vocabulary replicated (no vocab rule): 20 GB of float32 embeddings per 16 GB chip.
    cfg = get_config("test-clover", vocab_size=40_000_000, max_seq_len=64)
    plan = clover_plan.make_plan(cfg, _tpu_layout(tmp_path), seq_len=64, block=8)
    assert not plan.fits
    first = plan.passes[0].compiled
    assert first is not None and not first.ok and "Ran out of memory" in first.error
    assert "DOES NOT FIT" in clover_plan.format_plan(plan)


def test_gpu_plans_by_arithmetic():
    cfg = get_config("clover-35b-a3b")
    plan = clover_plan.make_plan(cfg, layouts.load_layout("gpu-8xh100"))
    assert plan.method == "arithmetic" and plan.fits
    # independent count: experts and vocab split 8 ways (bf16), everything else replicated
    specs = params.named_leaves(params.abstract(cfg))
    split = sum(s.size for _, s in specs if "experts" in s.axes or "vocab" in s.axes)
    rest = sum(s.size * np.dtype(s.dtype).itemsize for _, s in specs
               if "experts" not in s.axes and "vocab" not in s.axes)
    assert plan.weights_per_chip == pytest.approx(split * 2 / 8 + rest, rel=1e-6)
    # analytic FLOPs of the cached pass: ~2 x active params x tokens, plus the 10 attention layers over the
    # cache and the 30 Gated DeltaNet layers' state reads and writes (6 dk dv per value head and token)
    counts = params.count_params(cfg)
    matmul = 2 * (counts.active - cfg.vocab_size * cfg.d_model) * 32  # the embedding lookup is not a matmul
    attention = 10 * 4 * 16 * 256 * 4096 * 32
    delta_rule = 30 * 6 * 32 * 128 * 128 * 32
    assert plan.passes[0].flops_total == pytest.approx(matmul + attention + delta_rule, rel=0.02)
    # the cache: K/V of the 10 attention layers, plus a fixed state per Gated DeltaNet layer
    kv = 2 * 10 * 4096 * 2 * 256 * 2
    state = 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    assert plan.cache_per_chip == kv + state and "Gated DeltaNet state" in clover_plan.format_plan(plan)
    one = layouts.Layout("one-h100", (1, 1, 1), ("data", "expert", "tensor"), platform="gpu", chip="h100")
    small = clover_plan.make_plan(cfg, one)
    assert not small.fits and "DOES NOT FIT by arithmetic" in clover_plan.format_plan(small)


def test_plan_rejects_bad_requests_before_compiling():
    cfg = get_config("test-clover")
    with pytest.raises(clover_plan.PlanError, match="multiple of the block length"):
        clover_plan.make_plan(cfg, layouts.load_layout("gpu-8xh100"), seq_len=50, block=8)
    with pytest.raises(clover_plan.PlanError, match="chip 'cpu' is not in the plan table"):
        clover_plan.make_plan(cfg, layouts.load_layout("cpu-8"), seq_len=64)
    with pytest.raises(clover_plan.PlanError, match="unknown MoE dispatch 'nope'"):
        clover_plan.make_plan(cfg, layouts.load_layout("gpu-8xh100"), seq_len=64, dispatch="nope")
