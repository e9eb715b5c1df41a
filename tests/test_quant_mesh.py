"""A quantized checkpoint (`clover convert --quantize int8` of the shipped model) generated on a mesh: `clover generate
--mesh cpu-8` (the 8 fake CPU devices conftest sets up: 2-way data x 4-way expert) gives the same greedy tokens as
the same checkpoint on one device, with its int8 weights and their scales sharded over the expert axis."""

import json

import jax
import pytest

from clover_jax import loading, shipped
from clover_jax.cli import main

SAMPLER = ["--gen-length", "32", "--block-length", "32", "--temperature", "0", "--remasking", "low_confidence",
           "--batch-size", "4"]


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    if not (shipped.MODEL_DIR / "config.json").is_file():
        pytest.skip("the shipped model is not there")
    out = tmp_path_factory.mktemp("quant_mesh") / "clover-tiny-int8"
    assert main(["convert", str(shipped.MODEL_DIR), str(out), "--quantize", "int8", "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"] == "int8"
    return out


def test_int8_on_the_mesh_gives_the_single_device_tokens(int8_model, tmp_path, devices, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("ROMEO:", "JULIET:\nO", "First Citizen:")))
    rows = {}
    for mesh in (None, "cpu-8"):
        out = tmp_path / f"{mesh or 'one'}.jsonl"
        argv = ["generate", "--input", str(prompts), "--output", str(out), "--model", str(int8_model), *SAMPLER]
        assert main([*argv, *(["--mesh", mesh] if mesh else [])]) == 0, capsys.readouterr().err
        rows[mesh] = [json.loads(line) for line in out.read_text().splitlines()]
    one, sharded = rows[None], rows["cpu-8"]
    assert [r["id"] for r in sharded] == [0, 1, 2]
    assert [(r["text"], r["tokens"], r["finished"]) for r in sharded] == \
        [(r["text"], r["tokens"], r["finished"]) for r in one]
    assert [r["stats"]["nfe"] for r in sharded] == [r["stats"]["nfe"] for r in one]
    assert all(r["tokens"] == 32 or r["finished"] for r in one) and any(r["text"].strip() for r in one)

    # what ran on the mesh was the int8 model, sharded: the experts' int8 values and their scales over `expert`
    model = loading.open_model(str(int8_model), "cpu-8")
    gate = model.weights.moe_layers.mlp.gate
    assert model.cfg.quantization == "int8" and gate.qvalue.dtype == jax.numpy.int8
    for leaf in (gate.qvalue, gate.scale):
        assert "expert" in tuple(leaf.sharding.spec) and len(leaf.sharding.device_set) == 8
