"""Gated DeltaNet split over the `tensor` mesh axis by heads: its weights' shardings, the sharded hybrid forward,
cached sampler (tokens, logits, the cache's Gated DeltaNet state) and two-stream training against one device on
a 2 (data) x 2 (expert) x 2 (tensor) mesh of fake CPU devices, and native checkpoints written before the conv
channels were grouped by key head (`checkpoint.format.legacy_leaves`) loading, sharded too, and reading the same."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from clover_jax import checkpoint
from clover_jax.checkpoint import format as ckpt_format
from clover_jax.config import get_config
from clover_jax.convert.quantize import DequantizedReader
from clover_jax.mesh.rules import DEFAULT_RULES, MeshRules
from clover_jax.model import init_cache, params, transformer
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.sampler.generate import PROGRAM_JIT, prepare
from clover_jax.training import losses

CFG = get_config("test-clover-hybrid", init_std=0.1)  # 2 key / 4 value heads, 2 KV heads, 8 experts
TOL = {"atol": 1e-5, "rtol": 0}


def _weights(cfg, seed=0):
    """numpy draws (no init compile) with a right conv that really looks right and decays well inside (0, 1)."""
    rng = np.random.default_rng(seed)

    def leaf(s):
        base = {"ones": 1.0, "zeros": 0.0, "constant": s.value}.get(s.init, 0.0)
        std = 0.5 if s.init == "zeros" else 0.2 if s.init in ("ones", "constant") else s.std
        return (base + std * rng.standard_normal(s.shape)).astype(s.dtype)

    return jax.tree.map(leaf, params.abstract(cfg), is_leaf=params.is_spec)


@pytest.fixture(scope="module")
def mesh(devices):
    return MeshRules(Mesh(np.array(devices).reshape(2, 2, 2), ("data", "expert", "tensor")), DEFAULT_RULES)


@pytest.fixture(scope="module")
def weights(mesh):
    host = _weights(CFG)
    return jax.device_put(host), jax.device_put(host, params.weight_shardings(CFG, mesh.mesh, mesh.rules))


def test_gated_deltanet_weights_split_by_heads(mesh, weights):
    _, ws = weights
    a = ws.linear_layers.attn
    by_heads = {  # [layers, ...]: the head axis over `tensor`
        "qkv": (None, None, "tensor"), "conv": (None, None, "tensor", None),
        "conv_right": (None, None, "tensor", None), "z": (None, None, "tensor", None), "b": (None, None, "tensor"),
        "a": (None, None, "tensor"), "a_log": (None, "tensor"), "dt_bias": (None, "tensor"),
        "out": (None, "tensor", None, None), "bd_logit_scale": (None, "tensor"), "bd_history_bias": (None, "tensor"),
        "bd_history_c": (None, "tensor"), "norm": (None, None),
    }
    for name, spec in by_heads.items():
        assert getattr(a, name).sharding == NamedSharding(mesh.mesh, PartitionSpec(*spec)), name
    # Each device holds one key head's group of conv channels: q, k and the two value heads that read it.
    group = params.linear_group_dim(CFG)
    assert {s.data.shape for s in a.conv.addressable_shards} == {(3, CFG.linear_conv_kernel_dim, 1, group)}
    assert {s.data.shape for s in a.qkv.addressable_shards} == {(3, CFG.d_model, group)}
    q = params.weight_shardings(CFG.replace(quantization="int8"), mesh.mesh, mesh.rules).linear_layers.attn.qkv
    assert q.qvalue.spec == q.scale.spec == PartitionSpec(None, None, "tensor")


def test_group_channels_is_a_permutation_that_ungroup_inverts():
    c = CFG.linear_conv_dim
    x = np.arange(3 * c).reshape(3, c)
    g = params.group_channels(x, CFG)
    assert g.shape == (3, 2, params.linear_group_dim(CFG)) and sorted(g.reshape(-1)) == sorted(x.reshape(-1))
    hk, dk = CFG.linear_num_key_heads, CFG.linear_key_head_dim
    np.testing.assert_array_equal(g[:, 1, :dk], x[:, dk:2 * dk])  # key head 1's queries
    np.testing.assert_array_equal(g[:, 1, dk:2 * dk], x[:, hk * dk + dk:hk * dk + 2 * dk])  # its keys
    np.testing.assert_array_equal(g[:, 1, 2 * dk:], x[:, 2 * hk * dk + (c - 2 * hk * dk) // 2:])  # value heads 2, 3
    np.testing.assert_array_equal(params.ungroup_channels(g, CFG), x)
    np.testing.assert_array_equal(np.asarray(params.group_channels(jnp.asarray(x), CFG)), g)


def _tokens(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(4, CFG.vocab_size - 1, (batch, length)).astype(np.int32)
    valid = np.ones((batch, length), bool)
    valid[1, :5] = False  # left padding on one row
    return jnp.asarray(toks), jnp.asarray(valid)


def test_sharded_forward_and_cache_equal_one_device(mesh, weights):
    """The whole-window forward (chunked delta rule and in-block softmax) and a prefix-then-rest run through the
    cache; the cache's Gated DeltaNet state comes back split by rows and heads."""
    w1, ws = weights
    toks, valid = _tokens(4, 40)
    apply = jax.jit(transformer.apply, static_argnums=1, static_argnames=("mesh", "dispatch"))
    ref = apply(w1, CFG, toks, valid)
    got = apply(ws, CFG, toks, valid, mesh=mesh, dispatch="ep_gather")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **TOL)

    def run(w, on):
        positions = jnp.broadcast_to(jnp.arange(24), (4, 24))
        mask = jnp.broadcast_to(positions[:, :, None] // CFG.block_size >= positions[:, None, :] // CFG.block_size,
                                (4, 24, 24))
        cache = init_cache(CFG, 4, 24)
        first = transformer.forward(w, CFG, toks[:, :16], positions[:, :16], mask[:, :16], cache, 0, mesh=on,
                                    dispatch="ep_gather" if on else None)
        second = transformer.forward(w, CFG, toks[:, 16:24], positions[:, 16:24], mask[:, 16:24], first.cache, 16,
                                     mesh=on, dispatch="ep_gather" if on else None)
        return first.logits, second.logits, second.cache

    ref = jax.jit(lambda w: run(w, None))(w1)
    got = jax.jit(lambda w: run(w, mesh))(ws)
    for a, b in zip(got[:2], ref[:2], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    np.testing.assert_allclose(np.asarray(got[2].linear.recurrent), np.asarray(ref[2].linear.recurrent), **TOL)
    assert got[2].linear.recurrent.sharding.is_equivalent_to(
        NamedSharding(mesh.mesh, PartitionSpec(None, "data", "tensor", None, None)), 5)
    # The conv tail's channels are in key-head-group order: a contiguous split of them is a split by heads.
    assert got[2].linear.conv_tail.sharding.is_equivalent_to(
        NamedSharding(mesh.mesh, PartitionSpec(None, "data", None, "tensor")), 4)


def test_sharded_cached_sampler_equals_one_device_and_splits_its_state_by_heads(mesh, weights):
    w1, ws = weights
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16, eos_stop=False, cache="prefix")
    ref = generate(w1, CFG, prompts, sc, record_logits=True)
    got = generate(ws, CFG, prompts, sc, record_logits=True, mesh=mesh)
    assert len(set(np.asarray(ref.raw).reshape(-1).tolist())) > 2  # the model says something
    np.testing.assert_array_equal(np.asarray(got.raw), np.asarray(ref.raw))
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), **TOL)
    # Inside the compiled program each device carries its rows' state of its own value heads only: the delta-rule
    # state [layers 3, rows 2 / data 2, Hv 4 / tensor 2, dk, dv], the conv tail [3, 1, K-1, C / 2].
    prep = prepare(CFG, prompts, sc, mesh=mesh)
    hlo = PROGRAM_JIT.lower(prep.spec, prep.forward_fn, *prep.abstract_args(ws)).compile().as_text()
    dk, dv, c = CFG.linear_key_head_dim, CFG.linear_value_head_dim, CFG.linear_conv_dim
    assert f"f32[3,1,2,{dk},{dv}]" in hlo and f"f32[3,1,3,{c // 2}]" in hlo
    assert not re.search(rf"f32\[3,[12],4,{dk},{dv}\]|f32\[3,[12],3,{c}\]", hlo)  # never whole on a device


def test_sharded_two_stream_training_equals_one_device(mesh, weights):
    """Block-diffusion training's (noisy, clean) forward and its gradients, Gated DeltaNet weights included."""
    w1, ws = weights
    clean, valid = _tokens(4, 24, seed=1)
    noisy = jnp.where(jax.random.uniform(jax.random.key(3), clean.shape) < 0.5, CFG.mask_token_id, clean)
    r = jnp.asarray(np.random.default_rng(2).standard_normal((4, 24, CFG.vocab_size)), jnp.float32)

    def logits(w, on):
        return losses.denoising_forward(w, CFG, noisy, clean, valid, dispatch="ep_gather" if on else None,
                                        mesh=on).logits

    def loss(w, on):
        return jnp.sum(jnp.where(valid[..., None], logits(w, on), 0) * r)

    ref = jax.jit(lambda w: logits(w, None))(w1)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda w: logits(w, mesh))(ws)), np.asarray(ref), **TOL)
    l1, g1 = jax.jit(jax.value_and_grad(lambda w: loss(w, None)))(w1)
    ls, gs = jax.jit(jax.value_and_grad(lambda w: loss(w, mesh)))(ws)
    assert float(ls) == pytest.approx(float(l1), rel=1e-5)
    for name, a in params.named_leaves(gs.linear_layers.attn):
        b = np.asarray(getattr(g1.linear_layers.attn, name))
        # (a bias's gradient sums every position's share; the mesh sums them in another order: 1.35e-5 relative
        # seen on one CPU kind, while a mis-sharded weight is off by its whole size)
        np.testing.assert_allclose(np.asarray(a), b, atol=5e-5 * float(np.abs(b).max()) + 1e-6, err_msg=name)


# ---- checkpoints written before the grouping ---------------------------------------------------------------


def _save_legacy(path, cfg, flat, monkeypatch):
    """A native checkpoint as this project wrote it before the Gated DeltaNet channels were grouped by key head:
    qkv [L, D, C], conv [L, K, C], conv_right [L, Kr, C] (and a quantized qkv's qvalue / scale) in [q | k | v]."""
    def fused(name, a):
        if name.startswith("linear_layers.attn.qkv"):  # [..., C] grouped: the groups as an axis first
            a = a.reshape(*a.shape[:-1], cfg.linear_num_key_heads, -1)
        return params.ungroup_channels(a, cfg)

    gdn = ckpt_format.GDN_CHANNEL_LEAVES
    old = {n: fused(n, a) if n in gdn or n.rsplit(".", 1)[0] in gdn else a for n, a in flat.items()}
    with monkeypatch.context() as m:
        m.setattr(ckpt_format, "check_leaves", lambda *a, **k: None)
        checkpoint.save_model(str(path), cfg, ckpt_format.unflatten_weights(cfg, jax.tree.map(jnp.asarray, old)))
    return old


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_checkpoints_from_before_the_grouping_load_and_read_the_same(tmp_path, monkeypatch, mesh, scheme):
    cfg = CFG
    w = _weights(cfg, seed=4)
    if scheme != "none":
        cfg, w = params.quantize_weights(cfg, jax.tree.map(jnp.asarray, w), scheme)
    flat = {n: np.asarray(a) for n, a in ckpt_format.flatten_weights(w).items()}
    old = _save_legacy(tmp_path / "old", cfg, flat, monkeypatch)
    stored = checkpoint.stored_leaves(str(tmp_path / "old"))
    legacy = ckpt_format.legacy_leaves(cfg, stored)
    names = {"linear_layers.attn.conv", "linear_layers.attn.conv_right"}
    names |= ({"linear_layers.attn.qkv.qvalue", "linear_layers.attn.qkv.scale"} if scheme != "none"
              else {"linear_layers.attn.qkv"})
    assert set(legacy) == names and all(legacy[n] == old[n].shape for n in names)
    assert not np.array_equal(old["linear_layers.attn.conv"].reshape(-1), flat["linear_layers.attn.conv"].reshape(-1))
    assert checkpoint.stored_leaves(str(tmp_path / "old"))["linear_layers.attn.conv"][0] == (3, 4, 96)  # [.., C]

    _, one = checkpoint.load_model(str(tmp_path / "old"))
    shardings = params.weight_shardings(cfg, mesh.mesh, mesh.rules)
    _, sharded = checkpoint.load_model(str(tmp_path / "old"), shardings)
    want = dict(params.named_leaves(shardings))
    for name, a in ckpt_format.flatten_weights(sharded).items():
        np.testing.assert_array_equal(np.asarray(a), flat[name], err_msg=name)
        assert a.sharding.is_equivalent_to(want[name], a.ndim), name
    for name, a in ckpt_format.flatten_weights(one).items():
        np.testing.assert_array_equal(np.asarray(a), flat[name], err_msg=name)

    reader = checkpoint.WeightReader(str(tmp_path / "old"))  # conversion's reader: the current layout too
    for name in names:
        assert reader.leaves[name][0] == flat[name].shape
        np.testing.assert_array_equal(reader.read(name), flat[name])
        np.testing.assert_array_equal(reader.read(name, 1), flat[name][1])
        np.testing.assert_array_equal(reader.read(name, (slice(1, 3), slice(None), 1)), flat[name][1:3, :, 1])
    if scheme != "none":
        deq = DequantizedReader(reader)
        want_qkv = np.asarray(params.dequantize_weights(cfg, jax.tree.map(jnp.asarray, w))[1].linear_layers.attn.qkv)
        np.testing.assert_array_equal(deq.read("linear_layers.attn.qkv", 2), want_qkv[2])
    # A checkpoint written now is in the current layout: nothing to migrate.
    checkpoint.save_model(str(tmp_path / "new"), cfg, ckpt_format.unflatten_weights(cfg, flat))
    assert ckpt_format.legacy_leaves(cfg, checkpoint.stored_leaves(str(tmp_path / "new"))) == {}
