"""An agent loop end to end: the shipped clover-tiny (a Tiny Shakespeare model that has never seen a tool) is
fine-tuned in the test with block-diffusion SFT on transcripts of the toy tool task
(`clover_jax.serving.toy_agent`: add, mul, capital; the plain chat format with the tools), then served by
the real `clover serve` app (an `Engine` behind `make_app`, uvicorn on loopback in a thread) and driven by
the real `openai` client: it asks held-out questions with the tools, executes each call, sends the result
back and reads the final answer, streamed and not. The untrained model, asked the same way, calls nothing.

The fine-tuning recipe here (400 steps of 8 rows x 160 tokens, about 24 minutes on 2 busy CPU cores) does not
yet teach the 4M-parameter model the call format: it writes the tags but garbles the JSON inside (measured
2026-12-03, 0 of 12 held-out questions; see docs/performance.md), so the agent test is an expected failure
until a recipe that learns the task is found.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import clover_jax
from clover_jax import shipped
from clover_jax.serving import toy_agent
from clover_jax.serving.tool_parse import parse_calls
from clover_jax.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow  # minutes of fine-tuning on 2 CPU cores

STEPS, N_TRAIN, N_HELD = 400, 600, 12


@pytest.fixture(scope="session")
def tool_model():
    """(cfg, tuned weights, base weights, tokenizer, held-out tasks): clover-tiny fine-tuned on the task."""
    model_dir = str(shipped.MODEL_DIR)
    cfg, weights = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    train, held = toy_agent.split(N_TRAIN, N_HELD, seed=0)
    assert not {t.question for t in train} & {t.question for t in held}
    tuned = toy_agent.finetune(cfg, weights, tok, train, steps=STEPS)
    return cfg, tuned, weights, tok, held


@pytest.fixture(scope="session")
def agent_server(tool_model):
    """The tuned model served on a free loopback port: (openai client, model name)."""
    from clover_jax.serving.api import make_app
    from clover_jax.serving.engine import Engine

    cfg, tuned, _, tok, _ = tool_model
    eng = Engine(tuned, cfg, max_prompt=192, max_tokens=96, batch_sizes=(1, 4), queue_size=64)
    eng.warm_up(lambda line: None)
    eng.start()
    srv = uvicorn.Server(uvicorn.Config(make_app(eng, tok, cfg.name), host="127.0.0.1", port=0,
                                        log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (srv.started and srv.servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600), cfg.name
    srv.should_exit = True
    thread.join(30)
    eng.drain(timeout=60)


@pytest.mark.xfail(reason="400 steps of SFT do not teach clover-tiny the call format yet", strict=False)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_held_out_questions_are_answered_through_tool_calls(agent_server, tool_model, stream):
    client, name = agent_server
    held = tool_model[4]
    with ThreadPoolExecutor(4) as pool:  # four rows of one batch
        episodes = list(pool.map(lambda t: toy_agent.run_agent(client, name, t, stream=stream), held))
    solved = [e for e in episodes if e.correct and e.calls == 1]
    report = [(e.task.question, e.answer, e.steps) for e in episodes]
    assert len(solved) >= 0.7 * len(held), report
    assert all(e.steps == 2 for e in solved)  # one call, then the answer


def test_the_untrained_model_calls_no_tools():
    """The same first turn, rendered as the server renders it, through `generate` on the shipped weights:
    no valid call at all (so the fine-tuned rate above is the task learned, not the format guessed)."""
    model_dir = str(shipped.MODEL_DIR)
    cfg, base = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    held = toy_agent.split(N_TRAIN, N_HELD, seed=0)[1]
    specs = {s.name: s for s in toy_agent.specs()}
    prompts = [tok.encode(toy_agent.sft_rows([t])[0]["prompt"]) for t in held]
    sampler = clover_jax.SamplerConfig(gen_length=64, block_length=32, steps=32, temperature=0.0,
                                       remasking="low_confidence", seed=0)
    res = clover_jax.generate(base, cfg, prompts, sampler)
    calls = [parse_calls(tok.decode(t), specs).calls for t in res.tokens]
    assert sum(bool(c) for c in calls) == 0, [tok.decode(t) for t in res.tokens]
