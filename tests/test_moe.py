"""MoE routing and dispatch: `ragged` and `tiled` compute exactly what the `dense` oracle computes."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import kernels
from clover_jax.config import get_config
from clover_jax.model import moe
from clover_jax.model.params import init

QWEN = get_config("test-qwen3-moe")  # softmax router, 8 experts, top-2
LLADA2 = get_config("test-llada2")  # sigmoid router + expert bias, 4 groups keep 2, x2.5, shared expert
FAST = ("ragged", "tiled", "tiled-walk")  # tiled-walk: tiled traced with the CPU kernel off


def _dispatch(name: str) -> tuple[str, contextlib.AbstractContextManager]:
    """(dispatch, context to trace it in): `X-walk` is X with clover_jax.kernels switched off."""
    if name.endswith("-walk"):
        return name.removesuffix("-walk"), kernels.switched_off()
    return name, contextlib.nullcontext()


def _moe_block(x, w, cfg, name: str, layer=None):
    dispatch, ctx = _dispatch(name)
    with ctx:
        return moe.moe_block(x, w, cfg, dispatch, layer)


def _run_dispatch(x, r, w, name: str):
    dispatch, ctx = _dispatch(name)
    with ctx:
        return moe.DISPATCH[dispatch](x, r, w, QWEN)


@functools.cache
def _stack(cfg) -> moe.MoEWeights:
    """Each config's MoE weights, stacked over layers: initialised once (each init call compiles)."""
    return init(cfg, jax.random.key(0)).moe_layers.mlp


def _layer_weights(cfg, seed: int = 0, layer: int = 0) -> moe.MoEWeights:
    w = _stack(cfg)
    w = jax.tree.map(lambda a: a[layer], w)
    if w.expert_bias is not None:  # a bias that really changes the selection
        w = w.replace(expert_bias=0.05 * jax.random.normal(jax.random.key(seed + 1), w.expert_bias.shape))
    return w


def _crafted_routing(experts: np.ndarray, seed: int = 0) -> moe.Routing:
    n, k = experts.shape
    weights = jax.random.uniform(jax.random.key(seed), (n, k), minval=0.1, maxval=1.0)
    e = int(experts.max()) + 1
    return moe.Routing(jnp.asarray(experts, jnp.int32), weights, jnp.zeros((n, e)), jnp.zeros((n, e)))


def _loads(n: int, k: int, n_experts: int, pattern: str) -> np.ndarray:
    """Routings [n, k] with distinct experts per token and a given load shape."""
    rng = np.random.default_rng(n * 31 + k)
    if pattern == "skewed":  # expert 0 takes every token, expert 1 most, several experts get nothing
        rest = [rng.choice(np.arange(1, 4), k - 1, replace=False) for _ in range(n)]
        return np.stack([np.concatenate([[0], r]) for r in rest])
    if pattern == "two_experts":  # only experts 5 and 2 get tokens
        return np.tile(np.array([5, 2])[:k], (n, 1))
    if pattern == "last_only":  # the last group runs into the padding rows
        return np.stack([np.concatenate([[n_experts - 1], rng.choice(n_experts - 1, k - 1, replace=False)])
                         for _ in range(n)])
    return np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n)])


_JITTED = {name: jax.jit(functools.partial(_run_dispatch, name=name)) for name in ("dense", *FAST)}


@pytest.mark.parametrize(("n_tokens", "pattern"), [
    (1, "uniform"), (150, "uniform"), (150, "skewed"), (150, "two_experts"), (150, "last_only"), (13, "skewed"),
])
def test_dispatch_equals_dense_on_crafted_routings(n_tokens: int, pattern: str) -> None:
    cfg = QWEN
    w = _layer_weights(cfg)
    x = jax.random.normal(jax.random.key(n_tokens), (n_tokens, cfg.d_model))
    experts = _loads(n_tokens, cfg.n_experts_per_tok, cfg.n_experts, pattern)
    r = _crafted_routing(experts)
    ref, dropped = _JITTED["dense"](x, r, w)
    assert int(dropped) == 0
    for name in FAST:
        y, dropped = _JITTED[name](x, r, w)
        np.testing.assert_allclose(y, ref, atol=2e-6, rtol=1e-5, err_msg=f"{name} / {pattern}")
        assert int(dropped) == 0
    if pattern in ("skewed", "two_experts"):
        assert np.bincount(experts.ravel(), minlength=cfg.n_experts).min() == 0  # some expert gets no token


def test_grouped_swiglu_every_group_size_against_numpy() -> None:
    """Group sizes around each tile height (binary tail tiles, empty groups, one group > 2 big tiles)."""
    sizes = np.array([0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 0, 64, 70, 5], np.int32)
    e, d, f = len(sizes), 16, 24
    keys = jax.random.split(jax.random.key(3), 4)
    rows = jax.random.normal(keys[0], (int(sizes.sum()), d))
    gate, up = (0.3 * jax.random.normal(k, (e, d, f)) for k in keys[1:3])
    down = 0.3 * jax.random.normal(keys[3], (e, f, d))
    heights = moe.tile_heights(len(rows))
    assert heights[-1] == moe.MIN_TILE and heights == tuple(sorted(heights, reverse=True))
    starts = np.cumsum(sizes) - sizes
    r, g, u, dn = (np.asarray(a, np.float64) for a in (rows, gate, up, down))
    # Default heights (top 128: every group in one big tile or its binary tail) and a small top
    # height (32: groups of 33..70 rows take several big tiles before the tail).
    for hs in (None, (32, 16, 8)):
        with kernels.switched_off():  # the tile walk itself (the CPU kernel ignores tile heights)
            y = jax.jit(lambda *a, hs=hs: moe.grouped_swiglu(*a, heights=hs))(rows, jnp.asarray(sizes), gate, up,
                                                                             down)
        for i, (s, n) in enumerate(zip(starts, sizes, strict=True)):
            xe = r[s:s + n]
            h = xe @ g[i]
            want = (h / (1 + np.exp(-h)) * (xe @ u[i])) @ dn[i]
            np.testing.assert_allclose(np.asarray(y[s:s + n]), want, atol=1e-5,
                                       err_msg=f"heights {hs}: group {i} of {n} rows")


@pytest.mark.parametrize("n_copies, n_experts", [(600, 8), (2048, 64)])
def test_counting_sort_equals_stable_argsort(n_copies: int, n_experts: int, monkeypatch) -> None:
    """Both ways of grouping copies by expert give the stable order: every copy's row, group sizes."""
    flat_e = jax.random.randint(jax.random.key(n_copies), (n_copies,), 0, n_experts // 2) * 2  # odd experts empty
    counted = moe.expert_positions(flat_e, n_experts)
    monkeypatch.setattr(moe.sorting, "COUNTING_SORT_MAX", 0)
    sorted_ = moe.expert_positions(flat_e, n_experts)
    want_rows = np.argsort(np.argsort(np.asarray(flat_e), kind="stable"), kind="stable")
    want_sizes = np.bincount(np.asarray(flat_e), minlength=n_experts)
    for position, sizes in (counted, sorted_):
        np.testing.assert_array_equal(np.asarray(position), want_rows)
        np.testing.assert_array_equal(np.asarray(sizes), want_sizes)


def test_tile_heights() -> None:
    assert moe.tile_heights(768) == (128, 64, 32, 16, 8)  # B=1 x 192 tokens x top-4
    assert moe.tile_heights(100) == (128, 64, 32, 16, 8)
    assert moe.tile_heights(40) == (64, 32, 16, 8)  # never taller than the rows need
    assert moe.tile_heights(4) == (8,)


@pytest.mark.parametrize("cfg", [QWEN, LLADA2], ids=["softmax", "sigmoid-groups"])
def test_moe_block_dispatches_agree_with_real_routing(cfg) -> None:
    w = _layer_weights(cfg, seed=1)
    x = jax.random.normal(jax.random.key(2), (3, 37, cfg.d_model))
    ref, ref_stats = jax.jit(lambda x, w: moe.moe_block(x, w, cfg, "dense"))(x, w)
    for name in FAST:
        y, st = jax.jit(lambda x, w, name=name: _moe_block(x, w, cfg, name))(x, w)
        np.testing.assert_allclose(y, ref, atol=2e-6, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(st.load, ref_stats.load)
    assert abs(float(ref_stats.load.sum()) - 1.0) < 1e-6


def test_layer_stacked_weights_equal_per_layer_weights() -> None:
    """moe_block(layer=i) on the layer stack is the same as moe_block on layer i's weights."""
    cfg = LLADA2
    stack = _stack(cfg)
    x = jax.random.normal(jax.random.key(5), (2, 19, cfg.d_model))
    per_layer_fn = jax.jit(lambda x, w: moe.moe_block(x, w, cfg, "ragged")[0])
    stacked_fn = {name: jax.jit(lambda x, w, i, name=name: _moe_block(x, w, cfg, name, i)[0])
                  for name in ("tiled", "tiled-walk", "dense")}  # stack-taking strategies, one given a slice
    for layer in range(cfg.n_moe_layers):
        per_layer = jax.tree.map(lambda a, layer=layer: a[layer], stack)
        stacked = per_layer.replace(gate=stack.gate, up=stack.up, down=stack.down)
        ref = per_layer_fn(x, per_layer)
        for name, fn in stacked_fn.items():
            np.testing.assert_allclose(fn(x, stacked, layer), ref, atol=2e-6, rtol=1e-5, err_msg=f"{name} {layer}")


def test_sigmoid_group_routing_semantics() -> None:
    """Experts chosen on sigmoid + bias inside the best groups, weighted by unbiased sigmoid, x scaling."""
    cfg = LLADA2
    w = _layer_weights(cfg, seed=6)
    w = w.replace(expert_bias=jnp.zeros_like(w.expert_bias).at[3].set(10.0))  # expert 3 always chosen
    x = jax.random.normal(jax.random.key(7), (64, cfg.d_model))
    r = jax.jit(lambda x, w: moe.route(x, w, cfg))(x, w)
    e = np.asarray(r.experts)
    assert (e == 3).any(-1).all()
    per_group = cfg.n_experts // cfg.n_expert_groups
    assert all(len(set(row // per_group)) <= cfg.topk_groups for row in e)
    s = jax.nn.sigmoid(x @ w.router)
    chosen = jnp.take_along_axis(s, r.experts, -1)
    np.testing.assert_allclose(r.weights, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-6)
    np.testing.assert_allclose(r.weights.sum(-1), 2.5, rtol=1e-6)


def test_softmax_routing_renormalises_or_not() -> None:
    w = _layer_weights(QWEN, seed=8)
    x = jax.random.normal(jax.random.key(9), (16, QWEN.d_model))
    route = jax.jit(moe.route, static_argnums=2)
    np.testing.assert_allclose(route(x, w, QWEN).weights.sum(-1), 1.0, rtol=1e-6)
    raw = route(x, w, QWEN.replace(norm_topk_prob=False))
    probs = jax.nn.softmax(x @ w.router, -1)
    np.testing.assert_allclose(raw.weights, jax.lax.top_k(probs, QWEN.n_experts_per_tok)[0], rtol=1e-6)


def test_tiled_gradients_equal_dense() -> None:
    """Custom VJP of `tiled` (grouped tiled matmuls backwards) against AD through `dense`: d/dx, d/dW."""
    cfg = LLADA2  # the crafted-loads test below covers the softmax router
    w = _layer_weights(cfg, seed=10)
    x = jax.random.normal(jax.random.key(11), (2, 29, cfg.d_model))
    target = jax.random.normal(jax.random.key(12), x.shape)

    def loss(x, w, name):
        y, _ = moe.moe_block(x, w, cfg, name)
        return jnp.sum((y - target) ** 2)

    ref = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "dense")
    got = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "tiled")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got), strict=True):
        scale = float(jnp.max(jnp.abs(a))) + 1e-12
        np.testing.assert_allclose(b, a, atol=1e-5 * scale, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.max(jnp.abs(got[1].gate))) > 0  # expert weights really receive gradient


def test_tiled_gradients_through_layer_stack_and_crafted_loads() -> None:
    """Uneven loads (an expert with every token, experts with none) through the layer-stacked path."""
    cfg = QWEN
    stack = _stack(cfg)
    n = 40
    r = _crafted_routing(_loads(n, cfg.n_experts_per_tok, cfg.n_experts, "skewed"), seed=14)
    x = jax.random.normal(jax.random.key(15), (n, cfg.d_model))

    def loss(x, gate, up, down, weights, name, layer):
        w = jax.tree.map(lambda a: a[layer], stack).replace(gate=gate[layer], up=up[layer], down=down[layer])
        if name == "tiled":  # stacked form: the strategy slices [layer, expert] itself
            w = w.replace(gate=gate, up=up, down=down)
            y, _ = moe.dispatch_tiled(x, r._replace(weights=weights), w, cfg, layer=layer)
        else:
            y, _ = moe.DISPATCH[name](x, r._replace(weights=weights), w, cfg)
        return jnp.sum(jnp.sin(y))

    args = (x, stack.gate, stack.up, stack.down, r.weights)
    ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnums=(5, 6))(*args, "dense", 1)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnums=5)(*args, "tiled", jnp.int32(1))
    for name, a, b in zip(("x", "gate", "up", "down", "routing weights"), ref, got, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5 * (float(jnp.max(jnp.abs(a))) + 1e-12), rtol=1e-4, err_msg=name)
    assert float(jnp.abs(got[1][0]).max()) == 0.0  # other layers get exactly no gradient


def test_unknown_dispatch_is_named() -> None:
    w = _layer_weights(QWEN)
    with pytest.raises(ValueError, match=r"unknown MoE dispatch 'fast'.*dense.*ragged.*tiled"):
        moe.moe_block(jnp.zeros((1, 2, QWEN.d_model)), w, QWEN, "fast")
