"""Training: the loss falls, resume reproduces the uninterrupted run, block-diffusion masks, SFT, MoE losses."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.model import forward, masks, params
from clover_jax.model.moe import MoEStats
from clover_jax.training import Batch, EvalProtocol, PairDataset, TokenStream, TrainConfig, evaluate, losses, train

CFG = get_config("test-clover")  # block-causal, blocks of 8, vocab 256, mask 255


def synthetic_ids(n: int = 20_000, seed: int = 0) -> np.ndarray:
    """A corpus with learnable structure: runs of counting sequences with random starts and strides."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        start, stride, length = rng.integers(5, 60), rng.integers(1, 4), rng.integers(8, 40)
        out.extend(5 + (start + stride * np.arange(length)) % 200)
    return np.asarray(out[:n], np.int32)


def test_loss_falls_on_synthetic_corpus() -> None:
    # A period-12 sequence: any unmasked token (and the position) determines every masked one.
    ids = (5 + np.arange(6000) % 12).astype(np.int32)
    tc = TrainConfig(steps=30, batch_size=8, seq_len=16, lr=1e-2, warmup_steps=3, eval_every=30, eval_seqs=8)
    res = train(CFG, tc, TokenStream(ids[:5000], 16, 0), TokenStream(ids[5000:], 16, 0), progress=False)
    first, last = np.mean(res.losses[:3]), np.mean(res.losses[-3:])
    assert last < 0.5 * first, (first, last)
    assert res.evals and res.evals[-1]["eval_loss"] < 0.5 * np.log(CFG.vocab_size), res.evals


def test_hybrid_trains_and_resumes_under_another_name(tmp_path) -> None:
    """Block-diffusion training of a hybrid (block-diffusion Gated DeltaNet) config: the loss falls; a run
    resumes (layer_types comes back from JSON as a list) and under a renamed but identical config."""
    cfg = get_config("test-clover-hybrid")
    ids = (5 + np.arange(6000) % 12).astype(np.int32)
    tc = TrainConfig(steps=16, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2, ckpt_every=100)
    data = TokenStream(ids, 16, 0)
    first = train(cfg, tc, data, ckpt_dir=str(tmp_path / "run"), stop_at=8, progress=False)
    rest = train(cfg.replace(name="renamed"), tc, data, ckpt_dir=str(tmp_path / "run"), progress=False)
    assert rest.first_step == 8 and int(rest.state.step) == 16
    losses_ = first.losses + rest.losses
    assert np.mean(losses_[-3:]) < 0.6 * np.mean(losses_[:3]), losses_
    with pytest.raises(ValueError, match="different model config"):
        train(cfg.replace(bd_gdn="none"), dataclasses.replace(tc, steps=25), data, ckpt_dir=str(tmp_path / "run"),
              progress=False)


def test_resume_reproduces_uninterrupted_run(tmp_path) -> None:
    ids = synthetic_ids(4000)
    data = TokenStream(ids, 32, 1)
    tc = TrainConfig(steps=6, batch_size=4, grad_accum=2, seq_len=32, lr=3e-3, warmup_steps=2, ckpt_every=100)
    full = train(CFG, tc, data, progress=False)
    first = train(CFG, tc, data, ckpt_dir=str(tmp_path / "run"), stop_at=3, progress=False)
    assert int(first.state.step) == 3
    rest = train(CFG, tc, data, ckpt_dir=str(tmp_path / "run"), progress=False)
    assert rest.first_step == 3 and int(rest.state.step) == 6
    assert rest.total_tokens == full.total_tokens == 6 * 4 * 32  # data position and counters carried over
    resumed = first.losses + rest.losses
    np.testing.assert_allclose(resumed, full.losses, rtol=0, atol=1e-6)
    for a, b in zip(jax.tree.leaves(full.state.weights), jax.tree.leaves(rest.state.weights), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_block_diffusion_mask_quadrants() -> None:
    # Two blocks of 2 tokens, last token of the second row is padding.
    valid = jnp.array([[True] * 4, [True, True, True, False]])
    blk = masks.positions(valid) // 2
    m = np.asarray(masks.block_diffusion_mask(valid, blk))
    assert m.shape == (2, 8, 8)
    nn, nc, cn, cc = m[0, :4, :4], m[0, :4, 4:], m[0, 4:, :4], m[0, 4:, 4:]
    same = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], bool)
    before = np.array([[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]], bool)
    upto = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(nn, same)  # noisy block i sees only noisy block i
    np.testing.assert_array_equal(nc, before)  # ... and the clean blocks before it
    np.testing.assert_array_equal(cn, np.zeros((4, 4), bool))  # clean never sees noisy
    np.testing.assert_array_equal(cc, upto)  # clean block j sees clean blocks <= j
    assert not m[1, :, 3].any() and not m[1, :, 7].any()  # padding keys hidden in both halves


def test_block_diffusion_logits_equal_inference_context() -> None:
    """Noisy block i in the 2L pass gets exactly the logits of a pass over [clean blocks < i, noisy block i]."""
    w = params.init(CFG, jax.random.PRNGKey(0))
    bs, nb, b = CFG.block_size, 3, 2
    clean = jax.random.randint(jax.random.PRNGKey(1), (b, bs * nb), 5, 250)
    noisy, _ = losses.corrupt(jax.random.PRNGKey(2), clean, jnp.ones(clean.shape, bool), jnp.full(clean.shape, 0.5),
                              CFG.mask_token_id)
    valid = jnp.ones(clean.shape, bool)
    got = losses.denoising_forward(w, CFG, noisy, clean, valid, dispatch="dense").logits
    for i in range(nb):
        ctx = jnp.concatenate([clean[:, : i * bs], noisy[:, i * bs: (i + 1) * bs]], axis=1)
        v = jnp.ones(ctx.shape, bool)
        ref = forward(w, CFG, ctx, masks.positions(v), masks.full_mask(CFG, v), dispatch="dense").logits[:, i * bs:]
        np.testing.assert_allclose(np.asarray(got[:, i * bs: (i + 1) * bs]), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["test-clover", "test-clover-hybrid"])
def test_sft_on_the_prompt_grid_equals_the_samplers_canvas(name) -> None:
    """A prompt / response row on the prompt grid (the response's blocks start where the prompt ends, as the
    sampler lays its canvas): noisy response block i gets exactly the logits of the sampler's pass over
    [prompt | committed blocks < i | block i] with `canvas_block_ids`, Gated DeltaNet blocks included. The
    absolute grid (the response's first block shares the prompt's last partial one) does not."""
    cfg = get_config(name)
    bs, p, nb, b = cfg.block_size, 5, 2, 2  # a prompt of 5 tokens, blocks of 8: not on the absolute grid
    clean = jax.random.randint(jax.random.PRNGKey(1), (b, p + nb * bs), 5, 250)
    scored = jnp.broadcast_to(jnp.arange(p + nb * bs) >= p, clean.shape)
    noisy = jnp.where(scored, cfg.mask_token_id, clean)
    valid = jnp.ones(clean.shape, bool)
    w = params.init(cfg, jax.random.PRNGKey(0))
    blk = masks.training_block_ids(cfg, valid, scored, "prompt")
    np.testing.assert_array_equal(np.asarray(blk[0]), [0] * 5 + [1] * 8 + [2] * 8)
    assert losses.n_blocks(cfg, p + nb * bs, "prompt") > int(blk.max())
    got = losses.denoising_forward(w, cfg, noisy, clean, valid, dispatch="dense", blocks=blk).logits
    absolute = losses.denoising_forward(w, cfg, noisy, clean, valid, dispatch="dense").logits
    for i in range(nb):
        lo, hi = p + i * bs, p + (i + 1) * bs
        ctx = jnp.concatenate([clean[:, :lo], noisy[:, lo:hi]], axis=1)
        v = jnp.ones(ctx.shape, bool)
        ids = masks.canvas_block_ids(masks.positions(v), p, bs, cfg.block_size)
        ref = forward(w, cfg, ctx, masks.positions(v), masks.full_mask(cfg, v, ids), dispatch="dense", valid=v,
                      blocks=ids).logits[:, lo:]
        np.testing.assert_allclose(np.asarray(got[:, lo:hi]), np.asarray(ref), atol=2e-5, rtol=1e-5)
        assert np.abs(np.asarray(absolute[:, lo:hi]) - np.asarray(ref)).max() > 1e-3
    text = masks.training_block_ids(cfg, valid, valid, "prompt")  # plain text: every column scored
    np.testing.assert_array_equal(np.asarray(text), np.asarray(masks.block_ids(cfg, valid)))


def test_block_grid_settings() -> None:
    """`auto` is the family's generation grid (Clover: prompt, LLaDA2: absolute); anything else is refused."""
    from clover_jax.sampler.settings import resolve_rule

    assert masks.resolve_block_grid(CFG, TrainConfig().block_grid) == "prompt"
    assert masks.resolve_block_grid(get_config("test-llada2"), "auto") == "absolute"
    assert masks.resolve_block_grid(CFG, "absolute") == "absolute"
    for cfg in (CFG, get_config("test-llada2")):  # the sampler resolves `auto` by the same rule
        assert resolve_rule(cfg, "block_grid", "auto") == masks.resolve_block_grid(cfg, "auto")
    with pytest.raises(ValueError, match="unknown block grid 'diagonal'"):
        TrainConfig(block_grid="diagonal")


def test_sft_masks_only_the_response(tmp_path) -> None:
    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "ab", "response": "cde"}\n\n{"prompt": "x", "response": "y"}\n')
    enc = lambda s: [ord(c) for c in s]
    ds = PairDataset(str(path), enc, seq_len=8, eos_id=1, pad_id=0, seed=0, eos_padding=False)
    np.testing.assert_array_equal(ds.tokens[0], [97, 98, 99, 100, 101, 1, 0, 0])
    np.testing.assert_array_equal(ds.loss_mask[0], [0, 0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(ds.valid[1], [1, 1, 1, 0, 0, 0, 0, 0])
    # the default (LLaDA's recipe): the row continues with end tokens, valid and scored like the response
    filled = PairDataset(str(path), enc, seq_len=8, eos_id=1, pad_id=0, seed=0)
    np.testing.assert_array_equal(filled.tokens[1], [120, 121, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(filled.loss_mask[1], [0, 1, 1, 1, 1, 1, 1, 1])
    assert filled.valid.all()
    no_eos = PairDataset(str(path), enc, seq_len=8, eos_id=None, pad_id=0, seed=0)  # nothing to fill with
    np.testing.assert_array_equal(no_eos.valid[1], [1, 1, 0, 0, 0, 0, 0, 0])
    tok, lm = jnp.asarray(ds.tokens), jnp.asarray(ds.loss_mask)
    noisy, masked = losses.corrupt(jax.random.PRNGKey(0), tok, lm, jnp.ones(tok.shape), 255)
    np.testing.assert_array_equal(np.asarray(masked), ds.loss_mask)  # t=1: every response token, nothing else
    assert (np.asarray(noisy)[~ds.loss_mask] == ds.tokens[~ds.loss_mask]).all()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ab"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object with 'prompt' and 'response'"):
        PairDataset(str(bad), enc, 8, 1, 0, 0)
    for content, msg in ((b'{"prompt": "a", "response": "b"}\n[1]\n', r"bad.jsonl:2: each line must be a JSON object"),
                         (b'\n{"prompt": "a", "response": \n', r"bad.jsonl:2: not valid JSON"),
                         (b'{"prompt": "\xc3(", "response": "b"}\n', r"bad.jsonl:1: not UTF-8 text \(byte 0xc3\)")):
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=msg):
            PairDataset(str(bad), enc, 8, 1, 0, 0)


def test_sft_training_runs_and_scores_only_responses(tmp_path) -> None:
    path = tmp_path / "sft.jsonl"
    rows = [f'{{"prompt": "{"q" * (i % 5 + 1)}", "response": "{"a" * (i % 7 + 1)}"}}' for i in range(40)]
    path.write_text("\n".join(rows) + "\n")
    enc = lambda s: [ord(c) for c in s]
    tr, ev = PairDataset(str(path), enc, 16, 1, 0, 0).split(0.1)
    tc = TrainConfig(steps=8, batch_size=8, seq_len=16, lr=5e-3, warmup_steps=2)
    seen: list[tuple[int, float]] = []
    res = train(CFG, tc, tr, ev, progress=False, on_step=lambda step, m: seen.append((step, m["loss"])))
    assert np.isfinite(res.losses).all() and np.mean(res.losses[-3:]) < np.mean(res.losses[:3])
    assert seen == list(zip(range(1, 9), res.losses, strict=True))  # on_step: every step, its own metrics

    # Only responses are scored: one training step at t ~ 1 (every response token masked, the prompt clean) on a
    # fixed batch reports the mean cross-entropy over the response tokens, computed here from one forward pass of
    # the trained weights. Scoring the prompt too would give another figure (measured: 3.07 over the responses,
    # 3.74 over every token, masked or not).
    b = tr.batch(100, 8)
    fixed = type("Fixed", (), {"batch": lambda self, index, n: b})()
    t1 = TrainConfig(steps=1, batch_size=8, seq_len=16, noise_eps=1 - 1e-6, noise_max=1.0)
    w = res.state.weights
    step_loss = train(CFG, t1, fixed, progress=False, init_weights=jax.tree.map(jnp.copy, w),  # (donated)
                      eval_at_end=False).losses[0]
    tok, val, scored = jnp.asarray(b.tokens), jnp.asarray(b.valid), jnp.asarray(b.loss_mask)
    assert b.loss_mask.sum() < b.valid.sum() and not (b.loss_mask & ~b.valid).any()  # prompts are there, unscored

    def mean_ce(masked) -> tuple[float, float]:  # (over the response tokens, over every valid token)
        blocks = masks.training_block_ids(CFG, val, masked, masks.resolve_block_grid(CFG, "auto"))
        logits = losses.denoising_forward(w, CFG, jnp.where(masked, CFG.mask_token_id, tok), tok, val, t1.dispatch,
                                          blocks=blocks).logits.astype(jnp.float32)
        ce = np.asarray(-jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tok[..., None], -1)[..., 0])
        return float(ce[b.loss_mask].mean()), float(ce[b.valid].mean())

    responses, every = mean_ce(scored)
    assert step_loss == pytest.approx(responses, rel=1e-4)
    assert abs(step_loss - every) > 0.1 and abs(step_loss - mean_ce(val)[1]) > 0.1


def test_moe_aux_losses() -> None:
    e = 4
    uniform = MoEStats(load=jnp.full((2, e), 0.25), importance=jnp.full((2, e), 0.25), z_loss=jnp.ones(2),
                       dropped=jnp.zeros(2))
    skewed = uniform._replace(load=jnp.array([[1.0, 0, 0, 0]] * 2), importance=jnp.array([[0.7, 0.1, 0.1, 0.1]] * 2))
    assert float(losses.load_balancing_loss(uniform, e)) == pytest.approx(1.0)
    assert float(losses.load_balancing_loss(skewed, e)) == pytest.approx(2.8)
    assert float(losses.router_z_loss(uniform)) == pytest.approx(1.0)


def test_noise_levels_are_stratified() -> None:
    t = np.asarray(losses.sample_noise_levels(jax.random.PRNGKey(0), (4, 8), 1e-3))
    assert t.shape == (4, 8) and t.min() >= 1e-3 and t.max() < 1.0
    counts = np.histogram(t, bins=8, range=(0, 1))[0]
    assert (counts >= 3).all() and (counts <= 5).all()  # 32 draws, 4 per eighth up to the offset


def test_sharded_training_matches_single_device(devices) -> None:
    from clover_jax.mesh.layouts import load_layout

    mesh = load_layout("cpu-8").mesh_rules()
    ids = synthetic_ids(4000)
    tc = TrainConfig(steps=2, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=1)
    one = train(CFG, tc, TokenStream(ids, 16, 0), progress=False)
    sharded = train(CFG, tc, TokenStream(ids, 16, 0), mesh=mesh, progress=False)
    np.testing.assert_allclose(sharded.losses, one.losses, rtol=1e-4, atol=1e-5)
    gate = sharded.state.weights.moe_layers.mlp.gate
    assert gate.sharding.spec[1] == "expert"  # experts stayed sharded through the optimizer


def test_eval_is_deterministic() -> None:
    w = params.init(CFG, jax.random.PRNGKey(3))
    ids = synthetic_ids(2000)
    batch = TokenStream(ids, 32, 0).eval_batches(8)
    proto = EvalProtocol(micro_batch=4, n_seqs=8)
    a, b = evaluate(w, CFG, batch, proto), evaluate(w, CFG, batch, proto)
    assert a == b and a["eval_loss"] > 0
    # The masks are drawn: another seed draws others (so a == b above is the fixed seed at work, not a constant).
    assert evaluate(w, CFG, batch, dataclasses.replace(proto, seed=99))["eval_loss"] != a["eval_loss"]
    # At t = 1 every token is masked: the figures are the mean cross-entropy and argmax accuracy of one forward pass
    # over the fully masked sequences (1/t = 1), computed here.
    at_1 = evaluate(w, CFG, batch, dataclasses.replace(proto, t_grid=(1.0,)))
    tok, val = jnp.asarray(batch.tokens[:8]), jnp.asarray(batch.valid[:8])
    assert batch.loss_mask[:8].all()
    logits = losses.denoising_forward(w, CFG, jnp.full_like(tok, CFG.mask_token_id), tok, val, "dense",
                                      blocks=masks.training_block_ids(CFG, val, val, "absolute")).logits
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    ce = -np.asarray(jnp.take_along_axis(logp, tok[..., None], -1)[..., 0])
    acc = np.asarray(jnp.argmax(logits, -1) == tok).mean()
    assert at_1["eval_loss"] == pytest.approx(ce.mean(), rel=1e-5)
    assert at_1["eval_masked_ce"] == pytest.approx(ce.mean(), rel=1e-5)
    assert at_1["eval_masked_acc"] == pytest.approx(acc, abs=1e-6)


def test_cli_rejects_bad_input_before_compiling(tmp_path, capsys) -> None:
    from clover_jax.cli import main

    assert main(["train", "--config", "test-clover", "--data", str(tmp_path / "missing.txt"),
                 "--out", str(tmp_path / "run")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "c.txt").write_text("some text " * 100)
    text = str(tmp_path / "c.txt")
    assert main(["train", "--config", "test-clover", "--data", text, "--out", str(tmp_path / "r")]) == 2
    assert "the tokenizer has 260 ids but config 'test-clover' has vocab_size 256" in capsys.readouterr().err
    assert main(["train", "--config", "test-clover", "--data", "x", "--out", "o", "--batch-size", "6",
                 "--grad-accum", "4"]) == 2
    assert "divisible by grad_accum" in capsys.readouterr().err


def test_batches_are_a_function_of_the_index() -> None:
    ds = TokenStream(synthetic_ids(1000), 16, 7)
    a, b = ds.batch(5, 3), ds.batch(5, 3)
    assert isinstance(a, Batch) and (a.tokens == b.tokens).all() and not (ds.batch(6, 3).tokens == a.tokens).all()


def test_init_from_takes_another_reading_of_the_same_weights() -> None:
    """`clover train --init-from`: a config that only reads the same tensors another way (bd_gdn, the name) starts
    from the checkpoint, and the note says what changed; one whose weights differ is refused naming the fields."""
    from clover_jax.commands.train import init_changes
    from clover_jax.errors import UsageError

    base = get_config("test-clover-hybrid")
    assert init_changes(base, base, "ckpt") == ""
    said = init_changes(base, base.replace(bd_gdn="causal_prefix", name="prefix"), "ckpt")
    assert said == "name 'test-clover-hybrid' -> 'prefix', bd_gdn 'reconstructed' -> 'causal_prefix'"
    with pytest.raises(UsageError, match=r"do not fit --config: .*bd_conv_right_kernel 3 -> 4"):
        init_changes(base, base.replace(bd_conv_right_kernel=4), "ckpt")
