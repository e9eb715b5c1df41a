"""`clover convert`: HF <-> native for every layout, transformers parity, bad input, atomicity."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from clover_jax import checkpoint, model
from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.convert import FAMILIES, ConversionError, convert, published
from clover_jax.model import params

BF16 = np.dtype(ml_dtypes.bfloat16)
REF = Path(__file__).parent / "fixtures" / "reference"
PRESETS = {"clover": "test-clover", "llada2_moe": "test-llada2", "llada_moe": "test-llada-moe",
           "qwen3_moe": "test-qwen3-moe", "qwen3_5_moe": "test-qwen3-5-moe"}


def write_hf(path, tensors: dict, hf_cfg: dict, n_files: int = 2) -> None:
    """A HF directory: config.json, tensors split over `n_files` safetensors + index, a tokenizer file."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 512}')
    keys = sorted(tensors)
    if n_files == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(n_files):
        name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::n_files]}
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def noisy_weights(cfg, scale: float = 0.1, seed: int = 0) -> params.Weights:
    """numpy weights (no compile): each leaf's init value plus noise, norms and Gated DeltaNet decays well away
    from theirs so that a mixed-up one shows, matrices large enough that the logits spread out."""
    rng = np.random.default_rng(seed)
    specs = params.abstract(cfg)
    leaves = []
    for name, s in params.named_leaves(specs):
        last = name.rsplit(".", 1)[-1]
        base = {"ones": 1.0, "zeros": 0.0, "constant": s.value}.get(s.init, 0.0)
        std = 0.2 if last.endswith("norm") else 0.5 if last in ("a_log", "dt_bias", "conv") else scale
        leaves.append(jnp.asarray((base + std * rng.standard_normal(s.shape)).astype(s.dtype)))
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=params.is_spec), leaves)


def synthetic_tensors(cfg, layout: str, seed: int = 0, small_dtype=BF16, fused: bool = False, **variants) -> dict:
    """Random tensors for every key the layout defines; norms/router/bias in `small_dtype`."""
    rng = np.random.default_rng(seed)
    out = {}
    for g in FAMILIES[layout].groups(cfg, fused_experts=fused, **variants):
        for k, s in zip(g.hf, g.hf_shapes, strict=True):
            dt = np.dtype(cfg.dtype) if g.kind == "matmul" else small_dtype
            out[k] = np.asarray(rng.standard_normal(s, np.float32) * 0.1).astype(dt)
    return out


def read_dir(path) -> dict:
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    out = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="numpy") as f:
            for k in f.keys():  # noqa: SIM118
                out[k] = f.get_tensor(k)
    return out


def no_leftovers(parent, allowed=()) -> None:
    assert sorted(set(os.listdir(parent)) - set(allowed)) == [], os.listdir(parent)


@pytest.mark.parametrize("layout", [*sorted(PRESETS), "qwen3_moe-fused"])
def test_hf_native_hf_bit_exact(tmp_path, monkeypatch, layout):
    from clover_jax.convert import pipeline

    # embed / lm_head in many row blocks (the last one short), routed experts in parts of a layer
    monkeypatch.setattr(pipeline, "ROW_BLOCK_BYTES", 5000)
    fused = layout.endswith("-fused")  # transformers 5's in-memory experts: gate_up_proj [E, 2F, D], down_proj
    layout = layout.removesuffix("-fused")
    cfg = get_config(PRESETS[layout], dtype="bfloat16")
    tensors = synthetic_tensors(cfg, layout, fused=fused)
    assert fused == ("model.layers.1.mlp.experts.gate_up_proj" in tensors)
    hf_cfg = FAMILIES[layout].config_to_hf(cfg)
    if layout != "qwen3_5_moe":  # (which refuses fields it does not understand: see the test below)
        hf_cfg["some_unknown_field"] = [1, 2]  # kept verbatim on the way back
    write_hf(tmp_path / "hf", tensors, hf_cfg)
    convert(str(tmp_path / "hf"), str(tmp_path / "native"), progress=False, mask_token_id=cfg.mask_token_id)
    cfg2, w = checkpoint.load_model(str(tmp_path / "native"))
    assert (cfg2.family, cfg2.dtype, cfg2.n_layers, cfg2.n_experts) == (layout, "bfloat16", cfg.n_layers, cfg.n_experts)
    n_attention_moe = cfg.n_moe_layers - cfg.n_linear_layers
    assert w.moe_layers.mlp.gate.shape == (n_attention_moe, cfg.n_experts, cfg.d_model, cfg.expert_mlp_dim)
    assert w.moe_layers.mlp.router.dtype == np.float32  # norms and router are float32 natively
    assert os.path.exists(tmp_path / "native" / "tokenizer_config.json")

    convert(str(tmp_path / "native"), str(tmp_path / "back"), progress=False, max_shard_bytes=100_000)
    back = read_dir(tmp_path / "back")
    assert sorted(back) == sorted(tensors)
    for k, a in tensors.items():
        assert back[k].dtype == a.dtype, k
        np.testing.assert_array_equal(back[k].view(np.uint8), a.view(np.uint8), err_msg=k)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == hf_cfg
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    shards = [f for f in os.listdir(tmp_path / "back") if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(os.path.getsize(tmp_path / "back" / f) < 300_000 for f in shards)
    assert (tmp_path / "back" / "tokenizer_config.json").exists()


def test_native_export_import_keeps_weights(tmp_path):
    """A model made here (no HF origin) exports in its family's layout and comes back identical."""
    from tests.test_checkpoint import _assert_equal, random_weights

    cfg = get_config("test-clover")
    w = random_weights(cfg, 4)
    checkpoint.save_model(str(tmp_path / "n"), cfg, w)
    convert(str(tmp_path / "n"), str(tmp_path / "hf"), progress=False)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["model_type"] == "clover_moe" and hf["attn_output_gate"] is True
    keys = read_dir(tmp_path / "hf")
    assert keys["model.layers.0.self_attn.gate_proj.weight"].shape == (cfg.n_heads * cfg.head_dim, cfg.d_model)
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in keys
    convert(str(tmp_path / "hf"), str(tmp_path / "n2"), progress=False)
    cfg2, w2 = checkpoint.load_model(str(tmp_path / "n2"))
    assert cfg2 == cfg
    _assert_equal(w, w2)


def _llada2_public_keys(cfg) -> dict:
    """Keys and shapes exactly as in the public LLaDA2.0 checkpoints (written out, not derived)."""
    d, h, kv, hd, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_experts
    f, fs, fd = cfg.expert_mlp_dim, cfg.shared_mlp_dim, cfg.dense_mlp_dim
    keys = {"model.word_embeddings.weight": (cfg.vocab_size, d), "model.norm.weight": (d,),
            "lm_head.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        keys.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                     p + "attention.query_key_value.weight": ((h + 2 * kv) * hd, d),
                     p + "attention.dense.weight": (d, h * hd), p + "attention.query_layernorm.weight": (hd,),
                     p + "attention.key_layernorm.weight": (hd,)})
        if i == 0:
            keys.update({p + "mlp.gate_proj.weight": (fd, d), p + "mlp.up_proj.weight": (fd, d),
                         p + "mlp.down_proj.weight": (d, fd)})
            continue
        keys.update({p + "mlp.gate.weight": (e, d), p + "mlp.gate.expert_bias": (e,),
                     p + "mlp.shared_experts.gate_proj.weight": (fs, d),
                     p + "mlp.shared_experts.up_proj.weight": (fs, d),
                     p + "mlp.shared_experts.down_proj.weight": (d, fs)})
        for j in range(e):
            keys.update({p + f"mlp.experts.{j}.gate_proj.weight": (f, d), p + f"mlp.experts.{j}.up_proj.weight": (f, d),
                         p + f"mlp.experts.{j}.down_proj.weight": (d, f)})
    return keys


def _llada2_hf_config(cfg) -> dict:
    return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "num_hidden_layers": cfg.n_layers,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.dense_mlp_dim, "first_k_dense_replace": 1,
            "hidden_act": "silu", "max_position_embeddings": 512, "moe_intermediate_size": cfg.expert_mlp_dim,
            "norm_topk_prob": True, "num_experts_per_tok": cfg.n_experts_per_tok, "num_attention_heads": cfg.n_heads,
            "num_experts": cfg.n_experts, "num_key_value_heads": cfg.n_kv_heads, "rope_theta": 600000,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_bias": False, "rms_norm_eps": 1e-06,
            "head_dim": cfg.head_dim, "num_shared_experts": 1, "use_qkv_bias": False, "vocab_size": cfg.vocab_size,
            "rotary_dim": cfg.head_dim // 2, "router_dtype": "fp32", "moe_router_enable_expert_bias": True,
            "routed_scaling_factor": 2.5, "n_group": cfg.n_expert_groups, "topk_group": cfg.topk_groups,
            "score_function": "sigmoid", "pad_token_id": 0, "partial_rotary_factor": 0.5, "eos_token_id": 1}


def test_llada2_public_layout_converts_and_runs(tmp_path):
    cfg = get_config("test-llada2", dtype="bfloat16")
    rng = np.random.default_rng(0)
    tensors = {k: (rng.standard_normal(s, np.float32) * 0.1).astype(BF16)
               for k, s in _llada2_public_keys(cfg).items()}
    for i in (1, 2):  # a float32 buffer in the public checkpoints
        tensors[f"model.layers.{i}.mlp.gate.expert_bias"] = rng.standard_normal(cfg.n_experts).astype(np.float32)
    write_hf(tmp_path / "hf", tensors, _llada2_hf_config(cfg), n_files=3)
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "n"), "--no-progress",
                 "--mask-token-id", "255"]) == 0
    cfg2, w = checkpoint.load_model(str(tmp_path / "n"))
    assert (cfg2.router, cfg2.n_dense_layers, cfg2.attention, cfg2.rotary_dim) == ("sigmoid", 1, "block_causal", 8)
    # The fused q/k/v rows split as [q heads | k heads | v heads].
    qkv = tensors["model.layers.2.attention.query_key_value.weight"].astype(np.float32)
    q_rows = cfg.n_heads * cfg.head_dim
    np.testing.assert_array_equal(np.asarray(w.moe_layers.attn.q[1], np.float32).reshape(cfg.d_model, -1),
                                  qkv[:q_rows].T)
    np.testing.assert_array_equal(np.asarray(w.moe_layers.attn.v[1], np.float32).reshape(cfg.d_model, -1),
                                  qkv[q_rows + cfg.n_kv_heads * cfg.head_dim:].T)
    np.testing.assert_array_equal(np.asarray(w.moe_layers.mlp.expert_bias[0]),
                                  tensors["model.layers.1.mlp.gate.expert_bias"])
    tokens = jax.numpy.asarray(rng.integers(0, 250, (2, 16)), jax.numpy.int32)
    assert model.apply(w, cfg2, tokens).shape == (2, 16, cfg.vocab_size)

    # The logits against LLaDA2's own modeling file: tests/fixtures/reference/llada2_tiny (public keys; its
    # logits recorded by make_fixtures.py there) written as the public checkpoints ship (bfloat16, the expert_bias
    # buffer float32, 3 files) converts through the same command to bfloat16(the float32 conversion's weights),
    # bit for bit; those, run in float32, give the recorded logits within 1e-4.
    ref = REF / "llada2_tiny"
    src = load_file(str(ref / "model.safetensors"))
    public = {k: a if k.endswith("expert_bias") else a.astype(BF16) for k, a in src.items()}
    write_hf(tmp_path / "tiny", public, json.loads((ref / "config.json").read_text()) | {"torch_dtype": "bfloat16"},
             n_files=3)
    assert main(["convert", str(tmp_path / "tiny"), str(tmp_path / "tiny-n"), "--no-progress",
                 "--mask-token-id", "250"]) == 0
    convert(str(ref), str(tmp_path / "tiny-f32"), progress=False, mask_token_id=250)
    tiny_cfg, tiny_w = checkpoint.load_model(str(tmp_path / "tiny-n"))
    f32_cfg, f32_w = checkpoint.load_model(str(tmp_path / "tiny-f32"))
    assert tiny_cfg.dtype == "bfloat16" and f32_cfg.dtype == "float32"
    assert sorted(src) == sorted(_llada2_public_keys(f32_cfg))  # the public layout, as the checkpoint above
    flat32 = checkpoint.flatten_weights(f32_w)
    for name, a in checkpoint.flatten_weights(tiny_w).items():
        want = np.asarray(flat32[name])
        np.testing.assert_array_equal(np.asarray(a), want if name.endswith("expert_bias") else want.astype(BF16),
                                      err_msg=name)
    info = json.loads((REF / "fixtures.json").read_text())["scenarios"]["llada2.npz"]["llada2_tiny_block"]
    ids = jnp.asarray([info["input_ids"]], jnp.int32)
    blocks = np.arange(ids.shape[1]) // info["block"]
    mask = jnp.asarray((blocks[None, :] <= blocks[:, None])[None])  # the reference's block-causal mask
    got = model.forward(f32_w, f32_cfg, ids, jnp.arange(ids.shape[1])[None], mask, dispatch="dense").logits
    want = np.load(REF / "llada2.npz")["llada2_tiny_block/logits"]
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_qwen3_moe_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    hf_cfg = tr.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.3,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    ref = tr.Qwen3MoeForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # non-trivial norms so that a transposed or swapped norm would show
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "n"), progress=False)
    cfg, w = checkpoint.load_model(str(tmp_path / "n"))
    assert (cfg.family, cfg.mask_token_id, cfg.attention) == ("qwen3_moe", 127, "bidirectional")
    ids = np.random.default_rng(1).integers(0, 127, (2, 12))
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool)  # full bidirectional
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids), attention_mask=mask).logits.numpy()
    got = np.asarray(model.apply(w, cfg, jax.numpy.asarray(ids, jax.numpy.int32), dispatch="dense"))
    assert np.abs(want).max() > 0.5  # a big enough init scale to make the comparison meaningful
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# ---- bad input -------------------------------------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path):
    cfg = get_config("test-qwen3-moe", dtype="bfloat16")
    tensors = synthetic_tensors(cfg, "qwen3_moe")
    hf_cfg = FAMILIES["qwen3_moe"].config_to_hf(cfg)
    return cfg, tensors, hf_cfg


@pytest.mark.parametrize(("damage", "message"), [
    ("missing", r"missing tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"),
    ("extra", r"unexpected tensors: model\.layers\.0\.mlp\.bogus\.weight"),
    ("shape", r"model\.layers\.0\.self_attn\.q_proj\.weight is \(64, 63\), expected \(64, 64\)"),
    ("dtype", r"model\.layers\.1\.self_attn\.o_proj\.weight is float16, the model is bfloat16"),
    ("config", r"model\.embed_tokens\.weight is \(256, 64\), expected \(256, 32\)"),
    ("truncated", r"truncated"),
    ("family", r"cannot tell the family"),
])
def test_bad_hf_input_is_refused_and_leaves_nothing(tmp_path, hf_dir, damage, message):
    _, tensors, hf_cfg = hf_dir
    tensors = dict(tensors)
    if damage == "missing":
        del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    elif damage == "extra":
        tensors["model.layers.0.mlp.bogus.weight"] = np.zeros((2, 2), BF16)
    elif damage == "shape":
        tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((64, 63), BF16)
    elif damage == "dtype":
        tensors["model.layers.1.self_attn.o_proj.weight"] = tensors["model.layers.1.self_attn.o_proj.weight"].astype(
            np.float16)
    elif damage == "config":
        hf_cfg = {**hf_cfg, "hidden_size": 32}
    elif damage == "family":
        hf_cfg = {**hf_cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    src = tmp_path / "src"
    write_hf(src, tensors, hf_cfg)
    if damage == "truncated":
        shard = src / "model-00002-of-00002.safetensors"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) - 1000])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConversionError, match=message):
        convert(str(src), str(out / "dst"), progress=False)
    no_leftovers(out)
    # The command line reports the same as one line and exit code 2.
    assert main(["convert", str(src), str(out / "dst"), "--no-progress"]) == 2
    no_leftovers(out)


def test_existing_destination_needs_force(tmp_path, hf_dir, capsys):
    _, tensors, hf_cfg = hf_dir
    write_hf(tmp_path / "src", tensors, hf_cfg)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "dst" / "keep.txt").read_text() == "mine"
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--no-progress", "--force"]) == 0
    assert not (tmp_path / "dst" / "keep.txt").exists()
    assert checkpoint.load_checkpoint_config(str(tmp_path / "dst")).family == "qwen3_moe"
    no_leftovers(tmp_path, {"src", "dst"})


def test_pickle_needs_allow_pickle(tmp_path, hf_dir):
    torch = pytest.importorskip("torch")
    _, tensors, hf_cfg = hf_dir
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf_cfg))
    sd = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) for k, v in tensors.items()}
    torch.save(sd, src / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="--allow-pickle"):
        convert(str(src), str(tmp_path / "dst"), progress=False)
    assert not (tmp_path / "dst").exists()
    convert(str(src), str(tmp_path / "dst"), progress=False, allow_pickle=True)
    _, w = checkpoint.load_model(str(tmp_path / "dst"))
    np.testing.assert_array_equal(np.asarray(w.embed), tensors["model.embed_tokens.weight"])


def test_killed_conversion_leaves_no_destination(tmp_path):
    """SIGKILL once the progress bar shows: no destination, only a temp dir (named *.tmp-*)."""
    cfg = get_config("test-qwen3-moe", dtype="float32", n_layers=40, n_experts=32, expert_mlp_dim=128)
    write_hf(tmp_path / "src", synthetic_tensors(cfg, "qwen3_moe", small_dtype=np.float32),
             FAMILIES["qwen3_moe"].config_to_hf(cfg), n_files=1)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "clover_jax.cli", "convert", str(tmp_path / "src"),
                             str(tmp_path / "dst")], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    seen = b""
    deadline = time.time() + 120
    while time.time() < deadline:
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
        pct = re.findall(rb"import:\s+(\d+)%", seen)
        if pct and 0 < int(pct[-1]) < 100:  # part of the weights written
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert pct and 0 < int(pct[-1]) < 100, seen[-2000:]
    assert not (tmp_path / "dst").exists()
    assert all(".tmp-" in n for n in os.listdir(tmp_path) if n != "src")


def test_qwen3_5_config_fields_are_honoured_or_refused_by_name(tmp_path):
    cfg = get_config("test-qwen3-5-moe")
    family = FAMILIES["qwen3_5_moe"]
    hf = family.config_to_hf(cfg)
    assert family.config_from_hf(hf, cfg.name, cfg.dtype, cfg.mask_token_id) == cfg
    older = {k: v for k, v in hf.items() if k != "layer_types"} | {"full_attention_interval": 4}
    assert family.config_from_hf(older, cfg.name, cfg.dtype, cfg.mask_token_id).layer_types == cfg.layer_types
    with pytest.raises(ConversionError, match=r"does not understand: mystery_knob"):
        family.config_from_hf({**hf, "mystery_knob": 3}, cfg.name, cfg.dtype, None)
    with pytest.raises(ConversionError, match=r"not supported: attention_bias"):
        family.config_from_hf({**hf, "attention_bias": True}, cfg.name, cfg.dtype, None)
    # the multimodal wrapper's text_config is the same model (published.read unwraps it)
    wrapped = published.read({"model_type": "qwen3_5_moe", "text_config": hf, "vision_config": {"depth": 1}})
    assert family.config_from_hf(wrapped.text, cfg.name, cfg.dtype, cfg.mask_token_id) == cfg
    assert family.detect({"architectures": ["Qwen3_5MoeForConditionalGeneration"]})
    # the other families refuse the hybrid model instead of dropping its Gated DeltaNet layers
    for name in ("llada2_moe", "llada_moe", "qwen3_moe"):
        with pytest.raises(ConversionError, match="no Gated DeltaNet layers"):
            FAMILIES[name].config_to_hf(cfg)


def test_qwen3_5_key_prefix_and_qwen3_next_fused_projections(tmp_path):
    """Keys under model.language_model. and Qwen3-Next's in_proj_qkvz / in_proj_ba import to the weights that
    the plain split keys give (checked by converting both ways), and export back to the keys they came from."""
    cfg = get_config("test-qwen3-5-moe", dtype="bfloat16")
    family = FAMILIES["qwen3_5_moe"]
    variants = {"fused_linear": True, "prefix": "model.language_model."}
    tensors = synthetic_tensors(cfg, "qwen3_5_moe", seed=3, **variants)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkvz.weight" in tensors and "lm_head.weight" in tensors
    write_hf(tmp_path / "fused", tensors, family.config_to_hf(cfg))
    convert(str(tmp_path / "fused"), str(tmp_path / "native"), progress=False, mask_token_id=cfg.mask_token_id)
    _, w = checkpoint.load_model(str(tmp_path / "native"))
    convert(str(tmp_path / "native"), str(tmp_path / "back"), progress=False)
    back = read_dir(tmp_path / "back")
    assert sorted(back) == sorted(tensors)
    for k, a in tensors.items():
        np.testing.assert_array_equal(back[k].view(np.uint8), a.view(np.uint8), err_msg=k)
    # The same weights written in the split Qwen3.5 keys (each group's to_hf) import to the same arrays.
    flat = {n: np.asarray(a) for n, a in checkpoint.flatten_weights(w).items()}
    split = {}
    for g in family.groups(cfg):
        arrays = [flat[n] if i is None else flat[n][i] for n, i in g.native]
        split.update(zip(g.hf, (np.asarray(a) for a in g.to_hf(arrays)), strict=True))
    write_hf(tmp_path / "split", split, family.config_to_hf(cfg))
    convert(str(tmp_path / "split"), str(tmp_path / "native2"), progress=False, mask_token_id=cfg.mask_token_id)
    _, w2 = checkpoint.load_model(str(tmp_path / "native2"))
    for name, a in checkpoint.flatten_weights(w2).items():
        np.testing.assert_array_equal(np.asarray(a), flat[name], err_msg=name)


@pytest.mark.parametrize(("prefix", "shapes"), [
    ("model.", {}),  # conv_right [C, 1, Kr], one scalar per value head
    ("", {"conv_right_weight": [96, 3], "bd_softmax_logit_scale": [2], "bd_softmax_history_bias": [1],
          "bd_softmax_history_c": []}),  # no prefix; [C, Kr]; per key head, one value, a 0-d scalar
    ("language_model.", {"bd_softmax_history_c": [4]}),
])
def test_clover_moe_hybrid_layout_converts_runs_and_exports_bit_exact(tmp_path, prefix, shapes):
    """The clover_moe layout: qwen3_5_moe keys plus the four block-diffusion tensors per Gated DeltaNet layer,
    with the hub's config fields; the extra tensors' shapes come from the checkpoint."""
    cfg = get_config("test-clover-hybrid", dtype="bfloat16")
    family = FAMILIES["clover"]
    variants = {"prefix": prefix, "bd_shapes": shapes}
    tensors = synthetic_tensors(cfg, "clover", seed=4, small_dtype=np.dtype(np.float32), **variants)
    la = f"{prefix}layers.0.linear_attn"
    assert {f"{la}.conv_right_weight", f"{la}.bd_softmax_logit_scale", f"{la}.bd_softmax_history_bias",
            f"{la}.bd_softmax_history_c"} <= set(tensors)
    assert tensors[f"{la}.conv_right_weight"].shape == tuple(shapes.get("conv_right_weight", (96, 1, 3)))
    hf_cfg = family.config_to_hf(cfg)
    assert (hf_cfg["model_type"], hf_cfg["architectures"], hf_cfg["block_size"]) == ("clover_moe",
                                                                                     ["CloverMoeModelLM"], 8)
    hf_cfg.pop("block_size")
    hf_cfg["block_length"] = 8  # the hub's name for the block field is not known: read under either name
    assert hf_cfg.pop("bd_gdn") == "reconstructed"  # written when not the default; the hub's config has none
    write_hf(tmp_path / "hf", tensors, hf_cfg)
    convert(str(tmp_path / "hf"), str(tmp_path / "native"), progress=False)
    cfg2, w = checkpoint.load_model(str(tmp_path / "native"))
    # without a bd_gdn field a clover_moe checkpoint runs as its ports run it
    assert (cfg2.family, cfg2.block_size, cfg2.bd_gdn, cfg2.bd_conv_right_kernel) == ("clover", 8, "causal_prefix", 3)
    assert cfg2.mask_token_id == cfg.mask_token_id and cfg2.layer_types == cfg.layer_types
    right = params.ungroup_channels(np.asarray(w.linear_layers.attn.conv_right[0], np.float32), cfg)  # [Kr, C]
    src = tensors[f"{la}.conv_right_weight"].astype(np.float32)
    np.testing.assert_array_equal(right, (src[:, 0, :] if src.ndim == 3 else src).T)
    scale = np.asarray(w.linear_layers.attn.bd_logit_scale[0])  # one per value head, repeated over groups
    src_scale = tensors[f"{la}.bd_softmax_logit_scale"].reshape(-1)
    np.testing.assert_array_equal(scale, np.repeat(src_scale, 4 // src_scale.size))
    tokens = np.arange(12, dtype=np.int32)[None] + 5
    assert model.apply(w, cfg2, tokens).shape == (1, 12, cfg.vocab_size)

    convert(str(tmp_path / "native"), str(tmp_path / "back"), progress=False)
    back = read_dir(tmp_path / "back")
    assert sorted(back) == sorted(tensors)
    for k, a in tensors.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape, k
        np.testing.assert_array_equal(back[k].reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8), err_msg=k)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == hf_cfg

    # Clean text runs the causal Qwen3.5 model (bd_gdn causal_prefix, as its ports run it): the logits are
    # transformers' Qwen3_5MoeForCausalLM's on the source tensors, the block-diffusion ones dropped (computed in
    # float32 on both sides: bfloat16 arithmetic alone moves these logits by 21% of their norm). Measured: 2e-6 apart.
    torch = pytest.importorskip("torch", reason="the reference logits need torch (pip install '.[torch]')")
    tr = pytest.importorskip("transformers", reason="the reference logits need transformers (pip install '.[torch]')")
    w32 = jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, w)
    got = np.asarray(model.apply(w32, cfg2.replace(dtype="float32"), tokens))
    want = _qwen3_5_logits(tr, torch, cfg, hf_cfg, tensors, prefix, tokens)
    assert want.std() > 0.5  # spread out: a misplaced tensor would move them far more than 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _qwen3_5_logits(tr, torch, cfg, hf_cfg: dict, tensors: dict, prefix: str, tokens: np.ndarray) -> np.ndarray:
    """transformers' Qwen3_5MoeForCausalLM (float32) on a clover_moe checkpoint's tensors minus the four
    block-diffusion ones: the keys without `prefix`, the experts stacked as transformers stores them."""
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings",
              "rms_norm_eps", "tie_word_embeddings", "eos_token_id", "pad_token_id", "rope_parameters", "hidden_act",
              "attention_bias", "layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size", "norm_topk_prob")
    ref = tr.Qwen3_5MoeForCausalLM(tr.Qwen3_5MoeTextConfig(**{k: hf_cfg[k] for k in fields})).float().eval()
    sd = {}
    for k, a in tensors.items():
        if ".conv_right_weight" in k or ".bd_softmax_" in k:
            continue
        k = k.removeprefix(prefix)
        sd[k if k == "lm_head.weight" else f"model.{k}"] = torch.from_numpy(a.astype(np.float32))
    for i in range(cfg.n_layers):
        e, experts = f"model.layers.{i}.mlp.experts.", range(cfg.n_experts)
        sd[e + "gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"{e}{j}.gate_proj.weight"),
                                                         sd.pop(f"{e}{j}.up_proj.weight")]) for j in experts])
        sd[e + "down_proj"] = torch.stack([sd.pop(f"{e}{j}.down_proj.weight") for j in experts])
    ref.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return ref(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def test_clover_moe_unexpected_tensor_and_missing_block_size_are_named(tmp_path):
    cfg = get_config("test-clover-hybrid", dtype="bfloat16")
    family = FAMILIES["clover"]
    tensors = synthetic_tensors(cfg, "clover", seed=5)
    tensors["model.layers.0.linear_attn.bd_softmax_mystery"] = np.zeros((4,), BF16)
    write_hf(tmp_path / "extra", tensors, family.config_to_hf(cfg))
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.linear_attn\.bd_softmax_mystery"):
        convert(str(tmp_path / "extra"), str(tmp_path / "out1"), progress=False)
    no_block = {k: v for k, v in family.config_to_hf(cfg).items() if k != "block_size"}
    with pytest.raises(ConversionError, match="names no block size"):
        family.config_from_hf(no_block, cfg.name, cfg.dtype, None)
    assert not os.path.exists(tmp_path / "out1")
