"""Config validation names the problem before anything is traced; presets build; `clover info` counts."""

from __future__ import annotations

import json
import re

import pytest

from clover_jax import cli
from clover_jax.config import ConfigError, ModelConfig, get_config, load_config, preset_names
from clover_jax.model.params import abstract, count_params, named_leaves

BASE = get_config("test-llada2")  # sigmoid router with groups, dense first layer, shared expert


@pytest.mark.parametrize(("changes", "message"), [
    (dict(n_heads=6, n_kv_heads=4), r"n_heads \(6\) must be divisible by n_kv_heads \(4\)"),
    (dict(n_experts_per_tok=17), r"top-k n_experts_per_tok \(17\) must be in \[1, n_experts=16\]"),
    (dict(n_experts_per_tok=0), r"top-k n_experts_per_tok \(0\)"),
    (dict(partial_rotary_factor=0.3), r"rotary dims head_dim\*partial_rotary_factor = 16\*0.3"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
    (dict(n_expert_groups=3), r"n_experts \(16\) must be divisible by n_expert_groups \(3\)"),
    (dict(topk_groups=5), r"topk_groups \(5\) must be in \[1, n_expert_groups=4\]"),
    (dict(topk_groups=1, n_experts_per_tok=5), r"the 1 kept groups hold 4 experts, fewer than top-k 5"),
    (dict(n_dense_layers=4), r"n_dense_layers \(4\) must be in \[0, n_layers=3\]"),
    (dict(dense_mlp_dim=0), r"dense layers need dense_mlp_dim > 0"),
    (dict(shared_mlp_dim=0), r"shared experts need shared_mlp_dim > 0"),
    (dict(router="relu"), r"router must be 'softmax' or 'sigmoid', got 'relu'"),
    (dict(attention="causal"), r"attention must be 'bidirectional' or 'block_causal', got 'causal'"),
    (dict(block_size=0), r"block_size must be positive"),
    (dict(mask_token_id=256), r"mask_token_id \(256\) must be a token id in \[0, vocab_size=256\)"),
    (dict(dtype="float64"), r"dtype must be one of"),
    (dict(family="llama"), r"family must be one of"),
    (dict(d_model=0), r"d_model must be positive, got 0"),
])
def test_bad_config_is_named(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        BASE.replace(**changes)
    assert "test-llada2" in str(info.value)  # the message names the config too


HYBRID = get_config("test-qwen3-5-moe")
GROUP = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


@pytest.mark.parametrize(("changes", "message"), [
    (dict(layer_types=GROUP[:3]), r"layer_types has 3 entries for n_layers=4"),
    (dict(layer_types=("linear_attention", "mamba", "full_attention", "full_attention")), r"\['mamba'\]"),
    (dict(linear_num_key_heads=0), r"Gated DeltaNet layers need linear_num_key_heads > 0"),
    (dict(linear_value_head_dim=0), r"need linear_value_head_dim > 0"),
    (dict(linear_num_value_heads=3), r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)"),
    (dict(n_dense_layers=1, dense_mlp_dim=32), r"MoE MLPs only \(n_dense_layers must be 0\)"),
    (dict(use_expert_bias=True), r"expert-bias balancing is not implemented for hybrid"),
    (dict(shared_expert_gate=True, n_shared_experts=0, shared_mlp_dim=0), r"shared_expert_gate needs a shared expert"),
    (dict(n_layers=9, layer_types=("linear_attention",) * 8 + ("full_attention",)),
     r"repeat a group of at most 8 layers"),
])
def test_bad_hybrid_config_is_named(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HYBRID.replace(**changes)


def test_hybrid_config_groups_and_json_round_trip(tmp_path) -> None:
    assert HYBRID.layer_group == GROUP and (HYBRID.n_linear_layers, HYBRID.n_attention_layers) == (3, 1)
    eight = HYBRID.replace(n_layers=8, layer_types=GROUP * 2)
    assert eight.layer_group == GROUP and eight.linear_conv_dim == 2 * 2 * 16 + 4 * 8
    path = tmp_path / "config.json"
    path.write_text(eight.to_json())
    again = load_config(str(path))  # layer_types comes back from JSON as a list: still hashable, still equal
    assert again == eight and hash(again) == hash(eight)
    names = {n for n, _ in named_leaves(abstract(eight))}
    assert {"linear_layers.attn.qkv", "linear_layers.attn.conv", "moe_layers.attn.gate",
            "linear_layers.mlp.shared_gate"} <= names
    assert dict(named_leaves(abstract(eight)))["linear_layers.attn.qkv"].shape == (6, 64, 96)
    assert dict(named_leaves(abstract(eight)))["moe_layers.attn.q"].shape == (2, 64, 4, 16)


def test_qwen3_5_preset_counts_the_real_backbone(capsys) -> None:
    """Qwen3.5-35B-A3B: ~34.7 B parameters (Clover's BF16 GGUF is 69.38 GB), ~3.5 B active."""
    assert cli.main(["info", "--config", "qwen3.5-35b-a3b"]) == 0
    out = capsys.readouterr().out
    total = _billions(next(line for line in out.splitlines() if line.startswith("total params")))
    active = _billions(next(line for line in out.splitlines() if line.startswith("active params")))
    assert 34.5 <= total <= 34.9 and 3.2 <= active <= 3.7, out
    assert "30 Gated DeltaNet" in out and "10 groups of 3 Gated DeltaNet + 1 full attention" in out


def test_unknown_preset_lists_known_ones(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'clover-1t'.*clover-35b-a3b"):
        get_config("clover-1t")
    with pytest.raises(ConfigError, match=r"'clover-1t' is neither a preset"):
        load_config("clover-1t")
    with pytest.raises(ConfigError, match=r"unknown config fields: colour"):
        ModelConfig.from_dict({**BASE.to_dict(), "colour": "blue"})
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**BASE.to_dict(), "n_kv_heads": 3}))
    with pytest.raises(ConfigError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        load_config(str(tmp_path))


def test_config_round_trips_through_json(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(BASE.to_json())
    assert load_config(str(path)) == BASE
    assert hash(load_config(str(path))) == hash(BASE)  # static argument of jit


def test_mask_token_defaults_to_last_id() -> None:
    cfg = BASE.replace(mask_token_id=-1)
    assert cfg.mask_token_id == BASE.vocab_size - 1


@pytest.mark.parametrize("name", preset_names())
def test_presets_build_abstract_weights(name: str) -> None:
    cfg = get_config(name)
    leaves = named_leaves(abstract(cfg))
    c = count_params(cfg)
    assert c.total == sum(s.size for _, s in leaves)
    assert 0 < c.active <= c.total
    names = {n for n, _ in leaves}
    assert ("moe_layers.mlp.gate" in names) == (cfg.n_moe_layers > 0)
    assert ("dense_layers.mlp.gate" in names) == (cfg.n_dense_layers > 0)
    assert ("moe_layers.attn.gate" in names) == cfg.attn_output_gate


def test_clover_presets_are_block_causal_with_blocks_of_32() -> None:
    for name in ("clover-35b-a3b", "clover-tiny", "clover-tiny-attention"):
        cfg = get_config(name)
        assert cfg.attention == "block_causal" and cfg.block_size == 32


def _billions(line: str) -> float:
    return int(re.search(r"\(([\d,]+)\)", line).group(1).replace(",", "")) / 1e9


def test_clover_info_counts_35b_total_3b_active(capsys) -> None:
    assert cli.main(["info", "--config", "clover-35b-a3b"]) == 0
    out = capsys.readouterr().out
    total = _billions(next(line for line in out.splitlines() if line.startswith("total params")))
    active = _billions(next(line for line in out.splitlines() if line.startswith("active params")))
    assert 34.0 <= total <= 36.0, out
    assert 2.7 <= active <= 3.5, out
    assert "block_causal (blocks of 32)" in out


def test_clover_info_unknown_config_is_one_line_error(capsys) -> None:
    assert cli.main(["info", "--config", "nope"]) == 2
    err = capsys.readouterr().err
    assert "clover info: error:" in err and "'nope' is neither a preset" in err
    assert "Traceback" not in err
