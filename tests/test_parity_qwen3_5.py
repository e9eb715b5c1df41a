"""The hybrid backbone against transformers' own Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, pure-torch Gated
DeltaNet): a tiny random model saved with `save_pretrained`, converted with `clover convert`, run here.
Logits agree to 1e-4 in float32, also for a left-padded batch; the export back to HF is bit-exact.

The weight scale (initializer_range 0.08) keeps the 8-layer model well conditioned: at 0.2 transformers'
own float32 logits are 4e-4 away from its float64 ones, and no float32 implementation could be held
to 1e-4 (measured; here ours and transformers' float32 both stay within 4e-5 of its float64)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity with transformers needs torch (pip install '.[torch]')")
transformers = pytest.importorskip("transformers", reason="parity needs transformers (pip install '.[torch]')")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("this transformers has no Qwen3_5MoeForCausalLM (5.x has it)", allow_module_level=True)

from safetensors.numpy import load_file  # noqa: E402

from clover_jax.checkpoint import load_model  # noqa: E402
from clover_jax.convert import convert  # noqa: E402
from clover_jax.model import masks, transformer  # noqa: E402

MASK_ID = 255


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf_cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, rms_norm_eps=1e-6,
        max_position_embeddings=512, initializer_range=0.08, eos_token_id=1, pad_token_id=0,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # every norm and decay parameter away from its init, so a mixed-up one shows
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))  # the plain (w * x) norm
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))  # (1 + w) norms
            elif name.endswith(("dt_bias", "A_log")):
                p.copy_(0.5 * torch.randn_like(p))
    work = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(work / "hf")
    native = convert(str(work / "hf"), str(work / "native"), mask_token_id=MASK_ID, progress=False)
    cfg, weights = load_model(native)
    return model, cfg, weights, work


def _hf_logits(model, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    positions = np.asarray(masks.positions(jnp.asarray(valid))).astype(np.int64)
    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                     attention_mask=torch.from_numpy(valid.astype(np.int64)),
                     position_ids=torch.from_numpy(positions)).logits.numpy()


def test_converted_config(models):
    _, cfg, _, _ = models
    assert cfg.family == "qwen3_5_moe" and cfg.is_hybrid and cfg.layer_group == (
        "linear_attention", "linear_attention", "linear_attention", "full_attention")
    assert (cfg.n_linear_layers, cfg.n_attention_layers, cfg.rotary_dim) == (6, 2, 4)
    assert cfg.norm_unit_offset and cfg.shared_expert_gate and cfg.attn_output_gate and cfg.mask_token_id == MASK_ID


@pytest.mark.parametrize(("length", "recurrent_max"), [(24, 256), (80, 64)])  # (80, 64): chunked, short last chunk
def test_logits_match_transformers(models, length, recurrent_max, monkeypatch):
    from clover_jax.model import delta_rule

    monkeypatch.setattr(delta_rule, "RECURRENT_MAX", recurrent_max)  # read while tracing
    model, cfg, weights, _ = models
    tokens = np.asarray(jax.random.randint(jax.random.key(length), (2, length), 2, cfg.vocab_size))
    valid = np.ones(tokens.shape, bool)
    want = _hf_logits(model, tokens, valid)
    got = np.asarray(jax.jit(lambda w, t: transformer.apply(w, cfg, t, dispatch="dense"))(weights, tokens))
    assert np.std(want) > 0.5  # spread-out logits: a wrong weight would move them far more than 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # causal really: changing the last token leaves every earlier position's logits alone
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab_size
    again = np.asarray(transformer.apply(weights, cfg, jnp.asarray(changed), dispatch="dense"))
    np.testing.assert_allclose(again[:, :-1], got[:, :-1], atol=1e-5)
    assert np.abs(again[:, -1] - got[:, -1]).max() > 1e-3


def test_left_padded_batch_matches_transformers(models):
    model, cfg, weights, _ = models
    tokens = np.array(jax.random.randint(jax.random.key(7), (3, 20), 2, cfg.vocab_size))
    valid = np.ones(tokens.shape, bool)
    valid[1, :7] = False
    valid[2, :3] = False
    tokens[~valid] = 0
    want = _hf_logits(model, tokens, valid)
    got = np.asarray(jax.jit(lambda w, t, v: transformer.apply(w, cfg, t, v, dispatch="tiled"))(
        weights, jnp.asarray(tokens), jnp.asarray(valid)))
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=0)
    # the public forward with `valid` alone derives the positions and the mask from it
    import clover_jax

    alone_valid = np.asarray(clover_jax.forward(weights, cfg, jnp.asarray(tokens), valid=jnp.asarray(valid),
                                                dispatch="tiled").logits)
    np.testing.assert_allclose(alone_valid[valid], want[valid], atol=1e-4, rtol=0)
    # a padded row equals the same tokens unpadded
    alone = np.asarray(transformer.apply(weights, cfg, jnp.asarray(tokens[1:2, 7:]), dispatch="tiled"))
    np.testing.assert_allclose(got[1, 7:], alone[0], atol=1e-4)


def test_export_back_to_hf_is_bit_exact(models):
    _, _, _, work = models
    out = convert(str(work / "native"), str(work / "hf-again"), progress=False)
    original = {}
    for f in sorted((work / "hf").glob("*.safetensors")):
        original.update(load_file(f))
    again = {}
    for f in sorted((work / "hf-again").glob("*.safetensors")):
        again.update(load_file(f))
    assert sorted(again) == sorted(original)
    for key, a in original.items():
        assert again[key].dtype == a.dtype and np.array_equal(again[key], a), key
    hf_cfg = json.loads((work / "hf" / "config.json").read_text())
    assert json.loads((work / "hf-again" / "config.json").read_text()) == hf_cfg and out


def test_text_rope_is_plain_partial_rope(models):
    """transformers' Qwen3.5 RoPE has three position rows (time, height, width; multi-section for images).
    For text all three rows are the token position, and then it is exactly partial rotate-half RoPE over the
    first rotary_dim dims, which is what the model here implements; distinct rows (image positions) are not."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    from clover_jax.model import layers

    model, cfg, _, _ = models
    x = torch.randn(2, 10, cfg.n_heads, cfg.head_dim)
    pos = torch.arange(3, 13)[None].repeat(2, 1)
    cos, sin = model.model.rotary_emb(x, pos)  # expands the 2-D positions to three equal rows
    want, _ = modeling.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    got = layers.rope(jnp.asarray(x.numpy()), jnp.asarray(pos.numpy()), cfg.rope_theta, cfg.rotary_dim)
    np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), atol=1e-5)
    rows = torch.stack([pos, pos + 1, pos + 2])  # distinct rows: a different rotation
    cos3, _ = model.model.rotary_emb(x, rows)
    assert not torch.allclose(cos3, cos)


def _as_clover(cfg, weights):
    """The same backbone as Clover as its ports run it (`bd_gdn="causal_prefix"`, blocks of 8): Clover's four
    block-diffusion tensors added (random, large enough to show if they leaked into clean text)."""
    from clover_jax.model import params

    clover = cfg.replace(family="clover", bd_gdn="causal_prefix", bd_conv_right_kernel=3, block_size=8)
    bd = params.init(clover.replace(init_std=0.5), jax.random.key(3)).linear_layers.attn
    attn = weights.linear_layers.attn.replace(conv_right=bd.conv_right, bd_logit_scale=bd.bd_logit_scale + 2,
                                              bd_history_bias=bd.bd_history_bias + 1, bd_history_c=bd.bd_history_c + 1)
    return clover, weights.replace(linear_layers=weights.linear_layers.replace(attn=attn))


# (80, 64): 80 positions through eight float32 layers whose norms are far from their init. Measured against
# transformers in float64 (eager experts): transformers' float32 forward is 5.4e-5 away, ours 1.4e-4 (recurrent delta
# rule) / 1.6e-4 (chunked), so the two float32 forwards differ by 1.05e-4 here and 1.27e-4 on another CPU kind.
@pytest.mark.parametrize(("length", "recurrent_max", "atol"), [(24, 256, 1e-4), (80, 64, 2e-4)])
def test_clover_clean_text_is_transformers_causal_model(models, length, recurrent_max, atol, monkeypatch):
    """Clover as its ports run it scores clean text through the causal Qwen3.5 path: its logits are transformers'
    Qwen3_5MoeForCausalLM's on the same weights with the block-diffusion tensors dropped (what llama.cpp loads and
    cortiq's commits and `ppl` run), within 1e-4 (2e-4 over 80 positions), a left-padded batch included."""
    from clover_jax.model import delta_rule

    monkeypatch.setattr(delta_rule, "RECURRENT_MAX", recurrent_max)
    model, cfg, weights, _ = models
    clover, cw = _as_clover(cfg, weights)
    tokens = np.array(jax.random.randint(jax.random.key(length + 1), (3, length), 2, cfg.vocab_size))
    valid = np.ones(tokens.shape, bool)
    valid[1, :7] = False
    tokens[~valid] = 0
    want = _hf_logits(model, tokens, valid)
    got = np.asarray(jax.jit(lambda w, t, v: transformer.apply(w, clover, t, v, dispatch="dense"))(
        cw, jnp.asarray(tokens), jnp.asarray(valid)))
    np.testing.assert_allclose(got[valid], want[valid], atol=atol, rtol=0)
    earlier = np.asarray(transformer.apply(cw, clover.replace(bd_gdn="reconstructed"), jnp.asarray(tokens),
                                           jnp.asarray(valid), dispatch="dense"))
    assert np.abs(earlier[valid] - want[valid]).max() > 1e-2  # the earlier block-causal reading does not


def test_clover_likelihood_is_transformers_exact_log_likelihood(models):
    """lm-eval's likelihoods of Clover as its ports run it are exact: the causal model's log p(answer | prompt), as
    transformers computes it, not a Monte-Carlo bound."""
    from clover_jax.evaluation.likelihood import exact

    model, cfg, weights, _ = models
    clover, cw = _as_clover(cfg, weights)
    prompt, answer = [5, 17, 99, 3, 42, 8], [77, 12, 200, 31, 9]
    tokens = np.asarray([prompt + answer])
    logp = torch.log_softmax(torch.from_numpy(_hf_logits(model, tokens, np.ones(tokens.shape, bool))), -1).numpy()
    want = sum(logp[0, len(prompt) - 1 + i, a] for i, a in enumerate(answer))
    got = exact(cw, clover, prompt, answer, dispatch="dense")
    assert got.stderr == 0 and got.samples == 1
    np.testing.assert_allclose(got.mean, want, atol=1e-3)
    greedy: list[int] = []  # transformers' own greedy continuation, one token at a time
    for _ in answer:
        ids = np.asarray([prompt + greedy])
        greedy.append(int(_hf_logits(model, ids, np.ones(ids.shape, bool))[0, -1].argmax()))
    assert exact(cw, clover, prompt, greedy, dispatch="dense").greedy and not got.greedy


def test_self_speculative_is_transformers_greedy_generate(models):
    """Self-speculative decoding (the block diffusion drafts, the causal model accepts) and causal decoding (one
    token a pass) write exactly what transformers' greedy `generate` of the Qwen3.5 model writes on the same
    weights, a left-padded prompt bucket included."""
    from clover_jax.sampler import SamplerConfig, generate

    model, cfg, weights, _ = models
    clover, cw = _as_clover(cfg, weights)
    prompt = [5, 17, 99, 3, 42, 8, 11]
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0).numpy()[0, len(prompt):]
    sc = SamplerConfig(gen_length=24, block_length=8, eos_stop=False, self_speculative=True, threshold=0.5)
    got = generate(cw, clover, [prompt], sc, dispatch="dense")
    np.testing.assert_array_equal(got.raw[0, :20], want)
    assert got.stats.tokens == 24 and got.stats.nfe > 0
    # causal decoding: the same text one token a pass (after one pass over the prompt but its last token)
    causal = generate(cw, clover, [prompt], sc.replace(self_speculative=False, causal=True), dispatch="dense")
    np.testing.assert_array_equal(causal.raw[0, :20], want)
    assert causal.stats.tokens == 24 and causal.stats.nfe == 24 + 1
