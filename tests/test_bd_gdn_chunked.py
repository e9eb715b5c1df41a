"""The chunked block-diffusion delta rule (`delta_rule_blocks_chunked`) against the position scan
(`delta_rule_blocks`) it replaces for long windows: every combination the mixer runs (history read-outs,
two streams with history or causal noisy blocks, the causal read-out with commit), rows of one to many
blocks with different left pads, uneven and partial blocks, an initial state, commit, gradients; then the
mixer forced onto it against itself on the scan (padding, a cache, commit, two-stream training). The float64
definition judges the mixer on both rules in `test_block_diffusion_gdn`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.model import delta_rule as dr
from clover_jax.model import gated_deltanet as gdn
from tests.test_block_diffusion_gdn import CFG, _mixer_weights

B, T, HK, HV, DK, DV, CHUNK = 4, 43, 1, 2, 8, 4, 8  # 6 chunks of 8, the last one partial


def _layout() -> tuple[jax.Array, jax.Array]:
    """valid and block ids [B, T]: left pads 0 (5 blocks of 8 + 3), 3, 13 (uneven blocks of 5, 8, 8, 3, 5, 1:
    they straddle chunk boundaries) and 40 (one partial block); block ids as the sampler numbers a prompt."""
    pads = np.array([0, 3, 13, 40])
    valid = np.arange(T)[None] >= pads[:, None]
    blocks = np.maximum(np.cumsum(valid, 1) - 1, 0) // 8
    blocks[2, 13:] = np.repeat(np.arange(6), [5, 8, 8, 3, 5, 1])
    return jnp.asarray(valid), jnp.asarray(blocks)


VALID, BLOCK_IDS = _layout()


def _stream(seed: int) -> dr.Stream:
    rng = np.random.default_rng(seed)
    q = dr.l2_normalize(jnp.asarray(rng.standard_normal((B, T, HK, DK)), jnp.float32))
    k = dr.l2_normalize(jnp.asarray(rng.standard_normal((B, T, HK, DK)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((B, T, HV, DV)), jnp.float32)
    g, beta = dr.mask_padding(-jnp.asarray(rng.uniform(0.01, 0.5, (B, T, HV)), jnp.float32),
                               jnp.asarray(rng.uniform(0.05, 0.95, (B, T, HV)), jnp.float32), VALID)
    return dr.Stream(q, k, v, g, beta)


STATE = jnp.asarray(np.random.default_rng(9).standard_normal((B, HV, DK, DV)), jnp.float32) * 0.3


def _both(history: bool, noisy: bool, commit: bool):
    """(scan, chunked): jitted f(x, noisy stream, state, commit) -> (o, noisy o, state) of each form."""
    def call(rule, x, nz, state, m):
        return rule(x, BLOCK_IDS, VALID, state, m if commit else None, history, nz if noisy else None)

    chunked = functools.partial(dr.delta_rule_blocks_chunked, chunk=CHUNK)
    return jax.jit(functools.partial(call, dr.delta_rule_blocks)), jax.jit(functools.partial(call, chunked))


# (history, noisy, commit): what mixer / _two_stream run (bd: history; bd_gdn="none": causal read-outs)
CASES = [(True, False, False), (True, False, True), (True, True, False), (False, True, False), (False, False, True)]


@pytest.mark.parametrize(("history", "noisy", "commit"), CASES)
def test_chunked_equals_the_scan(history, noisy, commit):
    scan, chunked = _both(history, noisy, commit)
    x, nz = _stream(1), _stream(2)
    for state, m in [(STATE, 21), (jnp.zeros_like(STATE), 0), (STATE, 40), (STATE, T)]:
        want, got = scan(x, nz, state, jnp.int32(m)), chunked(x, nz, state, jnp.int32(m))
        assert float(jnp.abs(want[0]).max()) > 0.1
        for a, b in zip(got, want, strict=True):  # padding columns included
            if b is not None:
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        if not commit:
            break


@pytest.mark.parametrize("history", [True, False])
def test_chunked_gradients_equal_the_scan(history):
    """Gradients of every output (read-outs of both streams at valid columns, the state kept at a commit) with
    respect to every input (both streams, the initial state)."""
    rng = np.random.default_rng(3)
    x, nz = _stream(4), _stream(5)
    r = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, HV, DV), (B, T, HV, DV), STATE.shape)]
    r[:2] = [jnp.where(VALID[:, :, None, None], a, 0) for a in r[:2]]

    def loss(rule, x, nz, state):
        o, on, s = rule(x, BLOCK_IDS, VALID, state, 27, history, nz)
        return jnp.sum(o * r[0]) + jnp.sum(on * r[1]) + jnp.sum(s * r[2])

    chunked = functools.partial(dr.delta_rule_blocks_chunked, chunk=CHUNK)
    want, got = (jax.jit(jax.grad(functools.partial(loss, rule), argnums=(0, 1, 2)))(x, nz, STATE)
                 for rule in (dr.delta_rule_blocks, chunked))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    assert float(jnp.abs(want[0].g).max()) > 0.1  # the decay's gradient flows through both forms


@pytest.fixture
def chunked_mixer(monkeypatch):
    """The mixer on the chunked rule for every window, in chunks of 8 (a block of CFG); a new jitted function
    (the constants are read while tracing), and a list that grows by one each time the chunked rule is traced."""
    traced = []
    chunked = dr.delta_rule_blocks_chunked

    def counted(*a, **k):
        traced.append(1)
        return chunked(*a, **k)

    monkeypatch.setattr(dr, "delta_rule_blocks_chunked", counted)
    monkeypatch.setattr(dr, "BLOCKS_SCAN_MAX", 0)
    monkeypatch.setattr(dr, "CHUNK", 8)
    monkeypatch.setattr(dr, "CPU_SCAN", False)  # (else the mixer's forward runs the scan on a CPU)
    return jax.jit(lambda *a, **k: gdn.mixer(*a, **k), static_argnums=2, static_argnames=("two_stream",)), traced


def test_chunked_mixer_equals_the_scan_with_padding_a_cache_and_commit(chunked_mixer):
    """Prefill-like windows: rows with different left pads and a partial last block, from a cache (state and
    conv tail), keeping the state after a traced commit (inside the window, and all of it)."""
    chunked_mixer, traced = chunked_mixer
    w = _mixer_weights(2)
    t = 37
    valid = jnp.arange(t)[None] >= jnp.asarray([[0], [5], [11]])
    blocks = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0) // CFG.block_size
    x = jax.random.normal(jax.random.key(8), (3, t, CFG.d_model))
    scan = jax.jit(lambda *a: gdn.mixer(*a), static_argnums=2)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dr, "BLOCKS_SCAN_MAX", 256)
        shapes = jax.eval_shape(lambda: gdn.mixer(x, w, CFG, valid, None, blocks)[1])
        zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        _, cache = scan(jax.random.normal(jax.random.key(9), x.shape), w, CFG, jnp.ones_like(valid), zero,
                        jnp.zeros_like(blocks), jnp.int32(t))  # a cache (one compile with the runs below)
        wants = [scan(x, w, CFG, valid, cache, blocks, jnp.int32(commit)) for commit in (29, t)]
    assert not traced
    for commit, want in zip((29, t), wants, strict=True):
        got = chunked_mixer(x, w, CFG, valid, cache, blocks, jnp.int32(commit))
        assert float(jnp.abs(want[0]).max()) > 0.1
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert traced  # the chunked rule ran


@pytest.mark.parametrize("bd", ["reconstructed", "none"])
def test_chunked_two_stream_mixer_equals_the_scan(chunked_mixer, bd):
    """Block-diffusion training's (noisy, clean) halves, a right-padded row among them: the mixer's output and
    state, and (block diffusion) the gradient of its output with respect to the input."""
    chunked_mixer, traced = chunked_mixer
    cfg = CFG.replace(bd_gdn=bd)
    w = _mixer_weights(4)
    n = 40
    valid = jnp.concatenate([jnp.ones((1, n), bool), (jnp.arange(n) < 29)[None]])
    blocks = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0) // CFG.block_size
    valid2, blocks2 = jnp.concatenate([valid, valid], 1), jnp.concatenate([blocks, blocks], 1)
    keep = valid2[:, :, None]  # (the padding columns past a block's reach are unspecified)
    x = jax.random.normal(jax.random.key(10), (2, 2 * n, CFG.d_model))
    r = jax.random.normal(jax.random.key(11), (2, 2 * n, CFG.d_model))

    def run(x):  # the mixer's (loss, (output, state)), traced with the module's current constants
        y, state = gdn.mixer(x, w, cfg, valid2, blocks=blocks2, two_stream=True)
        return jnp.sum(jnp.where(keep, y, 0) * r), (jnp.where(keep, y, 0), state)

    form = jax.grad(run, has_aux=True) if bd == "reconstructed" else lambda x: (None, run(x)[1])
    got = jax.jit(form)(x)
    n = len(traced)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dr, "BLOCKS_SCAN_MAX", 256)
        want = jax.jit(lambda x: form(x))(x)
    assert n and len(traced) == n  # the chunked rule ran for `got`, the scan for `want`
    assert float(jnp.abs(want[1][0]).max()) > 0.1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_a_forward_window_runs_the_scan_on_a_cpu_and_chunks_on_a_tpu():
    """`blocks_rule(..., inference=True)` chooses by the platform the program is lowered for: a program exported
    for a CPU loops over the 320 positions, one exported for a TPU (from this CPU host) over 5 chunks of 64;
    training's rule (inference=False) and CPU_SCAN cleared chunk on a CPU too."""
    t = 320
    st = dr.Stream(*(jnp.zeros(s) for s in [(1, t, 2, 16), (1, t, 2, 16), (1, t, 4, 8), (1, t, 4), (1, t, 4)]))
    blocks, valid = jnp.arange(t)[None] // 32, jnp.ones((1, t), bool)

    def lowered(platform: str, inference: bool = True) -> str:
        f = jax.jit(lambda s: dr.blocks_rule(t, 32, inference=inference)(s, blocks, valid, history=True))
        return jax.export.export(f, platforms=[platform])(st).mlir_module()

    trip = "stablehlo.constant dense<{}> : tensor<i32>"
    cpu, tpu = lowered("cpu"), lowered("tpu")
    assert trip.format(t) in cpu and trip.format(5) not in cpu
    assert trip.format(5) in tpu
    assert trip.format(5) in lowered("cpu", inference=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dr, "CPU_SCAN", False)
        assert trip.format(5) in lowered("cpu")
