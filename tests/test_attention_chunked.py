"""Chunked attention (`model.layers.attend_chunked`): query and key chunks with an online softmax, equal to the
dense form in float32 (values and gradients, GQA, block-causal and padded masks, a query that sees no key, lengths
that are not whole chunks), through the whole model and the sampler, and holding far less memory at a long
prompt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import model
from clover_jax.config import get_config
from clover_jax.errors import ConfigError
from clover_jax.model import layers, masks, params
from clover_jax.sampler import SamplerConfig, generate


def _qkv(tq, tk, h=4, kv=2, hd=16, b=2, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.standard_normal(s, np.float32)) for s in ((b, tq, h, hd), (b, tk, kv, hd),
                                                                         (b, tk, kv, hd)))


def _random_mask(b, tq, tk, seed=1):
    m = np.random.default_rng(seed).random((b, tq, tk)) < 0.6
    m[0, 3] = False  # a query that may see no key: both forms average every value
    return jnp.asarray(m)


@pytest.mark.parametrize("tq, tk, chunk", [(37, 53, 8), (16, 16, 16), (5, 70, 32), (64, 64, 7)])
def test_chunked_equals_dense(tq, tk, chunk):
    q, k, v = _qkv(tq, tk)
    mask = _random_mask(2, tq, tk)
    dense = layers.attend(q, k, v, mask, "dense")
    chunked = layers.attend(q, k, v, mask, "chunked", chunk)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(dense), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked[0, 3]), np.asarray(v[0].mean(0).repeat(2, axis=0)), atol=1e-5)


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_chunked_equals_dense_on_the_models_masks(attention):
    cfg = get_config("test-clover").replace(attention=attention, block_size=8)
    valid = jnp.asarray(np.arange(40)[None] >= np.array([[0], [11]]))  # the second row left-padded
    mask = masks.full_mask(cfg, valid)
    q, k, v = _qkv(40, 40)
    np.testing.assert_allclose(np.asarray(layers.attend(q, k, v, mask, "chunked", 16)),
                               np.asarray(layers.attend(q, k, v, mask, "dense")), atol=1e-5, rtol=1e-5)


def test_chunked_gradients_equal_dense():
    q, k, v = _qkv(29, 29, seed=3)
    mask = _random_mask(2, 29, 29, seed=4)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((2, 29, 4, 16), np.float32))

    def loss(impl):
        return lambda q, k, v: (layers.attend(q, k, v, mask, impl, 8) * w).sum()

    dense = jax.grad(loss("dense"), argnums=(0, 1, 2))(q, k, v)
    chunked = jax.grad(loss("chunked"), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(chunked, dense, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_auto_chunks_long_windows_and_narrow_windows_of_a_batch_against_many_keys():
    def walks(tq, tk, b=1):
        q, k, v = _qkv(tq, tk, b=b)
        jaxpr = str(jax.make_jaxpr(lambda q, k, v: layers.attend(q, k, v, jnp.ones((b, tq, tk), bool), "auto",
                                                                   8))(q, k, v))
        return "scan" in jaxpr

    assert walks(16, 16) and not walks(8, 64) and not walks(64, 8)  # chunk 8: both longer / queries / keys short
    # a narrow window against many keys: chunked once all rows' scores cover more than 8 chunk x chunk squares
    assert walks(8, 72) and not walks(4, 128) and walks(4, 128, b=2) and not walks(16, 8, b=8)
    assert layers.chunks_attention("auto", 8, 512, 32768, 1024)  # 8 rows' prefill windows against a 32K cache
    assert not layers.chunks_attention("auto", 1, 32, 131072, 1024)  # a block pass at 128K stays dense


def _model(impl):
    cfg = get_config("test-clover").replace(dtype="float32", attention_impl=impl, attention_chunk=8)
    return cfg, params.init(cfg, jax.random.key(0))


def test_the_model_and_the_sampler_give_the_same_results_chunked():
    (dense_cfg, weights), (chunked_cfg, _) = _model("dense"), _model("chunked")
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, 200, (2, 40)))
    np.testing.assert_allclose(np.asarray(model.apply(weights, chunked_cfg, tokens)),
                               np.asarray(model.apply(weights, dense_cfg, tokens)), atol=1e-4, rtol=1e-5)
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    a = generate(weights, dense_cfg, prompts, sc)
    b = generate(weights, chunked_cfg, prompts, sc)
    assert a.tokens == b.tokens and a.stats.nfe == b.stats.nfe


def test_a_long_prompt_holds_a_fraction_of_the_dense_scores():
    t, chunk = 2048, 256
    q, k, v = _qkv(t, t, h=8, kv=2, hd=32, b=1)
    mask = jnp.tril(jnp.ones((1, t, t), bool))

    def temp_bytes(impl):
        compiled = jax.jit(lambda q, k, v, m: layers.attend(q, k, v, m, impl, chunk)).lower(q, k, v, mask).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    dense_scores = 8 * t * t * 4  # [H, T, T] float32
    assert temp_bytes("dense") >= dense_scores
    assert temp_bytes("chunked") < dense_scores / 8


def test_a_bad_attention_setting_is_named():
    with pytest.raises(ConfigError, match="attention_impl must be one of"):
        get_config("test-clover").replace(attention_impl="flash")
    with pytest.raises(ConfigError, match="attention_chunk must be >= 1"):
        get_config("test-clover").replace(attention_chunk=0)


def test_the_flags_reach_the_model_and_keep_the_text(capsys, monkeypatch):
    from clover_jax import cli
    from clover_jax.commands.memory_flags import with_memory_flags

    cfg = get_config("test-clover")
    for command in ("generate", "serve"):
        args = cli.build_parser().parse_args([command, *(["x"] if command == "generate" else []), "--attention",
                                              "chunked", "--attention-chunk", "8"])
        got = with_memory_flags(cfg, args)
        assert (got.attention_impl, got.attention_chunk) == ("chunked", 8)
    assert with_memory_flags(cfg, cli.build_parser().parse_args(["generate", "x"])) is cfg
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--attention-chunk", "0"])
    prompt = "ROMEO: " + "What light through yonder window breaks? " * 3  # longer than a chunk of 8
    chunks = []  # the chunk sizes chunked attention was traced with
    real = layers.attend_chunked

    def counted(q, k, v, mask, chunk, **kw):
        chunks.append(chunk)
        return real(q, k, v, mask, chunk, **kw)

    monkeypatch.setattr(layers, "attend_chunked", counted)
    texts = []
    for extra in ([], ["--attention", "chunked", "--attention-chunk", "8"]):
        assert cli.main(["--compile-cache", "off", "generate", prompt, "--gen-length", "32", "--temperature", "0",
                         *extra]) == 0  # (traced afresh: the disk cache would skip the trace)
        texts.append(capsys.readouterr().out)
        assert (set(chunks) == {8}) if extra else not chunks  # the flag reached the model; auto stays dense here
    assert texts[0] == texts[1] and texts[0].strip()


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_a_mask_built_per_chunk_gives_the_same_attention(impl):
    """The sampler's `masks.BlockMask` (the rule, unevaluated) attends exactly as the mask it stands for."""
    r = np.random.default_rng(7)
    qv = jnp.asarray(r.random((2, 21)) < 0.9)
    kv = jnp.asarray(r.random((2, 45)) < 0.9)
    qb = jnp.asarray(np.sort(r.integers(0, 6, (2, 21)), axis=1))
    kb = jnp.asarray(np.sort(r.integers(0, 6, (2, 45)), axis=1))
    lazy = masks.BlockMask(qv, qb, kv, kb, True)
    assert lazy.shape == (2, 21, 45)
    full = masks.attention_mask(qv, qb, kv, kb, True)
    np.testing.assert_array_equal(np.asarray(lazy.full()), np.asarray(full))
    np.testing.assert_array_equal(np.asarray(lazy.rows(3, 5).cols(10, 7).full()), np.asarray(full[:, 3:8, 10:17]))
    q, k, v = _qkv(21, 45, seed=8)
    np.testing.assert_allclose(np.asarray(layers.attend(q, k, v, lazy, impl, 8)),
                               np.asarray(layers.attend(q, k, v, full, "dense")), atol=1e-5, rtol=1e-5)


def test_a_mask_built_per_chunk_is_never_held_whole():
    t, chunk = 4096, 256
    q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    vec = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def temp_bytes(lazy):
        def f(q, k, v, valid, blocks):
            m = masks.BlockMask(valid > 0, blocks, valid > 0, blocks, True)
            return layers.attend(q, k, v, m if lazy else m.full(), "chunked", chunk)

        return jax.jit(f).lower(q, kv, kv, vec, vec).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(False) >= t * t  # the [T, T] bool mask
    assert temp_bytes(True) < t * t / 4
