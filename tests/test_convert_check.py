"""`clover convert --check`: a headers-only report on a HuggingFace checkpoint, on a sparse full-size Clover-35B and
on small broken ones."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from clover_jax import checkpoint
from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.convert import ConversionError, convert, hf_io
from clover_jax.convert.check import check
from clover_jax.model.params import count_params
from tests.sparse_checkpoint import clover_35b_published, published_config, published_tensors, write_sparse

SMALL_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 2,
                "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16}


@pytest.fixture(autouse=True)
def no_tensor_data(monkeypatch):
    """`check` reads headers only: any read of tensor data fails the test."""
    def refuse(*_: object) -> None:
        raise AssertionError("check read tensor data")

    monkeypatch.setattr(hf_io.SafetensorsSource, "get_rows", refuse)
    monkeypatch.setattr(hf_io.SafetensorsSource, "get", refuse)


def _params(tensors: dict) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) for s, _ in tensors.values())


def test_clover_35b_published_checks_in_seconds_from_headers(tmp_path):
    src = str(tmp_path / "Clover-35B-A3B")
    cfg, parts = clover_35b_published(src)
    files = os.listdir(src)
    assert len([f for f in files if f.endswith(".safetensors")]) == 40
    apparent = sum(os.path.getsize(os.path.join(src, f)) for f in files)
    on_disk = sum(os.stat(os.path.join(src, f)).st_blocks * 512 for f in files)
    print(f"sparse Clover-35B: {apparent / 1e9:.1f} GB apparent, {on_disk / 1e3:.0f} KB on disk")
    assert apparent > 70e9 and on_disk < 8e6

    start = time.perf_counter()
    r = check(src, quantize="int8")
    took = time.perf_counter() - start
    text = r.render()
    print(f"check took {took:.2f} s\n{text}")
    assert r.exit_code == 0 and r.error is None, text
    assert (r.family, r.form, r.model.name, r.model.n_layers, r.model.n_experts, r.model.dtype) == (
        "clover", "multimodal", "clover-35b-a3b", 40, 256, "bfloat16")
    assert text.splitlines()[0].startswith("family   clover") and text.splitlines()[-1].startswith("OK")
    assert "warning  " not in text and "problem  " not in text
    # parameters by part: the text model's is the config's (~35B), vision and MTP what the config describes
    total = count_params(cfg).total
    assert 34e9 < total < 36e9 and r.config_params == total
    assert r.parts["text"].params == total == _params(parts["text"])
    assert r.parts["vision"].params == _params(parts["vision"]) > 0
    assert r.parts["mtp"].params == _params(parts["mtp"]) > 0
    assert r.files == 40 and sum(p.tensors for p in r.parts.values()) == sum(len(p) for p in parts.values())
    assert r.parts["text"].nbytes == 2 * total and r.parts["text"].dtypes == ("bfloat16",)
    # the native size: the native weights (norms and router in float32) plus vision and MTP carried as they are
    carried = r.parts["vision"].nbytes + r.parts["mtp"].nbytes
    native = sum(s.size * np.dtype(s.dtype).itemsize for s in checkpoint.expected_leaves(cfg).values())
    assert r.carried_bytes == carried and r.native_bytes == native + carried
    assert 0.45 < r.quantized_bytes / r.native_bytes < 0.6  # int8: about half
    assert "with --quantize int8" in text and "carried as is" in text


def _small(tmp_path, name: str = "small", edit=None, family: str = "test-qwen3-5-moe", n_shards: int = 3) -> str:
    """A small published checkpoint (sparse: `check` needs headers only), its tensors edited by `edit(parts)`."""
    cfg = get_config(family, dtype="bfloat16")
    vision = {**SMALL_VISION, "out_hidden_size": cfg.d_model}
    parts = published_tensors(cfg, vision, 1)
    if edit:
        edit(parts)
    src = str(tmp_path / name)
    write_sparse(src, {k: v for p in parts.values() for k, v in p.items()}, published_config(cfg, vision, 1), n_shards)
    return src


P = "model.language_model.layers"


def _shape(parts, key, shape):
    parts["text"][key] = (shape, parts["text"][key][1])


@pytest.mark.parametrize(("edit", "named"), [
    (lambda p: p["text"].pop(f"{P}.1.mlp.experts.gate_up_proj"), f"missing tensors: {P}.1.mlp.experts.gate_up_proj"),
    (lambda p: p["text"].update({f"{P}.0.mlp.bogus.weight": ((2, 2), "bfloat16")}),
     f"unexpected tensors: {P}.0.mlp.bogus.weight"),
    (lambda p: _shape(p, f"{P}.3.self_attn.k_proj.weight", (32, 63)),
     f"{P}.3.self_attn.k_proj.weight is (32, 63), expected (32, 64)"),
    (lambda p: p["text"].update({f"{P}.3.self_attn.o_proj.weight": ((64, 64), "float16")}),
     f"{P}.3.self_attn.o_proj.weight is float16, the model is bfloat16"),
], ids=["missing", "unexpected", "shape", "dtype"])
def test_text_model_problems_fail_and_are_named(tmp_path, edit, named):
    assert check(_small(tmp_path, "good")).exit_code == 0
    r = check(_small(tmp_path, edit=edit))
    text = r.render()
    print(text)
    assert r.exit_code == 2 and len(r.text) == 1
    assert f"problem  text: {named}" in text.replace("shapes that disagree with config.json: ", "").replace(
        "dtypes: ", ""), text
    assert text.splitlines()[-1].startswith("FAIL     the tensors in") and "1 " in text.splitlines()[-1]
    with pytest.raises(ConversionError, match=re.escape(named)) as e:  # in the conversion's own words
        convert(r.src, str(tmp_path / "out"), progress=False)
    assert "; ".join(r.text.lines()) in str(e.value)


def test_vision_and_mtp_differences_are_warnings(tmp_path, monkeypatch):
    def edit(parts):
        parts["mtp"].pop("mtp.fc.weight")
        parts["vision"]["model.visual.pos_embed.weight"] = ((15, 16), "bfloat16")

    src = _small(tmp_path, edit=edit)
    r = check(src)
    text = r.render()
    print(text)
    assert r.exit_code == 0 and not r.text
    assert "warning  mtp: missing tensors: mtp.fc.weight" in text
    assert "warning  vision: shapes that disagree with config.json: model.visual.pos_embed.weight is [15, 16], " \
           "expected [16, 16]" in text
    assert text.splitlines()[-1].startswith("OK       the conversion would succeed") and "2 warnings above" in text
    # --text-only drops them: nothing to warn about, and the native size is the text model's alone
    t = check(src, text_only=True)
    assert t.exit_code == 0 and not t.warnings and t.carried_bytes == 0
    assert t.native_bytes == r.native_bytes - r.carried_bytes and "dropped (--text-only)" in t.render()
    # The conversion agrees (it reads the holes as zeros): the native weights and the carried tensors are the sizes
    # the report gave, quantized too.
    monkeypatch.undo()
    for scheme, size in ((None, r.native_bytes), ("int8", check(src, quantize="int8").quantized_bytes)):
        dst = convert(src, str(tmp_path / f"native-{scheme}"), progress=False, quantize=scheme)
        stored = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in checkpoint.stored_leaves(dst).values())
        extras = hf_io.open_source(os.path.join(dst, "extras"))
        assert stored + sum(t.nbytes for t in extras.tensors.values()) == size, scheme
        extras.close()


def test_a_missing_shard_fails(tmp_path):
    src = _small(tmp_path)
    os.remove(os.path.join(src, "model-00002-of-00003.safetensors"))
    r = check(src)
    print(r.render())
    assert r.exit_code == 2 and "names files that do not exist: model-00002-of-00003.safetensors" in r.error
    assert r.family == "qwen3_5_moe" and r.render().splitlines()[-1].startswith("FAIL")


def test_a_config_that_is_not_json_fails_in_one_line(tmp_path):
    src = _small(tmp_path)
    with open(os.path.join(src, "config.json"), "w") as f:
        f.write("{not json")
    r = check(src)
    assert r.exit_code == 2 and r.render().count("\n") == 0
    assert r.render().startswith("FAIL") and "config.json is not valid JSON" in r.render()
    with open(os.path.join(src, "config.json"), "w") as f:  # JSON, but no model
        json.dump({"model_type": "qwen3_5_moe", "text_config": {"hidden_size": 64}}, f)
    r = check(src)
    assert r.exit_code == 2 and "lacks the field" in r.error and "\n" not in r.error


def test_cli_prints_the_report_and_exits_with_its_code(tmp_path, capsys):
    src = _small(tmp_path, edit=lambda p: p["text"].pop(f"{P}.0.linear_attn.A_log"))
    proc = subprocess.run([sys.executable, "-m", "clover_jax", "convert", "--check", src, "--quantize", "fp8"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    assert f"problem  text: missing tensors: {P}.0.linear_attn.A_log" in proc.stdout
    assert "with --quantize fp8" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("FAIL")
    # without --check, DST is required (a usage error, exit code 2); with it, there is none
    for argv in (["convert", src], ["convert", "--check", src, str(tmp_path / "dst")]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "clover convert: error: " in err and "required: DST" in err and "--check takes SRC alone" in err
    assert "(see clover convert --help)" in err and "usage:" not in err  # one line each, no usage block
    assert main(["convert", "--check", _small(tmp_path, "good")]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("OK")


# ---- damaged metadata: one line naming the file and field, at conversion time --------------------------------

PUBLISHED = os.path.join(os.path.dirname(__file__), "fixtures", "published", "clover_moe_vl_tiny")


def _edit_config(src: str, edit) -> None:
    path = os.path.join(src, "config.json")
    with open(path) as f:
        hf = json.load(f)
    edit(hf)
    with open(path, "w") as f:
        json.dump(hf, f)


def _write(src: str, name: str, text: str) -> None:
    with open(os.path.join(src, name), "w") as f:
        f.write(text)


def _rope_theta(hf: dict, value) -> None:
    hf["text_config"].setdefault("rope_parameters", {})["rope_theta"] = value


DAMAGED_METADATA = {
    "vocab_size a string": (lambda s: _edit_config(s, lambda hf: hf["text_config"].update(vocab_size="lots")),
                            r"config\.json: text_config: vocab_size: expected an integer, got 'lots'"),
    "rope_theta a string": (lambda s: _edit_config(s, lambda hf: _rope_theta(hf, "big")),
                            r"config\.json: text_config: rope_parameters: rope_theta: expected a number, got 'big'"),
    "negative layer count": (lambda s: _edit_config(s, lambda hf: hf["text_config"].update(num_hidden_layers=-4)),
                             r"text_config: num_hidden_layers: expected an integer >= 1, got -4"),
    "tie_word_embeddings a string": (lambda s: _edit_config(s, lambda hf: hf.update(tie_word_embeddings="no")),
                                     r"config\.json: tie_word_embeddings: expected true or false, got 'no'"),
    "eos a float": (lambda s: _edit_config(s, lambda hf: hf["text_config"].update(eos_token_id=1.5)),
                    r"text_config: eos_token_id: expected a token id or a list of them, got 1\.5"),
    "corrupt tokenizer.json": (lambda s: _write(s, "tokenizer.json", '{"version": "1.0", "model": {'),
                               r"tokenizer\.json: not a tokenizer\.json the tokenizers package can read"),
    "chat template that does not parse": (lambda s: _write(s, "chat_template.jinja", "{% for m in messages %}{{ m"),
                                          r"chat_template\.jinja: the chat template does not parse \(line 1: "),
    "chat template of the wrong type": (
        lambda s: _write(s, "tokenizer_config.json", '{"chat_template": 42}'),
        r"tokenizer_config\.json: chat_template: expected a string \(one jinja template\), got int"),
    "tokenizer_config.json not JSON": (lambda s: _write(s, "tokenizer_config.json", "{oops"),
                                       r"tokenizer_config\.json: not valid JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGED_METADATA))
def test_damaged_metadata_is_one_line_naming_file_and_field(tmp_path, capsys, damage):
    """A download whose config.json, tokenizer or chat template is damaged: `convert --check` fails naming the file
    and field, and `clover convert` refuses it in one line with exit code 2 before writing DST."""
    edit, named = DAMAGED_METADATA[damage]
    src = _small(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a real tokenizer, so the good case reads one
        with open(os.path.join(PUBLISHED, name)) as f:
            _write(src, name, f.read())
    assert check(src).exit_code == 0
    edit(src)
    r = check(src)
    assert r.exit_code == 2 and re.search(named, r.error), r.render()
    capsys.readouterr()
    dst = tmp_path / "dst"
    assert main(["convert", src, str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("clover convert: error: ") and "Traceback" not in err, err
    assert re.search(named, err), err
    assert not dst.exists()
