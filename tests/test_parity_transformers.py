"""Parity with code nobody here wrote: transformers' Qwen3MoeForCausalLM, its weights copied into ours.

A full 4-D boolean attention mask [B, 1, T, T] makes it bidirectional (our `qwen3_moe` family with
attention="bidirectional"). float32, "highest" matmul precision; weights drawn large enough that the
logits are peaked, so 1e-4 is a real bound.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity with transformers needs torch (pip install '.[torch]')")
transformers = pytest.importorskip("transformers", reason="parity needs transformers (pip install '.[torch]')")

from clover_jax.config import get_config  # noqa: E402
from clover_jax.model import masks, transformer  # noqa: E402
from clover_jax.model.params import abstract, is_spec  # noqa: E402

CFG = get_config("test-qwen3-moe").replace(n_kv_heads=2, n_layers=2, rope_theta=10000.0)


def hf_model() -> torch.nn.Module:
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.d_model, num_hidden_layers=CFG.n_layers,
        num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_kv_heads, head_dim=CFG.head_dim,
        num_experts=CFG.n_experts, num_experts_per_tok=CFG.n_experts_per_tok,
        moe_intermediate_size=CFG.expert_mlp_dim, intermediate_size=CFG.expert_mlp_dim,
        norm_topk_prob=CFG.norm_topk_prob, rope_theta=CFG.rope_theta, rms_norm_eps=CFG.norm_eps,
        max_position_embeddings=CFG.max_seq_len, tie_word_embeddings=False, initializer_range=0.2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # norms away from 1 so that a mixed-up norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def weights_from_hf(model: torch.nn.Module):
    """transformers Qwen3-MoE state dict -> our Weights (transformers 5 fuses experts: gate_up_proj
    [E, 2I, D] = gate rows then up rows, down_proj [E, D, I]; linear weights are [out, in])."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    d, h, kv, hd = CFG.d_model, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    i_dim = CFG.expert_mlp_dim

    def layer(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}."
        gate_up = sd[p + "mlp.experts.gate_up_proj"]
        return {
            "attn_norm": sd[p + "input_layernorm.weight"],
            "mlp_norm": sd[p + "post_attention_layernorm.weight"],
            "q": sd[p + "self_attn.q_proj.weight"].T.reshape(d, h, hd),
            "k": sd[p + "self_attn.k_proj.weight"].T.reshape(d, kv, hd),
            "v": sd[p + "self_attn.v_proj.weight"].T.reshape(d, kv, hd),
            "o": sd[p + "self_attn.o_proj.weight"].T.reshape(h, hd, d),
            "q_norm": sd[p + "self_attn.q_norm.weight"],
            "k_norm": sd[p + "self_attn.k_norm.weight"],
            "router": sd[p + "mlp.gate.weight"].T,
            "gate": gate_up[:, :i_dim].transpose(0, 2, 1),
            "up": gate_up[:, i_dim:].transpose(0, 2, 1),
            "down": sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1),
        }

    layers = [layer(i) for i in range(CFG.n_layers)]
    stacked = {k: jnp.asarray(np.stack([lw[k] for lw in layers])) for k in layers[0]}
    specs = abstract(CFG)
    L = specs.moe_layers
    weights = dataclasses.replace(
        specs,
        embed=jnp.asarray(sd["model.embed_tokens.weight"]),
        final_norm=jnp.asarray(sd["model.norm.weight"]),
        lm_head=jnp.asarray(sd["lm_head.weight"].T),
        moe_layers=L.replace(
            attn_norm=stacked["attn_norm"], mlp_norm=stacked["mlp_norm"],
            attn=L.attn.replace(q=stacked["q"], k=stacked["k"], v=stacked["v"], o=stacked["o"],
                                q_norm=stacked["q_norm"], k_norm=stacked["k_norm"]),
            mlp=L.mlp.replace(router=stacked["router"], gate=stacked["gate"], up=stacked["up"],
                              down=stacked["down"]),
        ),
    )
    # Every leaf filled, with the shape and dtype our abstract tree declares.
    for spec, arr in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(weights), strict=True):
        assert not is_spec(arr) and arr.shape == spec.shape and arr.dtype == spec.dtype, (spec, arr.shape)
    return weights


@pytest.fixture(scope="module")
def models():
    model = hf_model()
    return model, weights_from_hf(model)


def _hf_logits(model, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(tokens.astype(np.int64))
    # Every query sees every valid key (padding queries too, as in ours): bidirectional.
    mask4 = torch.from_numpy(np.broadcast_to(valid[:, None, None, :], (len(tokens), 1) + valid.shape[1:] * 2)
                             .copy())
    positions = torch.from_numpy(np.asarray(masks.positions(jnp.asarray(valid))).astype(np.int64))
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask4, position_ids=positions).logits.numpy()


@pytest.mark.parametrize("dispatch", ["dense", "tiled"])
def test_logits_match_transformers_full_mask(models, dispatch: str) -> None:
    model, weights = models
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 24), 0, CFG.vocab_size))
    valid = np.ones(tokens.shape, bool)
    want = _hf_logits(model, tokens, valid)
    apply = jax.jit(lambda w, t: transformer.apply(w, CFG, t, dispatch=dispatch))
    got = np.asarray(apply(weights, jnp.asarray(tokens)))
    assert np.std(want) > 1.0  # peaked logits: a wrong weight would move them far more than 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # bidirectional really: changing the last token changes transformers' first-position logits too
    t2 = tokens.copy()
    t2[:, -1] = (t2[:, -1] + 1) % CFG.vocab_size
    assert np.abs(_hf_logits(model, t2, valid)[:, 0] - want[:, 0]).max() > 1e-3


def test_logits_match_transformers_padded_batch(models) -> None:
    model, weights = models
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (3, 20), 0, CFG.vocab_size))
    valid = np.ones(tokens.shape, bool)
    valid[1, :7] = False  # left padding
    valid[2, 11:] = False  # right padding
    want = _hf_logits(model, tokens, valid)
    got = np.asarray(jax.jit(lambda w, t, v: transformer.apply(w, CFG, t, v))(weights, jnp.asarray(tokens),
                                                                    jnp.asarray(valid)))
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=0)
