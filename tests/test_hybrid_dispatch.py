"""The hybrid model gives the same logits whatever the MoE dispatch, at a medium shape where the chunked
Gated DeltaNet and the tiled dispatch share the layer scan (this once went wrong on XLA:CPU while the
chunked form used `lax.linalg.triangular_solve`: 0.36 logit difference; forward substitution fixed it)."""

import jax
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.model import delta_rule, params, transformer


def test_tiled_equals_dense_at_a_medium_hybrid_shape(monkeypatch):
    monkeypatch.setattr(delta_rule, "RECURRENT_MAX", 64)  # the chunked form for these 192-token rows
    group = ("linear_attention",) * 3 + ("full_attention",)
    cfg = ModelConfig(
        name="medium-hybrid", family="qwen3_5_moe", vocab_size=32000, d_model=512, n_layers=8, n_heads=8,
        n_kv_heads=4, head_dim=64, n_experts=32, n_experts_per_tok=4, expert_mlp_dim=256, n_shared_experts=1,
        shared_mlp_dim=256, shared_expert_gate=True, attention="block_causal", block_size=1,
        attn_output_gate=True, norm_unit_offset=True, partial_rotary_factor=0.25, layer_types=group * 2,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        dtype="float32", init_std=0.05, eos_token_id=1, pad_token_id=0,
    )
    weights = params.init(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(8), (8, 192), 0, cfg.vocab_size)
    logits = {name: np.asarray(jax.jit(lambda w, t, n=name: transformer.forward(w, cfg, t, dispatch=n).logits)(
        weights, tokens)) for name in ("dense", "tiled")}
    assert logits["dense"].std() > 0.5
    np.testing.assert_allclose(logits["tiled"], logits["dense"], atol=1e-3)
