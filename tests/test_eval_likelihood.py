"""The masked-diffusion likelihood estimator against LLaDA's `get_log_likelihood`, and its own contracts.

tests/fixtures/eval_reference/ holds what LLaDA's algorithm (a torch transcription, see make_fixture.py there)
computed on transformers' Qwen3-MoE with a full attention mask, with its mask draws. With the same draws our
estimator on the converted checkpoint gives the same per-sample losses and value within 1e-4; with independent
draws the two estimates agree within their standard errors.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import checkpoint
from clover_jax.convert import convert
from clover_jax.evaluation import EvaluationError, estimate, likelihood, llada_draws
from clover_jax.evaluation.likelihood import seq_bucket
from clover_jax.model import masks
from clover_jax.model.transformer import forward

HERE = Path(__file__).parent / "fixtures"
INFO = json.loads((HERE / "eval_reference" / "llada_loglik.json").read_text())
DATA = np.load(HERE / "eval_reference" / "llada_loglik.npz")


@cache
def _model(root: str):
    dst = Path(root) / "qwen3_moe_tiny"
    convert(str(HERE / "reference" / "qwen3_moe_tiny"), str(dst), progress=False)
    return checkpoint.load_model(str(dst))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    cfg, w = _model(str(tmp_path_factory.mktemp("eval")))
    assert cfg.mask_token_id == INFO["mask_id"] and not cfg.is_block_causal
    return cfg, w


def scenario(name: str) -> tuple[dict, list[int], list[int], np.ndarray]:
    s = INFO["scenarios"][name]
    draws = np.unpackbits(DATA[f"{name}_draws"], axis=1, count=s["answer_len"]).astype(bool)
    return s, DATA[f"{name}_prompt"].tolist(), DATA[f"{name}_answer"].tolist(), draws


@pytest.mark.parametrize("name", ["plain", "cfg", "long_answer"])
def test_same_draws_same_value_as_llada(model, name):
    cfg, w = model
    s, prompt, answer, draws = scenario(name)
    rows = []  # the per-sample losses of each compiled pass, as `estimate` computed them
    real = likelihood.sample_losses

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        rows.append(np.asarray(out[0], np.float64))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(likelihood, "sample_losses", recording)
        est = estimate(w, cfg, prompt, answer, batch_size=s["batch_size"], cfg_scale=s["cfg_scale"], draws=draws)
    assert est.samples == s["mc_num"]
    assert abs(est.mean - s["value"]) < 1e-4 * max(1.0, abs(s["value"]) / 100)
    want = DATA[f"{name}_losses"].astype(np.float64)
    # Sample by sample the losses LLaDA's algorithm recorded on the same draws (float32 on both sides: measured
    # at most 6.4e-7 relative; the losses are 38..225 nats).
    np.testing.assert_allclose(np.concatenate(rows), want, rtol=1e-5, atol=0)
    assert abs(est.stderr - want.std(ddof=1) / np.sqrt(len(want))) < 1e-4


def test_independent_draws_agree_within_standard_errors(model):
    cfg, w = model
    s, prompt, answer, _ = scenario("many")
    theirs = DATA["many_losses"].astype(np.float64)
    their_se = theirs.std(ddof=1) / np.sqrt(len(theirs))
    ours = estimate(w, cfg, prompt, answer, mc_num=128, batch_size=16, seed=7)
    assert ours.stderr > 0
    assert abs(ours.mean - s["value"]) < 4 * np.hypot(ours.stderr, their_se)


def test_draws_follow_llada():
    d = llada_draws(np.random.default_rng(0), 9, 32, 8)
    assert d.shape == (32, 9) and d.any(1).all()
    for batch in d.reshape(4, 8, 9):  # stratified: counts spread evenly over 1..L from one start
        counts = np.sort(batch.sum(1))
        assert counts.min() >= 1 and counts.max() <= 9 and len(set(counts.tolist())) >= 5
    with pytest.raises(EvaluationError, match="multiple"):
        llada_draws(np.random.default_rng(0), 9, 30, 8)
    with pytest.raises(EvaluationError, match="empty"):
        llada_draws(np.random.default_rng(0), 0, 8, 8)
    assert [seq_bucket(n) for n in (1, 32, 33, 100)] == [32, 32, 64, 128]


def test_padding_and_seed(model):
    cfg, w = model
    _, prompt, answer, draws = scenario("plain")
    a = estimate(w, cfg, prompt, answer, batch_size=8, draws=draws)
    b = estimate(w, cfg, prompt, answer, batch_size=8, draws=draws, min_len=64)  # left padding changes nothing
    assert abs(a.mean - b.mean) < 1e-4
    # seed=3 means LLaDA's draws from default_rng(3); a different seed draws differently
    c = estimate(w, cfg, prompt, answer, mc_num=16, batch_size=8, seed=3, check_greedy=True)
    d = estimate(w, cfg, prompt, answer, batch_size=8, draws=llada_draws(np.random.default_rng(3), len(answer), 16, 8))
    assert abs(c.mean - d.mean) < 1e-4 and abs(c.stderr - d.stderr) < 1e-4 and c.samples == 16
    assert abs(estimate(w, cfg, prompt, answer, mc_num=16, batch_size=8, seed=4).mean - c.mean) > 1e-2
    # greedy: the argmax fill of the fully masked answer, from one forward pass of the model here. A random answer
    # is not it; the answer made of those argmaxes is (the fully masked input is the same for both answers).
    seq = jnp.asarray([prompt + [cfg.mask_token_id] * len(answer)], jnp.int32)
    valid = jnp.ones(seq.shape, bool)
    logits = forward(w, cfg, seq, masks.positions(valid), masks.full_mask(cfg, valid), valid=valid).logits
    fill = np.asarray(jnp.argmax(logits[0, len(prompt):], -1)).tolist()
    assert fill != answer and c.greedy is False
    assert estimate(w, cfg, prompt, fill, mc_num=8, batch_size=8, check_greedy=True).greedy is True
    wrong = [*fill[:-1], (fill[-1] + 1) % cfg.vocab_size]
    assert estimate(w, cfg, prompt, wrong, mc_num=8, batch_size=8, check_greedy=True).greedy is False
    with pytest.raises(EvaluationError, match="empty"):
        estimate(w, cfg, prompt, [], mc_num=8, batch_size=8)
