"""`clover plan`: AOT compile for a TPU topology (needs libtpu, no TPU), GPU plans by arithmetic."""

import re

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


# ---- --generate / --serve: the whole programs ---------------------------------------------------

_MB = r"([0-9.]+) MB"


def _figures(text, label):
    """The MB figures of the first 'HBM per chip (compiler)' line after `label`."""
    line = next(ln for ln in text[text.index(label):].splitlines() if "HBM per chip (compiler)" in ln)
    names = ("total", "arguments", "outputs", "temporaries", "aliased", "code")
    pattern = (rf"HBM per chip \(compiler\): {_MB} of .*= arguments {_MB} \+ outputs {_MB} \+ temporaries {_MB}"
               rf" - aliased {_MB} \+ code {_MB}")
    return dict(zip(names, map(float, re.search(pattern, line).groups()), strict=True))


def _hybrid_cache_bytes(rows, columns):
    """test-clover-hybrid's cache, counted by hand: 1 attention layer's float32 K/V (2 KV heads x 16), and
    3 Gated DeltaNet layers' state (4 value heads x 16 x 8, float32) and conv tail (2 columns x 96 channels)."""
    kv = 2 * 1 * rows * columns * 2 * 16 * 4
    state = 3 * rows * (4 * 16 * 8 * 4 + 2 * (2 * 2 * 16 + 4 * 8) * 4)
    return kv + state


def _plan_program(tmp_path, capsys, mode, prompt_len, gen_len, batch):
    """`clover plan --MODE` of test-clover-hybrid on the small TPU layout: (exit status, printed text)."""
    from clover_jax import cli

    _tpu_layout(tmp_path)
    argv = ["plan", "--config", "test-clover-hybrid", "--mesh", str(tmp_path / "small-tpu.toml"), f"--{mode}",
            "--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--batch", str(batch)]
    status = cli.main(argv)
    return status, capsys.readouterr().out


@needs_libtpu
def test_plan_generate_compiles_the_whole_sampler_program(tmp_path, capsys):
    status, text = _plan_program(tmp_path, capsys, "generate", 60, 32, 2)
    assert status == 0
    # the sampler's own buckets: 60 prompt tokens -> 64 columns (blocks of 8, a power of two of them)
    assert "request: 2 rows, prompt 60 tokens (64 columns), 32 generated (32 columns), blocks of 8" in text
    assert "sampler.generate.PROGRAM_JIT" in text and "cache prefix (auto)" in text
    cache = _hybrid_cache_bytes(2, 64 + 32)
    assert f"cache (prefix): {cache / 1e6:.2f} MB for 2 rows x 96 columns" in text
    m = _figures(text, "program 'generate'")
    weights_chip = float(re.search(rf"; {_MB} per chip\n", text).group(1))
    assert m["arguments"] >= weights_chip > 0  # the weights are arguments of the program
    assert m["temporaries"] >= cache / 1e6  # the cache is allocated inside it
    assert m["total"] == pytest.approx(m["arguments"] + m["outputs"] + m["temporaries"] - m["aliased"] + m["code"],
                                       abs=0.03)
    assert re.search(r"refinement pass \(2 rows x 8 tokens against 96 columns\).*HBM-bound", text)
    assert "decode: ~" in text and "verdict: FITS" in text


@needs_libtpu
def test_plan_serve_compiles_the_block_and_prefill_programs(tmp_path, capsys):
    status, text = _plan_program(tmp_path, capsys, "serve", 40, 16, 2)
    assert status == 0
    # the engine's columns: 40 -> 40 prompt columns + 16 generated, blocks of 8; its widest prefill: 48 columns
    assert "engine's block program (serving.program.advance) for 2 rows x 56 columns" in text
    assert "2 prompts of up to 48 columns" in text  # admitted together (--prefill-rows 4, at most the 2 rows)
    cache = _hybrid_cache_bytes(2, 56)
    assert f"cache (prefix): {cache / 1e6:.2f} MB for 2 rows x 56 columns" in text
    block, prefill = _figures(text, "program 'serve block'"), _figures(text, "program 'serve prefill'")
    for m in (block, prefill):
        # the state (with its cache) is an argument, donated: aliased to the output
        assert m["arguments"] >= cache / 1e6 and m["aliased"] >= cache / 1e6 - 0.01
    assert "verdict: FITS: the TPU compiler placed the serve programs" in text


@needs_libtpu
def test_plan_generate_that_does_not_fit_exits_3(tmp_path, capsys):
    # 16384 rows: the prefill's float32 attention scores alone are ~19 GB per 16 GB chip
    status, text = _plan_program(tmp_path, capsys, "generate", 448, 64, 16384)
    assert status == 3
    assert "DOES NOT FIT" in text and "verdict: DOES NOT FIT on small-tpu" in text


def test_plan_generate_rejects_bad_requests_with_exit_2(capsys):
    from clover_jax import cli

    base = ["plan", "--config", "test-clover-hybrid", "--mesh", "gpu-8xh100"]
    assert cli.main([*base, "--generate", "--prompt-len", "500", "--gen-len", "32"]) == 2  # > max_seq_len 512
    assert "max_seq_len" in capsys.readouterr().err
    assert cli.main([*base, "--prompt-len", "64"]) == 2  # a program size without --generate / --serve
    assert "add --generate or --serve" in capsys.readouterr().err
    assert cli.main([*base, "--serve", "--gen-len", "0"]) == 2
    assert "--gen-len must be a positive integer" in capsys.readouterr().err


def test_plan_generate_by_arithmetic_on_gpu():
    cfg = get_config("clover-35b-a3b")
    plan = clover_plan.plan_generate(cfg, layouts.load_layout("gpu-8xh100"), prompt_len=4096, gen_len=128, batch=1)
    assert plan.method == "arithmetic" and plan.fits and plan.cache == "prefix"
    assert (plan.prompt_cols, plan.gen_cols, plan.cache_columns) == (4096, 128, 4224)
    # a cached refinement pass of one 32-token block is HBM-bound; it reads less than all weights (~64% of experts)
    refine = plan.passes["refine"]
    assert refine.bound(plan.chip)[1] == "HBM-bound" and refine.weight_bytes < plan.weights_per_chip
    assert plan.tokens_per_s() > 0
