"""`clover convert --quantize int8|fp8` and `--dequantize`: quantized native checkpoints streamed from HF or native
float ones (bit for bit what `params.quantize_weights` gives), their export back to HF as float, and the refusals."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import checkpoint, model
from clover_jax.checkpoint import LazyLeaf
from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.convert import FAMILIES, ConversionError, convert, pipeline
from clover_jax.convert import quantize as cq
from clover_jax.model import params, quant
from tests.test_convert import no_leftovers, noisy_weights, read_dir, synthetic_tensors, write_hf

PRESETS = {"qwen3_moe": "test-qwen3-moe", "qwen3_5_moe": "test-qwen3-5-moe"}
whole = jax.jit(quant.quantize, static_argnums=(1, 2))  # a whole tensor at once


def assert_same_bits(a: dict, b: dict) -> None:
    """Two flat {name: array} dicts hold the same names, dtypes and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=name)


def hf_source(tmp_path, family: str):
    cfg = get_config(PRESETS[family], dtype="bfloat16")
    hf_cfg = FAMILIES[family].config_to_hf(cfg)
    write_hf(tmp_path / "hf", synthetic_tensors(cfg, family), hf_cfg)
    return cfg, hf_cfg, str(tmp_path / "hf")


def test_hf_import_int8_is_bit_exact_in_memory_quantization(tmp_path, monkeypatch):
    cfg, hf_cfg, hf = hf_source(tmp_path, "qwen3_moe")
    convert(hf, str(tmp_path / "float"), progress=False, mask_token_id=cfg.mask_token_id)
    # embed / lm_head in row blocks of 96, routed experts 3 at a time (the last ones short): chunk by chunk
    monkeypatch.setattr(pipeline, "ROW_BLOCK_BYTES", 12288)
    out = convert(hf, str(tmp_path / "q"), progress=False, mask_token_id=cfg.mask_token_id, quantize="int8")
    assert out == str(tmp_path / "q")
    fcfg, fw = checkpoint.load_model(str(tmp_path / "float"))
    qcfg, qw = checkpoint.load_model(out)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"] == "int8"
    assert qcfg == fcfg.replace(quantization="int8")
    assert params.quantize_weights(fcfg, fw, "int8")[0] == qcfg
    want = jax.jit(lambda w: params.quantize_weights(fcfg, w, "int8")[1])(fw)  # one compile, not one per op
    assert_same_bits(checkpoint.flatten_weights(qw), checkpoint.flatten_weights(want))
    eager = quant.quantize(fw.lm_head, (0,), "int8")  # and op by op, as it runs outside jit
    assert_same_bits({"q": qw.lm_head.qvalue, "s": qw.lm_head.scale}, {"q": eager.qvalue, "s": eager.scale})
    assert qw.lm_head.qvalue.dtype == jnp.int8 and qw.lm_head.scale.shape == (1, cfg.vocab_size)
    # the import record and tokenizer file come along, as for a float import
    record = json.loads((tmp_path / "q" / pipeline.SOURCE_FILE).read_text())
    assert record["config"] == hf_cfg
    assert (tmp_path / "q" / "tokenizer_config.json").exists()


def test_native_float_to_native_fp8_copies_the_rest(tmp_path):
    """The hybrid layout (Gated DeltaNet layers, Clover's block-diffusion tensors) from a native float checkpoint."""
    cfg = get_config("test-clover-hybrid", dtype="bfloat16")
    w = noisy_weights(cfg)
    card = "# tiny\n"
    src = checkpoint.save_model(str(tmp_path / "float"), cfg, w, extra_files={"MODEL_CARD.md": card,
                                                                              "generation_config.json": "{}"})
    out = convert(src, str(tmp_path / "fp8"), progress=False, quantize="fp8")
    qcfg, qw = checkpoint.load_model(out)
    assert qcfg == cfg.replace(quantization="fp8")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization"] == "fp8"
    want = jax.jit(lambda w: params.quantize_weights(cfg, w, "fp8")[1])(w)  # one compile, not one per op
    assert_same_bits(checkpoint.flatten_weights(qw), checkpoint.flatten_weights(want))
    assert qw.linear_layers.attn.qkv.qvalue.dtype == jnp.float8_e4m3fn
    assert (tmp_path / "fp8" / "MODEL_CARD.md").read_text() == card
    assert (tmp_path / "fp8" / "generation_config.json").read_text() == "{}"
    no_leftovers(tmp_path, {"float", "fp8"})


@pytest.mark.parametrize(("order", "cache_bytes", "reads_per_chunk"), [
    ("qvalue-first", cq.SCALE_CACHE_BYTES, {1}),  # as save_streaming writes them: each float chunk read once
    ("qvalue-first", 0, {2}),  # scales that do not fit the cache: read and quantized again, the same values
    ("scale-first", cq.SCALE_CACHE_BYTES, {1, 2}),  # the other order: only the last qvalue chunk is kept
])
def test_quantized_leaves_read_each_float_chunk_once_while_it_can(monkeypatch, order, cache_bytes, reads_per_chunk):
    monkeypatch.setattr(cq, "SCALE_CACHE_BYTES", cache_bytes)
    cfg = get_config("test-qwen3-moe", dtype="bfloat16")
    w = checkpoint.flatten_weights(noisy_weights(cfg))
    specs = checkpoint.expected_leaves(cfg)
    reads: dict[tuple, int] = {}

    def leaf(name, spec):
        a = np.asarray(w[name])

        def read(idx):
            key = (name, tuple((s.start, s.stop) for s in idx))
            reads[key] = reads.get(key, 0) + 1
            return a[idx]
        chunk = cq.stream_chunk(spec.shape, a.itemsize, spec.contract, "layers." in name, 1500)
        return LazyLeaf(spec.shape, a.dtype, read, chunk)

    leaves = {n: leaf(n, s) for n, s in specs.items()}
    assert leaves["moe_layers.mlp.gate"].chunk_shape == (1, 1, 64, 11)  # experts and their columns split
    assert leaves["lm_head"].chunk_shape == (64, 11)  # the whole contracted axis, a few vocabulary columns
    assert leaves["embed"].chunk_shape == (11, 64)
    qleaves = cq.quantized_leaves(specs, leaves, "int8")
    assert sorted(qleaves) == sorted(checkpoint.expected_leaves(cfg.replace(quantization="int8")))
    got = {}
    for name, q in qleaves.items():
        got[name] = np.zeros(q.shape, q.dtype)
    for base in ("lm_head", "moe_layers.mlp.gate", "moe_layers.attn.o"):
        parts = [f"{base}.qvalue", f"{base}.scale"]
        for name in parts if order == "qvalue-first" else parts[::-1]:
            for idx in qleaves[name].blocks():
                got[name][idx] = qleaves[name].read(idx)
        want = whole(w[base], tuple(specs[base].contract), "int8")
        assert_same_bits({"q": got[parts[0]], "s": got[parts[1]]}, {"q": want.qvalue, "s": want.scale})
        assert {v for (n, _), v in reads.items() if n == base} == reads_per_chunk, base


def test_chunks_that_split_a_contracted_axis_are_a_bug(tmp_path):
    spec = checkpoint.expected_leaves(get_config("test-qwen3-moe"))["lm_head"]
    leaf = LazyLeaf(spec.shape, np.float32, lambda idx: None, (8, spec.shape[1]))
    with pytest.raises(ConversionError, match="internal: chunks"):
        cq.quantized_leaves({"lm_head": spec}, {"lm_head": leaf}, "int8")


@pytest.fixture(scope="module")
def quantized_native(tmp_path_factory):
    """(float config, float weights, a native int8 checkpoint quantized from a native float one); read only."""
    work = tmp_path_factory.mktemp("quantized")
    cfg = get_config("test-qwen3-moe", dtype="float32")
    w = noisy_weights(cfg, scale=0.2)
    src = checkpoint.save_model(str(work / "float"), cfg, w)
    return cfg, w, convert(src, str(work / "int8"), progress=False, quantize="int8")


def test_quantizing_a_quantized_checkpoint_is_refused_before_anything(tmp_path, quantized_native, monkeypatch,
                                                                      capsys):
    *_, q = quantized_native

    def no_reading(*a, **k):
        raise AssertionError("read a weight before refusing")
    monkeypatch.setattr(checkpoint.WeightReader, "read", no_reading)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConversionError, match=r"is already quantized \(int8\)"):
        convert(q, str(out / "dst"), progress=False, quantize="fp8")
    no_leftovers(out)
    capsys.readouterr()
    assert main(["convert", q, str(out / "dst"), "--quantize", "int8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clover convert: error: ") and "already quantized (int8)" in err
    assert err.count("\n") == 1
    no_leftovers(out)


def test_export_of_a_quantized_checkpoint_needs_dequantize(tmp_path, quantized_native, capsys, monkeypatch):
    cfg, _, q = quantized_native
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConversionError, match="holds int8 weights; pass --dequantize to export them as float32"):
        convert(q, str(out / "hf"), progress=False)
    assert main(["convert", q, str(out / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dequantize" in err
    no_leftovers(out)

    # --dequantize: the safetensors of the float model `params.dequantize_weights` gives, byte for byte
    monkeypatch.setattr(pipeline, "ROW_BLOCK_BYTES", 4000)  # embed / lm_head rows in several blocks
    assert main(["convert", q, str(out / "hf"), "--dequantize", "--no-progress", "--max-shard-size", "100KB"]) == 0
    qcfg, qw = checkpoint.load_model(q)
    fcfg, fw = params.dequantize_weights(qcfg, qw)
    assert fcfg == cfg
    ref = checkpoint.save_model(str(tmp_path / "deq"), fcfg, fw)
    convert(ref, str(tmp_path / "ref_hf"), progress=False)
    got = read_dir(out / "hf")
    assert_same_bits(got, read_dir(tmp_path / "ref_hf"))
    assert got["lm_head.weight"].dtype.name == "float32"
    hf_cfg = json.loads((out / "hf" / "config.json").read_text())
    assert hf_cfg == json.loads((tmp_path / "ref_hf" / "config.json").read_text())
    assert "quantization" not in hf_cfg and "quantization_config" not in hf_cfg


def test_hf_round_trip_restores_the_hf_config_and_dtypes(tmp_path):
    _, hf_cfg, hf = hf_source(tmp_path, "qwen3_moe")
    q = convert(hf, str(tmp_path / "q"), progress=False, quantize="fp8")
    with pytest.raises(ConversionError, match="holds fp8 weights; pass --dequantize to export them as bfloat16"):
        convert(q, str(tmp_path / "back"), progress=False)
    back = convert(q, str(tmp_path / "back"), progress=False, dequantize=True)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == hf_cfg
    got, src = read_dir(back), read_dir(hf)
    assert sorted(got) == sorted(src)
    assert all(got[k].dtype == src[k].dtype for k in src)
    # norms and the router are not quantized: they come back exactly; matmul weights to fp8's precision
    exact = [k for k in src if "norm" in k or k.endswith("mlp.gate.weight") or "embed_tokens" in k]
    assert exact and all(np.array_equal(got[k].view(np.uint8), src[k].view(np.uint8)) for k in exact)
    w = "model.layers.1.mlp.experts.3.down_proj.weight"
    a, b = got[w].astype(np.float32), src[w].astype(np.float32)
    assert not np.array_equal(a, b) and np.abs(a - b).max() <= 0.07 * np.abs(b).max(axis=1, keepdims=True).max()


def test_cli_quantize_and_bad_flags(tmp_path, capsys):
    cfg, _, hf = hf_source(tmp_path, "qwen3_moe")
    assert main(["convert", hf, str(tmp_path / "q"), "--quantize", "int8", "--no-progress"]) == 0
    qcfg = checkpoint.load_checkpoint_config(str(tmp_path / "q"))
    assert (qcfg.family, qcfg.quantization, qcfg.d_model) == ("qwen3_moe", "int8", cfg.d_model)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse: the choices
        main(["convert", hf, str(tmp_path / "x"), "--quantize", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    assert main(["convert", hf, str(tmp_path / "x"), "--quantize", "int8", "--dequantize", "--no-progress"]) == 2
    assert "contradict" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="unknown quantization 'int4'"):
        convert(hf, str(tmp_path / "x"), quantize="int4")
    # a quantized HF checkpoint (e.g. an FP8 release) is named as such, before any reading
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf_cfg, "quantization_config": {"quant_method": "fp8"}}))
    assert main(["convert", hf, str(tmp_path / "x"), "--quantize", "int8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a quantized HuggingFace checkpoint" in err and "'fp8'" in err
    assert not (tmp_path / "x").exists()
    assert sorted(os.listdir(tmp_path)) == ["hf", "q"]


def test_dequantized_export_loads_in_transformers_with_our_logits(tmp_path, quantized_native):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, _, q = quantized_native
    hf = convert(q, str(tmp_path / "hf"), progress=False, dequantize=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
    with torch.inference_mode():  # ours is bidirectional: a full 4-D boolean mask makes transformers' so too
        want = ref(input_ids=torch.from_numpy(tokens), attention_mask=torch.ones(2, 1, 16, 16, dtype=torch.bool)
                   ).logits.numpy()
    fcfg, fw = params.dequantize_weights(*checkpoint.load_model(q))
    apply = jax.jit(lambda w, t: model.apply(w, fcfg, t, dispatch="dense"))
    got = np.asarray(apply(fw, jnp.asarray(tokens, jnp.int32)))
    assert np.std(want) > 0.5
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
