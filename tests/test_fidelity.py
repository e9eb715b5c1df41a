"""The rules where the reference generators and modeling code decide, checked without them: config fields
read from the checkpoint or the family's own defaults, LLaDA2's top-1 routing weight, filters at
temperature 0, the confidence rule at temperature > 0, the mask token never drawn, the absolute block
grid's layout, a model without an end token, and the `clover generate --dispatch` flag.
(The recorded outputs of the reference code itself are checked in test_reference_fixtures.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.convert import FAMILIES
from clover_jax.errors import ConversionError
from clover_jax.model import params
from clover_jax.model.moe import route
from clover_jax.sampler import SamplerConfig, generate, prepare_batch
from clover_jax.sampler.scoring import sample, score_tokens

# ---- config fields ------------------------------------------------------------------------------------


def _llada2_hf(**changes):
    hf = {"model_type": "llada2_moe", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mask_token_id": 257, "eos_token_id": 256}
    hf.update(changes)
    return {k: v for k, v in hf.items() if v is not ...}


def test_llada2_reads_mask_token_and_takes_its_config_class_defaults():
    conv = FAMILIES["llada2_moe"]
    cfg = conv.config_from_hf(_llada2_hf(), "m", "float32", None)
    assert (cfg.mask_token_id, cfg.eos_token_id) == (257, 256)  # from config.json, not 156895 / 156892
    # LLaDA2MoeConfig's own defaults for what config.json leaves out
    assert (cfg.n_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor, cfg.norm_eps) == (8, 4, 2.5, 1e-5)
    assert (cfg.partial_rotary_factor, cfg.max_seq_len, cfg.rope_theta) == (0.5, 16384, 10000.0)
    assert cfg.pad_token_id is None  # the class default 126081 lies outside this vocabulary: no pad token
    assert conv.config_from_hf(_llada2_hf(), "m", "float32", 3).mask_token_id == 3  # the flag wins
    # no mask token in config.json and LLaDA2's 156895 outside the vocabulary: refused, naming the flag
    with pytest.raises(ConversionError,
                       match=r"no mask_token_id and LLaDA2's 156895 is not in the vocabulary of 300; pass --mask"):
        conv.config_from_hf(_llada2_hf(mask_token_id=...), "m", "float32", None)
    # an explicit null end token stays "no EOS"
    assert conv.config_from_hf(_llada2_hf(eos_token_id=None), "m", "float32", None).eos_token_id is None


def test_qwen3_moe_without_eos_converts_to_no_eos():
    hf = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "eos_token_id": None, "pad_token_id": None}
    cfg = FAMILIES["qwen3_moe"].config_from_hf(hf, "q", "float32", None)
    assert (cfg.eos_token_id, cfg.pad_token_id) == (None, None)  # not 1 / 0: real vocabulary ids
    assert (cfg.norm_topk_prob, cfg.max_seq_len, cfg.norm_eps) == (False, 32768, 1e-6)  # Qwen3MoeConfig's
    out = FAMILIES["qwen3_moe"].config_to_hf(cfg)
    assert out["eos_token_id"] is None and out["pad_token_id"] is None


def test_llada2_top1_weight_is_not_renormalised():
    """LLaDA2's gate: top-1 weight = sigmoid(logit) * routed_scaling_factor; top-k > 1 renormalised."""
    conv = FAMILIES["llada2_moe"]
    hf = _llada2_hf(num_experts_per_tok=1, n_group=1, topk_group=1)
    cfg = conv.config_from_hf(hf, "m", "float32", None)
    assert not cfg.norm_topk_prob
    w = params.abstract(cfg)
    rng = np.random.default_rng(0)
    router = jnp.asarray(rng.standard_normal((cfg.d_model, cfg.n_experts)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, cfg.d_model)), jnp.float32)
    moe = w.moe_layers.mlp.replace(router=router, expert_bias=jnp.zeros(cfg.n_experts))
    r = route(x, moe, cfg)
    logits = np.asarray(x @ router)
    want = 2.5 / (1 + np.exp(-logits.max(-1)))
    np.testing.assert_allclose(np.asarray(r.weights)[:, 0], want, rtol=1e-6)
    assert conv.config_to_hf(cfg)["norm_topk_prob"] is False
    two = conv.config_from_hf(_llada2_hf(), "m", "float32", None)
    assert two.norm_topk_prob
    r2 = route(x, moe, two.replace(n_expert_groups=1, topk_groups=1))
    np.testing.assert_allclose(np.asarray(r2.weights).sum(-1), 2.5, rtol=1e-6)


# ---- draws and confidence -----------------------------------------------------------------------------


def _knobs(t=0.0, k=0, p=1.0, sampled=False):
    return jnp.float32(t), jnp.int32(k), jnp.float32(p), jnp.bool_(sampled)


def test_filters_do_not_change_greedy_confidence_and_the_mask_is_never_drawn():
    logits = jnp.log(jnp.array([[[0.5, 0.2, 0.3], [0.1, 0.2, 0.7]]]))  # mask id 2 is the argmax of row 1
    t, k, p, s = _knobs(0.0, 1, 0.5, True)
    tokens, dist = sample(logits, jax.random.key(0), t, k, p, 2, s)
    assert np.asarray(tokens).tolist() == [[0, 1]]  # the mask token is skipped, the next best drawn
    conf = score_tokens(dist, tokens, jnp.int32(0), jax.random.key(1)).confidence
    # the model's own probabilities, unfiltered (top-k 1 would make every confidence 1.0)
    np.testing.assert_allclose(np.asarray(conf), [[0.5, 0.2]], rtol=1e-6)


def test_confidence_rule_at_temperature():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 6, 9)) * 2, jnp.float32)
    t, k, p, _ = _knobs(0.7, 4, 0.9)
    key = jax.random.key(3)
    tok_l, dist_l = sample(logits, key, t, k, p, 8, jnp.bool_(False))
    tok_s, dist_s = sample(logits, key, t, k, p, 8, jnp.bool_(True))
    assert np.array_equal(tok_l, tok_s)  # the rule changes the scores, never the draw
    np.testing.assert_array_equal(dist_l, logits)  # "logits": the model at temperature 1
    # "sampling": temperature first, then top-k, then top-p (transformers' / LLaDA2's order)
    x = np.asarray(logits) / 0.7
    x[..., 8] = -np.inf
    kth = np.sort(x, -1)[..., -4][..., None]
    x = np.where(x >= kth, x, -np.inf)
    pr = np.exp(x - x.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    order = np.argsort(-pr, -1)
    srt = np.take_along_axis(pr, order, -1)
    keep_sorted = (np.cumsum(srt, -1) - srt) < 0.9
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    np.testing.assert_array_equal(np.isfinite(np.asarray(dist_s)), keep)
    assert np.isfinite(np.take_along_axis(np.asarray(dist_s), np.asarray(tok_s)[..., None], -1)).all()


@pytest.fixture(scope="module")
def llada2():
    cfg = get_config("test-llada2", init_std=0.1)
    return cfg, params.init(cfg, jax.random.key(0))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]  # 13 tokens: not a multiple of the block of 8


def test_top_k_at_temperature_zero_changes_nothing(llada2):
    cfg, w = llada2
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16, eos_stop=False, cache="none", threshold=0.9)
    a = generate(w, cfg, PROMPTS, sc)
    b = generate(w, cfg, PROMPTS, sc.replace(top_k=1, top_p=0.5))
    np.testing.assert_array_equal(a.raw, b.raw)
    assert a.stats.nfe == b.stats.nfe > 2  # a top-k of 1 used to commit whole blocks in one pass


# ---- the absolute block grid -------------------------------------------------------------------------


def test_absolute_grid_layout():
    cfg = get_config("test-llada2")
    b = prepare_batch([list(range(10, 23)), list(range(30, 46))], 8, cfg, 16, block_grid="absolute")
    assert b.prompt.shape == (2, 16) and b.start.shape == (2, 24)  # one block more for the 5-token tail
    assert b.lengths.tolist() == [8, 16] and b.tail.tolist() == [5, 0]
    assert b.start[0, :5].tolist() == list(range(18, 23)) and (b.start[0, 5:] == cfg.mask_token_id).all()
    assert (b.start[1] == cfg.mask_token_id).all()
    # the prompt grid keeps every prompt token in the prompt columns
    p = prepare_batch([list(range(10, 23))], 8, cfg, 16, block_grid="prompt")
    assert p.prompt.shape == (1, 16) and p.start.shape == (1, 16) and p.tail.tolist() == [0]


def test_absolute_grid_is_the_llada2_default_and_equals_prompt_grid_on_whole_blocks(llada2):
    cfg, w = llada2
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16, eos_stop=False, cache="none")
    whole = [list(range(5, 21))]  # 16 tokens: both grids lay the same blocks
    np.testing.assert_array_equal(generate(w, cfg, whole, sc.replace(block_grid="absolute")).raw,
                                  generate(w, cfg, whole, sc.replace(block_grid="prompt")).raw)
    auto = generate(w, cfg, PROMPTS, sc)
    absolute = generate(w, cfg, PROMPTS, sc.replace(block_grid="absolute"))
    np.testing.assert_array_equal(auto.raw, absolute.raw)
    assert auto.raw.shape == (1, 16) and auto.stats.tokens == 19  # 3 closing the prompt's block, then 16
    # the prompt grid completes no prompt block: a different canvas, and here different tokens
    assert not np.array_equal(generate(w, cfg, PROMPTS, sc.replace(block_grid="prompt")).raw, auto.raw)


# ---- no end token --------------------------------------------------------------------------------------


def test_model_without_eos_never_stops(llada2):
    cfg, w = llada2
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16, cache="none", block_grid="prompt")
    ref = generate(w, cfg, PROMPTS, sc.replace(eos_stop=False))
    eos = int(ref.raw[0, 3])  # make a token the model writes early the end token ...
    with_eos = generate(w, cfg.replace(eos_token_id=eos), PROMPTS, sc)
    assert with_eos.finished == [True] and len(with_eos.tokens[0]) <= 3
    none = generate(w, cfg.replace(eos_token_id=None), PROMPTS, sc)  # ... or have none at all
    assert none.finished == [False] and none.tokens[0] == ref.raw[0].tolist()


# ---- the CLI -------------------------------------------------------------------------------------------


def test_generate_dispatch_and_rule_flags(capsys):
    assert main(["generate", "x", "--model", "test-llada2", "--dispatch", "bogus"]) == 2
    assert "--dispatch: unknown MoE dispatch 'bogus'" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "test-llada2", "--block-grid", "diagonal"]) == 2
    assert "error: --block-grid must be one of auto, prompt, absolute, got 'diagonal'" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "test-llada2", "--confidence", "vibes"]) == 2
    assert "error: --confidence must be one of auto, logits, sampling, got 'vibes'" in capsys.readouterr().err
    assert main(["generate", "ab", "--model", "test-llada2", "--dispatch", "dense", "--gen-length", "8",
                 "--block-length", "8", "--block-grid", "absolute", "--confidence", "logits"]) == 0
    assert "forward passes" in capsys.readouterr().err
