"""Splash attention (`model.splash`, attention_impl "splash", and "auto" on a TPU): a causal-prefix model's prefill
through Pallas' flash kernel, here in interpret mode, equals the dense form within 1e-5 in float32 (left padding,
GQA, a window at a traced offset of a cache, lengths that are not whole kernel blocks), values and gradients with
remat; the sampler's tokens are unchanged; on a mesh it runs under shard_map; and it compiles for a TPU topology."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import plan as clover_plan
from clover_jax.config import get_config
from clover_jax.errors import ShardingError
from clover_jax.mesh import layouts
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import layers, masks, params, splash, transformer
from clover_jax.plan import aot
from clover_jax.sampler import SamplerConfig, generate

B, S, H, K, HD = 2, 640, 4, 2, 32
PAD = np.array([0, 37])  # the second row is left-padded


def _rows(seed=0, pad=PAD):
    r = np.random.default_rng(seed)
    valid = jnp.asarray(np.arange(S)[None] >= pad[:, None])
    kc, vc = (jnp.asarray(r.standard_normal((B, S, K, HD)), jnp.float32) for _ in range(2))
    return r, valid, masks.positions(valid), kc, vc


def _close_on_valid(out, ref, q_valid, atol=1e-5):
    keep = np.asarray(q_valid).reshape(*q_valid.shape, *(1,) * (out.ndim - 2))
    np.testing.assert_allclose(np.where(keep, np.asarray(out), 0), np.where(keep, np.asarray(ref), 0), atol=atol)


@pytest.mark.parametrize("segment", [128, 384, splash.CACHE_SEGMENT])  # the cache in 128- or 384-column segments
@pytest.mark.parametrize("offset, width", [(0, 256), (256, 200), (200, 160), (384, 256)])
@pytest.mark.parametrize("pad", [PAD, np.array([0, 300])])  # the second: its first segments all padding
def test_a_window_over_a_cache_equals_the_dense_form(offset, width, segment, pad, monkeypatch):
    monkeypatch.setattr(splash, "CACHE_SEGMENT", segment)  # 384: the last of 640 columns shifted back to fit
    r, valid, pos, kc, vc = _rows(pad=pad)
    q = jnp.asarray(r.standard_normal((B, width, H, HD)), jnp.float32)
    q_valid = valid[:, offset:offset + width]
    # the mask the sampler builds for a prefill window: clean columns' block ids are their positions (causal)
    ref = layers.attend(q, kc, vc, masks.BlockMask(q_valid, pos[:, offset:offset + width], valid, pos, True), "dense")
    own = (kc[:, offset:offset + width], vc[:, offset:offset + width])
    out = jax.jit(splash.causal_attention)(q, *own, q_valid, (kc, vc, valid, jnp.int32(offset)))
    _close_on_valid(out, ref, q_valid)


def test_a_cache_free_pass_equals_the_dense_form():
    r, _, _, kc, vc = _rows(1)
    t = 300  # not a whole number of kernel blocks
    valid = jnp.asarray(np.arange(t)[None] >= PAD[:, None])
    pos = masks.positions(valid)
    q = jnp.asarray(r.standard_normal((B, t, H, HD)), jnp.float32)
    ref = layers.attend(q, kc[:, :t], vc[:, :t], masks.BlockMask(valid, pos, valid, pos, True), "dense")
    _close_on_valid(splash.causal_attention(q, kc[:, :t], vc[:, :t], valid, None), ref, valid)


def test_which_windows_take_the_kernel():
    assert splash.applies("splash", True, (2, 128, 4, 16), 2, None)
    assert not splash.applies("splash", False, (2, 4096, 4, 256), 2, None)  # a block-causal or denoising mask
    assert not splash.applies("splash", True, (2, 64, 4, 256), 2, None)  # a block pass stays dense
    assert not splash.applies("auto", True, (2, 4096, 4, 256), 2, None)  # auto: on a TPU only (tests run on a CPU)
    assert not splash.applies("chunked", True, (2, 4096, 4, 256), 2, None)
    mesh = dataclasses.replace(layouts.load_layout("cpu-8"), shape=(2, 2, 2)).mesh_rules()  # data 2, tensor 2
    assert splash.applies("splash", True, (2, 256, 4, 32), 2, mesh)
    assert not splash.applies("splash", True, (1, 256, 4, 32), 2, mesh)  # one row on two data shards: XLA's
    assert not splash.applies("splash", True, (2, 256, 4, 32), 1, mesh)  # one KV head on two tensor shards
    split = MeshRules(mesh.mesh, mesh.rules.replace(kv_heads=None))
    with pytest.raises(ShardingError, match="query and KV heads on the same mesh axes"):
        splash.applies("splash", True, (2, 256, 4, 32), 2, split)


class _Counted:
    """splash.causal_attention, counting the attention layers traced through it."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = splash.causal_attention

        def counted(*a, **kw):
            self.calls += 1
            return real(*a, **kw)

        monkeypatch.setattr(splash, "causal_attention", counted)


def _model(seed=0):
    cfg = get_config("test-clover-prefix")
    return cfg, params.init(cfg, jax.random.key(seed))


def test_the_sampler_gives_the_same_tokens_through_the_kernel(monkeypatch):
    cfg, weights = _model()
    r = np.random.default_rng(2)
    prompts = [r.integers(4, 200, 300).tolist(), r.integers(4, 200, 210).tolist()]
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16)
    # 512 prefill columns over 2 rows: windows of 256 columns, wide enough for the kernel
    dense = generate(weights, cfg.replace(attention_impl="dense", prefill_chunk=512), prompts, sc)
    counted = _Counted(monkeypatch)
    kernel = generate(weights, cfg.replace(attention_impl="splash", prefill_chunk=512), prompts, sc)
    assert counted.calls > 0  # the prefill's attention layers went through the kernel
    assert kernel.tokens == dense.tokens and kernel.stats.nfe == dense.stats.nfe


def test_values_and_gradients_with_remat_equal_the_dense_form(monkeypatch):
    cfg, weights = _model(1)
    t = 160
    valid = jnp.asarray(np.arange(t)[None] >= np.array([[0], [9]]))
    tokens = jnp.asarray(np.random.default_rng(3).integers(4, 200, (2, t)))
    w = jnp.asarray(np.random.default_rng(4).standard_normal((2, t, cfg.vocab_size)), jnp.float32) * valid[..., None]

    def loss(weights, impl):
        out = transformer.forward(weights, cfg.replace(attention_impl=impl), tokens, valid=valid, remat=True)
        return (out.logits * w).sum(), out.logits

    (ld, logits_d), gd = jax.value_and_grad(loss, has_aux=True)(weights, "dense")
    counted = _Counted(monkeypatch)
    (ls, logits_s), gs = jax.value_and_grad(loss, has_aux=True)(weights, "splash")
    assert counted.calls > 0
    _close_on_valid(logits_s, logits_d, valid, atol=1e-4)
    np.testing.assert_allclose(float(ls), float(ld), rtol=1e-5)
    flat_d, flat_s = jax.tree.leaves(gd), jax.tree.leaves(gs)
    for a, b in zip(flat_s, flat_d, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-3)
    q_grads = [np.abs(np.asarray(g)).max() for g in jax.tree.leaves(gs.moe_layers.attn.q)]
    assert max(q_grads) > 0  # gradients reach the query projections through the kernel


def test_on_a_mesh_it_runs_under_shard_map_and_gives_the_same_attention():
    r, valid, _, kc, vc = _rows(5)
    lay = dataclasses.replace(layouts.load_layout("cpu-8"), shape=(2, 2, 2))  # rows over data, heads over tensor
    mesh = lay.mesh_rules()
    q = jnp.asarray(r.standard_normal((B, 256, H, HD)), jnp.float32)
    args = (q, kc[:, 128:384], vc[:, 128:384], valid[:, 128:384], (kc, vc, valid, jnp.int32(128)))
    one = splash.causal_attention(*args)
    sharded = jax.jit(lambda *a: splash.causal_attention(*a, mesh=mesh))(*args)
    _close_on_valid(sharded, one, valid[:, 128:384])
    lowered = jax.jit(lambda *a: splash.causal_attention(*a, mesh=mesh)).lower(*args).as_text()
    assert "sdy.manual_computation" in lowered or "SPMDFullToShardShape" in lowered  # under shard_map
    bad = MeshRules(mesh.mesh, mesh.rules.replace(kv_heads=None))
    with pytest.raises(ShardingError, match="query and KV heads on the same mesh axes"):
        splash.causal_attention(*args, mesh=bad)


@pytest.mark.skipif(not clover_plan.libtpu_available(), reason="libtpu is not installed")
def test_it_compiles_for_a_tpu_topology_as_a_mosaic_kernel(tmp_path):
    path = tmp_path / "v5e-4.toml"
    path.write_text('platform = "tpu"\nchip = "v5e"\ntopology = "v5e:2x2"\n[mesh]\nshape = [2, 1, 2]\n'
                    'axes = ["data", "expert", "tensor"]\n[rules]\nq_heads = "tensor"\nkv_heads = "tensor"\n')
    lay = layouts.load_layout(str(path))
    mesh = MeshRules(aot.topology_mesh(lay), lay.rules)
    assert splash.platform(mesh) == "tpu" and splash.applies("auto", True, (2, 1024, 8, 128), 2, mesh)
    assert not splash.applies("auto", True, (2, 1024, 8, 64), 2, mesh)  # heads narrower than the kernel's lanes
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    t, s = 1024, 4096
    args = (shape(2, t, 8, 128), shape(2, t, 2, 128), shape(2, t, 2, 128), jax.ShapeDtypeStruct((2, t), bool),
            (shape(2, s, 2, 128), shape(2, s, 2, 128), jax.ShapeDtypeStruct((2, s), bool),
             jax.ShapeDtypeStruct((), jnp.int32)))
    compiled = jax.jit(lambda *a: splash.causal_attention(*a, mesh=mesh)).lower(*args).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the Mosaic kernel, not an XLA fallback
    # no [T, S] scores are held: temporaries far below one float32 score matrix of a chip's rows and heads
    assert compiled.memory_analysis().temp_size_in_bytes < 1 * 4 * t * s * 4 / 4


def test_the_server_prefills_through_the_kernel_with_the_same_tokens(monkeypatch):
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request
    from tests.engine_requests import serve, tokens

    r = np.random.default_rng(6)
    prompts = [r.integers(4, 200, 150).tolist(), r.integers(4, 200, 131).tolist()]

    def run(impl):
        cfg, weights = _model(2)
        eng = Engine(weights, cfg.replace(attention_impl=impl), block_length=8, max_prompt=160, max_tokens=16,
                     batch_sizes=(2,))
        events = serve(eng, [Request(tuple(p), 16, SamplerConfig(eos_stop=False)) for p in prompts], drain=True)
        return [tokens(e) for e in events]

    dense = run("dense")
    counted = _Counted(monkeypatch)
    kernel = run("splash")
    assert counted.calls > 0 and kernel == dense and all(len(t) == 16 for t in dense)
