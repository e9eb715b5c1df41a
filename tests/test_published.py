"""`clover convert` on checkpoints in the form Qwen3.5 / Qwen3.6-MoE are published in: the multimodal model
(`Qwen3_5MoeForConditionalGeneration`: a `text_config` beside a `vision_config`, the text model under
`model.language_model.`, the vision tower under `model.visual.`, the MTP layers under `mtp.`, several shards).

The fixtures (tests/fixtures/published, made by its make_fixture.py) are a tiny random transformers model
saved that way plus an MTP shard, and the same weights in Clover's form (fused experts, block-diffusion
tensors). The text model converts and runs here with transformers' logits (1e-4, float32, also left-padded);
vision and MTP are carried untouched in the native checkpoint's `extras/` and an export gives back the very
files of the source, byte for byte; `text_only` drops them and exports a text-only model; a tensor of no
known part is refused by name. `published.vision_tensors` / `mtp_tensors` are checked against the fixtures'
key sets, which come from transformers (vision) and the vLLM / SGLang MTP names (MTP).

The fixtures are copied into a temporary directory first; each checkpoint converts once per module."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from clover_jax.checkpoint import expected_leaves, flatten_weights, load_model
from clover_jax.convert import ConversionError, clover, convert, published, qwen3_5_moe
from clover_jax.model import masks, transformer
from clover_jax.model.params import ungroup_channels

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "published"
QWEN, CLOVER = "qwen3_5_moe_vl_tiny", "clover_moe_vl_tiny"
MASK_ID = 255
PAD_ID = 0
BLOCK_SIZE = 32
TEXT_PREFIX = "model.language_model."
# Clover's block-diffusion weights, native names.
BD_LEAVES = {"linear_layers.attn.conv_right", "linear_layers.attn.bd_logit_scale",
             "linear_layers.attn.bd_history_bias", "linear_layers.attn.bd_history_c"}
BD_SCALARS = {"bd_softmax_logit_scale": "bd_logit_scale", "bd_softmax_history_bias": "bd_history_bias",
              "bd_softmax_history_c": "bd_history_c"}


# ---- helpers --------------------------------------------------------------------------------------------------


def _files(folder: Path) -> dict[str, bytes]:
    """Every regular file directly in `folder`, by name."""
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files directly in `folder`."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """key -> shape of every tensor of the safetensors files in `folder`, without reading the data."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "np") as s:
            for k in s.keys():  # noqa: SIM118 (safe_open is no dict)
                out[k] = tuple(s.get_slice(k).get_shape())
    return out


def _part(tensors: dict[str, Any], part: str) -> dict[str, Any]:
    return {k: v for k, v in tensors.items() if published.part_of(k) == part}


def _assert_bits_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k, a in want.items():
        b = got[k]
        assert (b.dtype, b.shape) == (a.dtype, a.shape), k
        assert b.tobytes() == a.tobytes(), k


def _assert_same_files(got: Path, want: Path) -> None:
    """The same file names directly in both folders, and each file byte-identical."""
    g, w = _files(got), _files(want)
    assert sorted(g) == sorted(w), f"extra: {sorted(set(g) - set(w))}, missing: {sorted(set(w) - set(g))}"
    differ = [n for n in w if g[n] != w[n]]
    assert not differ, f"files that differ from the source: {differ}"
    assert not [d.name for d in got.iterdir() if d.is_dir()], "the export has subdirectories"


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _text_cfg(folder: Path) -> Any:
    """The native config of the text model `folder`'s config.json describes, read without the pipeline."""
    hf = _config(folder)
    mod = clover if clover.detect(hf) else qwen3_5_moe
    return mod.config_from_hf(published.read(hf).text, folder.name, "float32", MASK_ID)


def _batches() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(tokens, valid) of an unpadded batch and of a left-padded one."""
    rng = np.random.default_rng(0)
    plain = rng.integers(2, 250, (2, 24))
    padded = rng.integers(2, 250, (3, 20))
    valid = np.ones(padded.shape, bool)
    valid[1, :7] = False
    valid[2, :3] = False
    padded[~valid] = PAD_ID
    return {"unpadded": (plain, np.ones(plain.shape, bool)), "left_padded": (padded, valid)}


def _hf_logits(model: Any, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """transformers' logits with the attention mask and the positions of `valid` (as test_parity_qwen3_5)."""
    import torch

    positions = np.asarray(masks.positions(jnp.asarray(valid))).astype(np.int64)
    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                     attention_mask=torch.from_numpy(valid.astype(np.int64)),
                     position_ids=torch.from_numpy(positions)).logits.float().numpy()


def _load_hf(cls: Any, path: Path) -> Any:
    """`cls.from_pretrained(path)` in float32, eval mode; asserts no missing, unexpected or mismatched keys."""
    import torch

    model, info = cls.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.float().eval()


# ---- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of both fixture checkpoints (never written into tests/fixtures)."""
    root = tmp_path_factory.mktemp("published")
    for name in (QWEN, CLOVER):
        shutil.copytree(FIXTURES / name, root / name)
    return root


@pytest.fixture(scope="module")
def qwen_native(work: Path) -> Path:
    return Path(convert(str(work / QWEN), str(work / "qwen-native"), progress=False, mask_token_id=MASK_ID))


@pytest.fixture(scope="module")
def qwen_export(work: Path, qwen_native: Path) -> Path:
    return Path(convert(str(qwen_native), str(work / "qwen-export"), progress=False))


@pytest.fixture(scope="module")
def qwen_model(qwen_native: Path) -> tuple[Any, Any]:
    return load_model(str(qwen_native))


@pytest.fixture(scope="module")
def text_only(work: Path) -> tuple[Path, Path]:
    """(native, export) of the qwen fixture converted with `text_only=True`."""
    native = convert(str(work / QWEN), str(work / "text-native"), progress=False, mask_token_id=MASK_ID,
                     text_only=True)
    return Path(native), Path(convert(native, str(work / "text-export"), progress=False))


@pytest.fixture(scope="module")
def clover_native(work: Path) -> Path:
    return Path(convert(str(work / CLOVER), str(work / "clover-native"), progress=False))


@pytest.fixture(scope="module")
def clover_export(work: Path, clover_native: Path) -> Path:
    return Path(convert(str(clover_native), str(work / "clover-export"), progress=False))


@pytest.fixture(scope="module")
def hf() -> Any:
    """transformers (skips without torch, or a transformers without Qwen3.5-MoE)."""
    pytest.importorskip("torch", reason="parity with transformers needs torch (pip install '.[torch]')")
    tf = pytest.importorskip("transformers", reason="parity needs transformers (pip install '.[torch]')")
    if not hasattr(tf, "Qwen3_5MoeForConditionalGeneration"):
        pytest.skip("this transformers has no Qwen3_5MoeForConditionalGeneration (5.x has it)")
    return tf


@pytest.fixture(scope="module")
def references(hf: Any, work: Path) -> dict[str, Any]:
    """transformers' models of the fixture: the multimodal one (run on token ids alone) and the text model
    (`Qwen3_5MoeForCausalLM`, which leaves model.visual.* and mtp.* unread)."""
    return {"conditional": _load_hf(hf.Qwen3_5MoeForConditionalGeneration, work / QWEN),
            "causal": _load_hf(hf.Qwen3_5MoeForCausalLM, work / QWEN)}


@pytest.fixture(scope="module")
def logits(qwen_model: tuple[Any, Any]) -> dict[str, np.ndarray]:
    """batch -> the converted model's logits (one compilation per batch shape)."""
    cfg, weights = qwen_model
    run = jax.jit(lambda w, t, v: transformer.apply(w, cfg, t, v))
    return {b: np.asarray(run(weights, jnp.asarray(t), jnp.asarray(v))) for b, (t, v) in _batches().items()}


@pytest.fixture(scope="module")
def reference_logits(references: dict[str, Any]) -> dict[tuple[str, str], np.ndarray]:
    """(model, batch) -> transformers' logits."""
    return {(m, b): _hf_logits(model, *batch) for m, model in references.items() for b, batch in _batches().items()}


# ---- the fixtures themselves --------------------------------------------------------------------------------


def test_fixture_files_are_those_recorded():
    record = json.loads((FIXTURES / "fixtures.json").read_text())
    on_disk = {f"{d}/{f.name}" for d in (QWEN, CLOVER) for f in (FIXTURES / d).iterdir()}
    assert on_disk == set(record["files"])
    for name, info in record["files"].items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == info["sha256"], name


def test_fixture_has_the_published_form():
    hf = _config(FIXTURES / QWEN)
    assert hf["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and hf["model_type"] == "qwen3_5_moe"
    assert hf["text_config"]["mtp_num_hidden_layers"] == 1 and hf["vision_config"]["depth"] == 1
    index = json.loads((FIXTURES / QWEN / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and sorted(f.name for f in (FIXTURES / QWEN).glob("*.safetensors")) == shards
    shapes = _shapes(FIXTURES / QWEN)
    assert sorted(shapes) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(int(np.prod(s)) * 4 for s in shapes.values())
    parts = published.split(shapes)
    assert parts[published.VISION] and parts[published.MTP] and all(
        k.startswith(TEXT_PREFIX) or k == "lm_head.weight" for k in parts[published.TEXT])
    # transformers 5 saves the text model's experts per expert; the MTP shard has them per expert too
    assert f"{TEXT_PREFIX}layers.0.mlp.experts.7.gate_proj.weight" in shapes
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in shapes
    c = _shapes(FIXTURES / CLOVER)
    assert c[f"{TEXT_PREFIX}layers.0.mlp.experts.gate_up_proj"] == (8, 64, 64)
    assert c["mtp.layers.0.mlp.experts.down_proj"] == (8, 64, 32)
    assert c[f"{TEXT_PREFIX}layers.2.linear_attn.conv_right_weight"] == (96, 1, 4)
    assert f"{TEXT_PREFIX}layers.3.linear_attn.conv_right_weight" not in c  # layer 3 is attention


# ---- published.vision_tensors / mtp_tensors against the fixtures ------------------------------------------


@pytest.mark.parametrize(("name", "fused"), [(QWEN, False), (CLOVER, True)])
def test_mtp_tensors_are_the_fixtures(name: str, fused: bool):
    cfg = _text_cfg(FIXTURES / name)
    want = _part(_shapes(FIXTURES / name), published.MTP)
    assert published.mtp_tensors(cfg, 1, fused_experts=fused) == want
    assert published.mtp_tensors(cfg, 0) == {}


@pytest.mark.parametrize("name", [QWEN, CLOVER])
def test_vision_tensors_are_the_fixtures(name: str):
    vc = _config(FIXTURES / name)["vision_config"]
    assert published.vision_tensors(vc) == _part(_shapes(FIXTURES / name), published.VISION)


@pytest.mark.parametrize("name", [QWEN, CLOVER])
def test_expected_describes_the_fixtures(name: str):
    pub = published.read(_config(FIXTURES / name))
    shapes = _shapes(FIXTURES / name)
    want = published.expected(pub, _text_cfg(FIXTURES / name), shapes)
    for part in (published.VISION, published.MTP):
        found = {k: np.empty(s, np.uint8) for k, s in _part(shapes, part).items()}
        assert want[part] and published.differences(want[part], found) == {"missing": [], "unexpected": [],
                                                                           "shape": []}, part


# ---- Qwen3.5 published form: import --------------------------------------------------------------------------


def test_converts_as_the_hybrid_text_model(qwen_model: tuple[Any, Any]):
    cfg, weights = qwen_model
    assert cfg.family == "qwen3_5_moe" and cfg.is_hybrid and cfg.n_layers == 4
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_experts, cfg.rotary_dim, cfg.mask_token_id) == (256, 64, 8, 4, MASK_ID)
    assert cfg.attn_output_gate and cfg.shared_expert_gate and cfg.norm_unit_offset
    assert cfg.is_block_causal and cfg.block_size == 1 and not cfg.has_bd_weights
    # the native weights are the text model's, nothing else (vision / MTP are no leaves)
    assert set(flatten_weights(weights)) == set(expected_leaves(cfg))


@pytest.mark.parametrize("batch", ["unpadded", "left_padded"])
@pytest.mark.parametrize("reference", ["conditional", "causal"])
def test_logits_match_transformers(logits: dict, reference_logits: dict, reference: str, batch: str):
    tokens, valid = _batches()[batch]
    want, got = reference_logits[(reference, batch)], logits[batch]
    assert got.shape == want.shape == (*tokens.shape, 256)
    assert np.std(want[valid]) > 0.3  # spread-out logits: a wrong weight would move them far more than 1e-4
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=0)


def test_the_two_references_agree(reference_logits: dict):
    """transformers' multimodal model on token ids alone is its text model (the fixture's MTP shard unread)."""
    for batch in _batches():
        np.testing.assert_array_equal(reference_logits[("conditional", batch)], reference_logits[("causal", batch)])


@pytest.mark.parametrize(("name", "native"), [(QWEN, "qwen_native"), (CLOVER, "clover_native")])
def test_vision_and_mtp_are_carried_untouched(request: pytest.FixtureRequest, name: str, native: str):
    native = request.getfixturevalue(native)
    fixture = _tensors(FIXTURES / name)
    carried = {k: v for k, v in fixture.items() if published.part_of(k) != published.TEXT}
    assert carried and (native / "extras").is_dir()
    _assert_bits_equal(_tensors(native / "extras"), carried)
    # load_model reads the text model alone
    cfg, weights = load_model(str(native))
    assert set(flatten_weights(weights)) == set(expected_leaves(cfg)) and cfg.n_layers == 4


# ---- Qwen3.5 published form: export ----------------------------------------------------------------------------


def test_export_gives_back_the_source_files(qwen_export: Path):
    _assert_same_files(qwen_export, FIXTURES / QWEN)


def test_export_loads_in_transformers(hf: Any, qwen_export: Path, reference_logits: dict):
    model = _load_hf(hf.Qwen3_5MoeForConditionalGeneration, qwen_export)
    for batch, (tokens, valid) in _batches().items():
        np.testing.assert_array_equal(_hf_logits(model, tokens, valid), reference_logits[("conditional", batch)])


# ---- text_only -------------------------------------------------------------------------------------------------


def test_text_only_leaves_vision_and_mtp_out(text_only: tuple[Path, Path], qwen_model: tuple[Any, Any]):
    native, out = text_only
    assert not (native / "extras").exists()
    cfg, weights = load_model(str(native))
    full_cfg, full = qwen_model
    assert cfg == full_cfg
    for k, a in flatten_weights(full).items():
        np.testing.assert_array_equal(np.asarray(flatten_weights(weights)[k]), np.asarray(a), err_msg=k)
    hf = _config(out)
    assert hf["model_type"] == "qwen3_5_moe_text" and hf["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert not {"text_config", "vision_config", "image_token_id", "mtp_num_hidden_layers"} & set(hf)
    assert "preprocessor_config.json" not in _files(out)
    got = _tensors(out)
    assert not [k for k in got if published.part_of(k) != published.TEXT or k.startswith(TEXT_PREFIX)]
    # the text tensors of the source, keyed as Qwen3_5MoeForCausalLM saves them, bit for bit
    want = {("model." + k[len(TEXT_PREFIX):] if k.startswith(TEXT_PREFIX) else k): v
            for k, v in _part(_tensors(FIXTURES / QWEN), published.TEXT).items()}
    _assert_bits_equal(got, want)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (FIXTURES / QWEN / name).read_bytes(), name


def test_text_only_export_loads_as_the_text_model(hf: Any, text_only: tuple[Path, Path], reference_logits: dict):
    _, out = text_only
    model = _load_hf(hf.Qwen3_5MoeForCausalLM, out)
    assert model.config.model_type == "qwen3_5_moe_text"
    for batch, (tokens, valid) in _batches().items():
        np.testing.assert_array_equal(_hf_logits(model, tokens, valid), reference_logits[("causal", batch)])


# ---- refused --------------------------------------------------------------------------------------------------


def test_a_tensor_of_no_known_part_is_refused(tmp_path: Path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / QWEN, src)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(str(src / last))
    tensors["model.foo.weight"] = np.ones((4, 64), np.float32)
    save_file(tensors, str(src / last), metadata={"format": "pt"})
    index["weight_map"]["model.foo.weight"] = last
    index["metadata"]["total_size"] += 4 * 64 * 4
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    dst = tmp_path / "dst"
    with pytest.raises(ConversionError, match=r"model\.foo\.weight"):
        convert(str(src), str(dst), progress=False, mask_token_id=MASK_ID)
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temporary directory left either


# ---- Clover's form ---------------------------------------------------------------------------------------------


def test_clover_converts_with_its_block_diffusion_tensors(clover_native: Path, qwen_model: tuple[Any, Any]):
    cfg, weights = load_model(str(clover_native))
    assert cfg.family == "clover" and cfg.is_hybrid and cfg.is_block_causal and cfg.block_size == BLOCK_SIZE
    assert cfg.has_bd_weights and cfg.bd_conv_right_kernel == 4 and cfg.mask_token_id == MASK_ID
    got = flatten_weights(weights)
    assert set(got) == set(expected_leaves(cfg))
    # the same model as the Qwen fixture (experts fused here, per expert there), plus the block-diffusion weights
    _, qwen = qwen_model
    want = flatten_weights(qwen)
    assert set(got) - set(want) == BD_LEAVES and set(want) <= set(got)
    for k, a in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(a), err_msg=k)
    hf = _tensors(FIXTURES / CLOVER)
    for layer in range(3):  # the Gated DeltaNet layers, in order
        la = f"{TEXT_PREFIX}layers.{layer}.linear_attn."
        np.testing.assert_array_equal(ungroup_channels(np.asarray(got["linear_layers.attn.conv_right"][layer]), cfg),
                                      hf[la + "conv_right_weight"][:, 0, :].T)
        for tail, native in BD_SCALARS.items():
            np.testing.assert_array_equal(np.asarray(got[f"linear_layers.attn.{native}"][layer]), hf[la + tail])


def test_clover_export_gives_back_the_source_files(clover_export: Path):
    _assert_same_files(clover_export, FIXTURES / CLOVER)


# ---- the base install --------------------------------------------------------------------------------------

# A sitecustomize that makes torch and transformers impossible to import: the base install, which has neither.
_NO_TORCH = '''import sys


class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (refused: the base install)", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''


def test_a_converted_download_generates_on_the_base_install(clover_native: Path, tmp_path: Path):
    """`clover generate` on a converted published checkpoint with torch and transformers refused: its
    tokenizer.json and jinja chat template are read by base dependencies, and text comes out with exit 0."""
    assert (clover_native / "tokenizer.json").is_file() and (clover_native / "chat_template.jinja").is_file()
    (tmp_path / "sitecustomize.py").write_text(_NO_TORCH)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "refused" in probe.stderr  # the refusal itself works
    run = subprocess.run([sys.executable, "-m", "clover_jax", "generate", "--model", str(clover_native),
                          "--gen-length", "32", "--steps", "4", "Hello"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert run.stdout.strip()  # the decoded text of the generated ids
