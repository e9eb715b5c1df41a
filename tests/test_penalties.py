"""Response-only presence, frequency and repetition penalties (`scoring.penalize`, applied inside the compiled loop):
the repetition penalty is transformers' own `RepetitionPenaltyLogitsProcessor` over the response's tokens, the
presence and frequency penalties OpenAI's formula; the prompt's tokens and masks never count; a penalty is a traced
setting (no recompile), reaches the sampler from a flag and the server from a request field, and the server's rows
give `generate`'s tokens with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import cli
from clover_jax.config import get_config
from clover_jax.model import params
from clover_jax.sampler import SamplerConfig, compile_count, generate
from clover_jax.sampler import settings as S
from clover_jax.sampler.scoring import penalize
from tests.engine_requests import serve, tokens

CFG = get_config("test-clover-prefix", init_std=0.1)


def test_repetition_penalty_is_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 3, 40)).astype(np.float32) * 3
    seen = rng.integers(0, 40, (2, 12))
    got = penalize(jnp.asarray(logits), jnp.asarray(seen), jnp.ones(seen.shape, bool), jnp.float32(0),
                   jnp.float32(0), jnp.float32(1.3))
    proc = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    for pos in range(3):  # transformers scores one position at a time, from the tokens so far
        want = proc(torch.from_numpy(seen), torch.from_numpy(logits[:, pos].copy())).numpy()
        np.testing.assert_allclose(np.asarray(got[:, pos]), want, rtol=1e-6)


def test_presence_and_frequency_are_openais_formula_over_counted_tokens():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 4, 30)).astype(np.float32)
    seen = rng.integers(0, 30, (2, 10))
    counted = rng.random((2, 10)) < 0.6  # only the response's committed tokens count
    got = np.asarray(penalize(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counted),
                              jnp.asarray([0.5, -0.3], jnp.float32), jnp.asarray([0.2, 0.7], jnp.float32),
                              jnp.float32(1.0)))
    want = logits.copy()
    for r, (pres, freq) in enumerate([(0.5, 0.2), (-0.3, 0.7)]):
        counts = np.bincount(seen[r][counted[r]], minlength=30)
        want[r] -= counts * freq + (counts > 0) * pres  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_pres
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    off = penalize(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(counted), 0.0, 0.0, 1.0)
    np.testing.assert_array_equal(np.asarray(off), logits)


def test_penalties_change_generation_without_recompiling():
    w = params.init(CFG, jax.random.key(0))
    base = SamplerConfig(gen_length=24, block_length=8, eos_stop=False)
    plain = generate(w, CFG, [[5, 9, 17]], base, dispatch="dense")
    before = compile_count()
    hot = generate(w, CFG, [[5, 9, 17]], base.replace(repetition_penalty=5.0, frequency_penalty=1.0), dispatch="dense")
    assert compile_count() == before
    assert hot.raw.tolist() != plain.raw.tolist()
    repeats = lambda r: len(r) - len(set(r))
    assert repeats(hot.raw[0].tolist()) < repeats(plain.raw[0].tolist())


class Prefers40:
    """A scripted model: token 40 (logit 1) over 41 (logit 0) over everything else (-10), at every position."""

    def __call__(self, weights, tokens, positions, mask, cache, offset, logits_start, logits_len, **kw):
        row = jnp.full((CFG.vocab_size,), -10.0).at[40].set(1.0).at[41].set(0.0)
        return jnp.broadcast_to(row, (tokens.shape[0], logits_len, CFG.vocab_size)), None


def test_only_the_response_counts():
    """The prompt holds 40 twice: with presence 2 the first token is still 40 (the prompt does not count), the next
    one 41 (40 is in the response now: 1 - 2 < 0), then 40 again and again (both counted: -1 > -2)."""
    cfg = get_config("test-clover")
    sc = SamplerConfig(gen_length=4, block_length=4, steps=4, cache="none", eos_stop=False, presence_penalty=2.0)
    got = generate(None, cfg, [[40, 7, 40]], sc, forward_fn=Prefers40())
    assert got.raw[0].tolist() == [40, 41, 40, 40]
    assert generate(None, cfg, [[40, 7, 40]], sc.replace(presence_penalty=0.0), forward_fn=Prefers40()
                    ).raw[0].tolist() == [40] * 4


def test_penalties_from_flags_and_requests(capsys):
    parser = cli.build_parser()
    sc = S.from_flags(parser.parse_args(["generate", "x", "--repetition-penalty", "1.2", "--presence-penalty",
                                         "0.5", "--frequency-penalty", "-0.5"]))
    assert (sc.repetition_penalty, sc.presence_penalty, sc.frequency_penalty) == (1.2, 0.5, -0.5)
    assert cli.main(["generate", "x", "--model", "test-clover", "--presence-penalty", "3"]) == 2
    assert "--presence-penalty must be a number in [-2, 2], got 3.0" in capsys.readouterr().err
    assert {"presence_penalty", "frequency_penalty", "repetition_penalty"} <= set(S.REQUEST_NAMES.values())


def test_the_server_penalizes_as_generate_does():
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request

    w = params.init(CFG, jax.random.key(0))
    eng = Engine(w, CFG, block_length=8, max_prompt=8, max_tokens=24, batch_sizes=(2,), dispatch="dense")
    reqs = [Request((5, 9, 17), 24, SamplerConfig(eos_stop=False, repetition_penalty=5.0, presence_penalty=1.0)),
            Request((7, 8), 24, SamplerConfig(eos_stop=False))]
    events = serve(eng, reqs, drain=True)
    for i, r in enumerate(reqs):
        got = tokens(events[i])
        assert got == generate(w, CFG, [list(r.prompt)], r.row_settings(8), dispatch="dense").raw[0].tolist(), i
