"""The block expert coreset (`moe_block_coreset`): the rows of a block being denoised route among the experts their
block weights most, clean rows among all; the sampler's cache modes, the server and training see the same blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.errors import ConfigError
from clover_jax.model import masks, params, transformer
from clover_jax.model.moe.routing import Coreset, coreset_mask, route
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.training import losses

BASE = get_config("test-clover-prefix", init_std=0.1)  # 8 experts, top-2


def test_the_coreset_is_the_blocks_heaviest_experts():
    rng = np.random.default_rng(0)
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((6, 8)) * 2), -1)
    member = jnp.asarray([True, True, True, False, True, True])
    segment = jnp.asarray([0, 0, 0, 3, 4, 4], jnp.int32)
    keep = np.asarray(coreset_mask(probs, Coreset(member, segment), 3))
    for rows in ([0, 1, 2], [4, 5]):
        heaviest = set(np.argsort(-np.asarray(probs)[rows].sum(0))[:3])
        for r in rows:
            assert set(np.flatnonzero(keep[r])) == heaviest
    assert keep[3].all()  # a clean row routes anywhere
    w = params.init(BASE.replace(moe_block_coreset=2), jax.random.key(0)).linear_layers.mlp
    x = jnp.asarray(rng.standard_normal((6, BASE.d_model)), jnp.float32)
    first = jax.nn.softmax(x @ w.router[0], -1)
    r = route(x, jax.tree.map(lambda a: a[0], w), BASE.replace(moe_block_coreset=2), Coreset(member, segment))
    allowed = np.asarray(coreset_mask(first, Coreset(member, segment), 2))
    assert all(allowed[i, e] for i in range(6) for e in np.asarray(r.experts)[i])
    np.testing.assert_allclose(np.asarray(r.weights).sum(-1), 1.0, rtol=1e-6)  # renormalised over the coreset


def test_refused_where_it_has_no_meaning():
    with pytest.raises(ConfigError, match=r"moe_block_coreset must be 0 \(off\) or in \[n_experts_per_tok"):
        BASE.replace(moe_block_coreset=1)
    with pytest.raises(ConfigError, match="needs bd_gdn='causal_prefix'"):
        get_config("test-clover-hybrid").replace(moe_block_coreset=4)


def test_clean_text_never_uses_it_and_the_full_coreset_is_off():
    w = params.init(BASE, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 20), 5, 250)
    plain = transformer.forward(w, BASE, toks).logits
    np.testing.assert_array_equal(np.asarray(transformer.forward(w, BASE.replace(moe_block_coreset=2), toks).logits),
                                  np.asarray(plain))
    sc = SamplerConfig(gen_length=16, block_length=8, eos_stop=False)
    a = generate(w, BASE, [[5, 9, 17]], sc, record_logits=True, dispatch="dense")
    b = generate(w, BASE.replace(moe_block_coreset=8), [[5, 9, 17]], sc, record_logits=True, dispatch="dense")
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
    c = generate(w, BASE.replace(moe_block_coreset=2), [[5, 9, 17]], sc, record_logits=True, dispatch="dense")
    assert np.abs(c.logits - a.logits).max() > 1e-3  # a small coreset changes the previews


def test_cache_modes_and_training_see_the_same_blocks():
    cfg = BASE.replace(moe_block_coreset=3)
    w = params.init(cfg, jax.random.key(0))
    sc = SamplerConfig(gen_length=24, block_length=8, eos_stop=False, threshold=0.3)
    none = generate(w, cfg, [[5, 9, 17, 33], [7, 8]], sc.replace(cache="none"), record_logits=True, dispatch="dense")
    prefix = generate(w, cfg, [[5, 9, 17, 33], [7, 8]], sc.replace(cache="prefix"), record_logits=True,
                      dispatch="dense")
    np.testing.assert_array_equal(none.raw, prefix.raw)
    np.testing.assert_allclose(none.logits, prefix.logits, atol=2e-5)
    # training's noisy blocks get the sampler's preview logits, coreset included
    bs, p = cfg.block_size, 5
    clean = jax.random.randint(jax.random.key(3), (2, p + 2 * bs), 5, 250)
    scored = jnp.broadcast_to(jnp.arange(p + 2 * bs) >= p, clean.shape)
    noisy = jnp.where(scored & (jax.random.uniform(jax.random.key(4), clean.shape) < 0.6), cfg.mask_token_id, clean)
    valid = jnp.ones(clean.shape, bool)
    blk = masks.training_block_ids(cfg, valid, scored, "prompt")
    got = losses.denoising_forward(w, cfg, noisy, clean, valid, dispatch="dense", blocks=blk).logits
    lo = p + bs
    ctx = jnp.concatenate([clean[:, :lo], noisy[:, lo:lo + bs]], axis=1)
    v = jnp.ones(ctx.shape, bool)
    ids = masks.prefix_canvas_ids(masks.positions(v), lo, p, bs)
    ref = transformer.forward(w, cfg, ctx, masks.positions(v), masks.attention_mask(v, ids, v, ids, True),
                              dispatch="dense", valid=v, blocks=ids, commit=lo).logits[:, lo:]
    np.testing.assert_allclose(np.asarray(got[:, lo:lo + bs]), np.asarray(ref), atol=2e-5, rtol=1e-5)
