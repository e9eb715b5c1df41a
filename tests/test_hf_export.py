"""The HF export is loadable by HF tools (`convert.hf_extras`): a tiny native model of each family transformers
implements (qwen3_moe, qwen3_5_moe), exported with `clover convert`, loads with AutoModelForCausalLM and gives
our logits; AutoTokenizer loads its SentencePiece tokenizer and encodes as ours does; GenerationConfig loads
its generation_config.json; README.md is the model card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="loading the export with transformers needs torch")
transformers = pytest.importorskip("transformers", reason="loading the export needs transformers")

from clover_jax import checkpoint, model  # noqa: E402
from clover_jax.config import get_config  # noqa: E402
from clover_jax.convert import convert  # noqa: E402
from clover_jax.loading import sampler_defaults  # noqa: E402
from clover_jax.tokenizer import load_tokenizer, train_sentencepiece  # noqa: E402
from tests.test_convert import noisy_weights as weights  # noqa: E402
from tests.test_tokenizer import corpus  # noqa: E402

IDS = dict(vocab_size=320, mask_token_id=3, eos_token_id=2, pad_token_id=0)  # the trained tokenizer's ids
PRESETS = {"qwen3_moe": "test-qwen3-moe", "qwen3_5_moe": "test-qwen3-5-moe"}
SCALE = {"qwen3_moe": 0.2, "qwen3_5_moe": 0.08}  # as the parity tests: peaked logits, well conditioned
NATIVE_GEN = {"gen_length": 64, "steps": 32, "block_length": 16, "remasking": "low_confidence", "temperature": 0.0}
TEXTS = ["ROMEO:\nthou art the king,\n  and so on.", "  two  spaces\n\nand digits 12345", "unseen ☃ é 漢字", " lead"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tok") / "tokenizer")
    train_sentencepiece(corpus(), IDS["vocab_size"], out)
    return out


@pytest.fixture(scope="module", params=sorted(PRESETS))
def exported(request, tmp_path_factory, tokenizer_dir):
    family = request.param
    cfg = get_config(PRESETS[family], **IDS)
    w = weights(cfg, SCALE[family])
    work = tmp_path_factory.mktemp(family)
    native = checkpoint.save_model(str(work / "native"), cfg, w, tokenizer_dir=tokenizer_dir, extra_files={
        "generation_config.json": json.dumps(NATIVE_GEN), "MODEL_CARD.md": f"# {family} tiny\n\nA card.\n"})
    hf = convert(native, str(work / "hf"), progress=False)
    return family, cfg, w, native, hf


def test_automodel_logits_match_ours(exported):
    family, cfg, w, _, hf = exported
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(ref).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[family]
    tokens = np.random.default_rng(1).integers(4, cfg.vocab_size, (2, 16))
    kw = {}
    if family == "qwen3_moe":  # ours is bidirectional: a full 4-D boolean mask makes transformers' so too
        kw["attention_mask"] = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    with torch.inference_mode():  # qwen3_5_moe: causal in transformers, block-causal with blocks of 1 here
        want = ref(input_ids=torch.from_numpy(tokens), **kw).logits.numpy()
    got = np.asarray(jax.jit(lambda w, t: model.apply(w, cfg, t, dispatch="dense"))(w, jnp.asarray(tokens, jnp.int32)))
    assert np.std(want) > 0.5  # spread-out logits: a wrong weight would move them far more than 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_generation_config_loads_in_hf_and_back(exported):
    _, cfg, _, _, hf = exported
    gen = transformers.GenerationConfig.from_pretrained(hf)
    assert (gen.eos_token_id, gen.pad_token_id, gen.max_new_tokens) == (cfg.eos_token_id, cfg.pad_token_id, 64)
    assert (gen.mask_token_id, gen.steps, gen.block_length, gen.do_sample) == (cfg.mask_token_id, 32, 16, False)
    # `clover generate` on the export reads the same sampler defaults as on the native checkpoint
    assert sampler_defaults(hf) == sampler_defaults(str(hf).replace("hf", "native")) != {}


def test_tokenizer_loads_in_hf_and_encodes_as_ours(exported):
    family, cfg, _, native, hf = exported
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        doc = json.loads(Path(hf, name).read_text())
        assert (doc["mask_token"], doc["pad_token"], doc["eos_token"]) == ("[MASK]", "<pad>", "</s>"), name
    # transformers 5 forces its byte-level Qwen3_5Tokenizer on a qwen3_5_moe_text config whatever
    # tokenizer_config.json names (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): there the class is named directly
    load = transformers.PreTrainedTokenizerFast if family == "qwen3_5_moe" else transformers.AutoTokenizer
    tok = load.from_pretrained(hf)
    assert (tok.mask_token_id, tok.pad_token_id, tok.eos_token_id) == (
        cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id)
    ours = load_tokenizer(native)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == tok(text)["input_ids"] == ours.encode(text), text
        assert tok.decode(ours.encode(text)) == ours.decode(ours.encode(text)), text


def test_model_card_is_the_readme(exported):
    family, *_, hf = exported
    readme = Path(hf, "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: transformers\ntags: [")
    assert readme.endswith(f"---\n\n# {family} tiny\n\nA card.\n")


def test_no_tokenizer_no_ids_invented(tmp_path):
    """eos and pad None, no tokenizer, no card: no tokenizer files, no eos/pad anywhere, a generated card."""
    cfg = get_config("test-qwen3-moe", eos_token_id=None, pad_token_id=None)
    native = checkpoint.save_model(str(tmp_path / "n"), cfg, weights(cfg, 0.02))
    hf = convert(native, str(tmp_path / "hf"), progress=False)
    assert not any((tmp_path / "hf" / n).exists() for n in ("tokenizer_config.json", "special_tokens_map.json"))
    doc = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert doc == {"mask_token_id": cfg.mask_token_id}
    gen = transformers.GenerationConfig.from_pretrained(hf)
    assert gen.eos_token_id is None and gen.pad_token_id is None
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: transformers\n") and "# test-qwen3-moe" in readme
    assert f"mask token id {cfg.mask_token_id}" in readme and "clover convert" in readme


def test_copied_hf_files_are_kept(tmp_path, tokenizer_dir):
    """An HF import's tokenizer_config.json and HF-format generation_config.json come out as they went in;
    a card with front matter is copied verbatim."""
    cfg = get_config("test-qwen3-moe", **IDS)
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(Path(tokenizer_dir, "tokenizer.model"), tok)
    tok_cfg = '{"tokenizer_class": "PreTrainedTokenizerFast", "mask_token": "[MASK]", "model_max_length": 7}'
    gen = '{"eos_token_id": [2, 1], "pad_token_id": 0, "mask_token_id": 3, "max_new_tokens": 5}'
    (tok / "tokenizer_config.json").write_text(tok_cfg)
    (tok / "generation_config.json").write_text(gen)
    card = "---\nlicense: mit\n---\n# mine\n"
    native = checkpoint.save_model(str(tmp_path / "n"), cfg, weights(cfg, 0.02), tokenizer_dir=str(tok),
                                   extra_files={"MODEL_CARD.md": card})
    hf = convert(native, str(tmp_path / "hf"), progress=False)
    out = tmp_path / "hf"
    assert (out / "tokenizer_config.json").read_text() == tok_cfg
    assert not (out / "special_tokens_map.json").exists()
    assert (out / "generation_config.json").read_text() == gen
    assert (out / "README.md").read_text() == card
    assert transformers.AutoTokenizer.from_pretrained(hf).model_max_length == 7


def test_shipped_model_exports_loadable_tokenizer(tmp_path):
    """The shipped clover-tiny (clover family: not a transformers model) still exports a tokenizer and
    generation config HF tools load, and its MODEL_CARD.md as README.md."""
    from clover_jax.shipped import MODEL_DIR

    src = str(MODEL_DIR)
    hf = convert(src, str(tmp_path / "hf"), progress=False)
    cfg = checkpoint.load_checkpoint_config(src)
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ours = load_tokenizer(src)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ours.encode(text), text
    assert tok.mask_token_id == cfg.mask_token_id
    gen = transformers.GenerationConfig.from_pretrained(hf)
    assert gen.max_new_tokens == sampler_defaults(src)["gen_length"] and gen.eos_token_id == cfg.eos_token_id
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: clover-jax\n") and "\n# clover-tiny\n" in readme
