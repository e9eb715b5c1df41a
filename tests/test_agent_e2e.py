"""The agent loop end to end on a real model: the shipped clover-tiny served by the real `clover serve` app (an
`Engine` behind `make_app`, served on loopback in a thread by `serving.background`) and driven by the real `openai`
client with the toy task's tools (`clover_jax.serving.toy_agent`), streamed and not; and the fine-tuning step of
the recipe that teaches a model the task (`toy_agent.finetune`, run at length by `scripts/train_tool_model.py`),
run here from the shipped model.

The shipped model has never seen a tool: the loop must end each question after one step with plain text (no
call), the same text streamed and whole. A model that answers held-out questions through calls is not part of
these tests: the recipe has not yet taught clover-tiny to copy a question's number into its call (see the
agent section of docs/performance.md).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import clover_jax
from clover_jax import shipped
from clover_jax.serving import toy_agent
from clover_jax.serving.tool_parse import parse_calls
from clover_jax.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow  # serving programs and a short fine-tuning compile

N_TRAIN, N_HELD = 400, 20  # scripts/train_tool_model.py's split


@pytest.fixture(scope="session")
def agent_server():
    """The shipped model served on a free loopback port: (openai client, model name)."""
    from clover_jax.serving.background import serve_in_background
    from clover_jax.serving.engine import Engine

    model_dir = str(shipped.MODEL_DIR)
    cfg, weights = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    eng = Engine(weights, cfg, max_prompt=256, max_tokens=96, batch_sizes=(1, 4), queue_size=64)
    eng.warm_up(lambda line: None)
    eng.start()
    with serve_in_background(eng, tok, cfg.name) as srv:
        yield openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=600), cfg.name


def test_the_loop_through_the_server_ends_in_plain_text_streamed_or_not(agent_server):
    client, name = agent_server
    held = toy_agent.split(N_TRAIN, N_HELD, seed=0)[1][:4]
    runs = {}
    for stream in (False, True):
        with ThreadPoolExecutor(4) as pool:  # four rows of one batch
            runs[stream] = list(pool.map(lambda t, s=stream: toy_agent.run_agent(client, name, t, stream=s), held))
    for whole, streamed in zip(runs[False], runs[True], strict=True):
        for e in (whole, streamed):
            assert e.steps == 1 and e.calls == 0 and e.made == [] and e.answer and not e.through_the_tools, e
            assert 0 < e.tokens[0] <= 96
        assert whole.answer == streamed.answer and whole.tokens == streamed.tokens


def test_the_untrained_model_calls_no_tools():
    """The same first turn, rendered as the server renders it, through `generate` on the shipped weights:
    no valid call at all (so the fine-tuned rate above is the task learned, not the format guessed)."""
    model_dir = str(shipped.MODEL_DIR)
    cfg, base = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    held = toy_agent.split(N_TRAIN, N_HELD, seed=0)[1]
    specs = {s.name: s for s in toy_agent.specs()}
    prompts = [tok.encode(toy_agent.sft_rows([t])[0]["prompt"]) for t in held]  # each question's first turn
    sampler = clover_jax.SamplerConfig(gen_length=64, block_length=32, steps=32, temperature=0.0,
                                       remasking="low_confidence", seed=0)
    res = clover_jax.generate(base, cfg, prompts, sampler)
    calls = [parse_calls(tok.decode(t), specs).calls for t in res.tokens]
    assert sum(bool(c) for c in calls) == 0, [tok.decode(t) for t in res.tokens]


def test_the_recipe_lifts_the_untrained_digit_embeddings():
    """The shipped model's digits sit at their initial norm (Tiny Shakespeare has almost none); the recipe starts
    them at the vocabulary's median norm, directions and every other row unchanged."""
    import numpy as np

    model_dir = str(shipped.MODEL_DIR)
    _, base = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    digits = [tok.encode(str(d))[-1] for d in range(10)]
    before, after = np.asarray(base.embed), np.asarray(toy_agent.lift_digit_embeddings(base, tok).embed)
    norms = np.linalg.norm(before, axis=1)
    assert np.median(norms[digits]) < 0.6 * np.median(norms)  # why the recipe lifts them
    np.testing.assert_allclose(np.linalg.norm(after[digits], axis=1), np.median(norms), rtol=1e-5)
    cos = np.sum(after[digits] * before[digits], axis=1) / (np.linalg.norm(after[digits], axis=1) * norms[digits])
    np.testing.assert_allclose(cos, 1.0, rtol=1e-5)
    others = np.setdiff1d(np.arange(before.shape[0]), digits)
    np.testing.assert_array_equal(after[others], before[others])


def test_fine_tuning_on_the_task_lowers_its_loss():
    """`toy_agent.finetune` (the recipe's step) from the shipped model: 12 steps of 4 rows take the block-diffusion
    loss on the task's own rows far below the shipped model's (which has never seen a tool call)."""
    from clover_jax.training import PairDataset, evaluate

    model_dir = str(shipped.MODEL_DIR)
    cfg, base = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    train = toy_agent.split(N_TRAIN, N_HELD, seed=0)[0]
    recipe = toy_agent.Recipe(steps=12, batch_size=4, warmup_steps=5, lr=3e-3)
    tuned = toy_agent.finetune(cfg, base, tok, train[:60], recipe)
    import json
    import tempfile

    path = Path(tempfile.mkdtemp()) / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in toy_agent.sft_rows(train[:16])))
    batch = PairDataset(str(path), tok.encode, recipe.seq_len, cfg.eos_token_id, cfg.filler_id, seed=0).eval_batches(16)
    before, after = evaluate(base, cfg, batch)["eval_loss"], evaluate(tuned, cfg, batch)["eval_loss"]
    print(f"task loss: shipped {before:.3f}, after 12 steps {after:.3f}")
    assert after < 0.5 * before, (before, after)
