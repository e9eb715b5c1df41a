"""The lm-eval model `clover` end to end on the shipped clover-tiny, offline: the local Shakespeare tasks of
tests/fixtures/eval_tasks through lm-eval's own `simple_evaluate` and through `clover eval`.

The multiple-choice task (the real next line of unseen text among 4, the others shuffled) is one the tiny model
can do: measured at acc 0.52-0.56, acc_norm 0.54-0.60 over its 48 items with mc_num=4 (seeds 0, 1, 2; 0.54 / 0.63
with mc_num=8); the test asks for 0.40, well above chance (0.25: 20 or more of 48 has probability 0.01).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval model needs the eval extra (pip install '.[eval]')")

from lm_eval.tasks import TaskManager  # noqa: E402

from clover_jax.cli import main  # noqa: E402
from clover_jax.evaluation import EvaluationError, harness  # noqa: E402
from clover_jax.evaluation.harness import CloverLM, cut_at_stop, register, settings_from  # noqa: E402

pytestmark = pytest.mark.xdist_group("eval_harness")
TASKS = Path(__file__).parent / "fixtures" / "eval_tasks"
ARGS = {"mc_num": 4, "batch_size": 4}


class _Request:
    """The one field of an lm-eval Instance that CloverLM reads."""

    def __init__(self, args: tuple) -> None:
        self.args = args


@pytest.fixture(scope="module")
def lm() -> CloverLM:
    register()
    return CloverLM(**ARGS)


@pytest.fixture(scope="module")
def generated():
    """(prompt ids, generated ids) of every row the sampler produced during `results`, before any stop-string cut."""
    return []


@pytest.fixture(scope="module")
def results(lm, generated):
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    real = harness.generate

    def recording(weights, cfg, prompts, sc, **kwargs):
        res = real(weights, cfg, prompts, sc, **kwargs)
        generated.extend(zip((list(p) for p in prompts), (list(t) for t in res.tokens), strict=True))
        return res

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "generate", recording)
        return lm_eval.simple_evaluate(model=lm, tasks=["shakespeare_next_line", "shakespeare_continue"],
                                       task_manager=manager, limit=None, log_samples=True,
                                       samples={"shakespeare_continue": [0, 1, 2, 3]})


def test_multiple_choice_beats_chance(results, lm):
    r = results["results"]["shakespeare_next_line"]
    assert results["n-samples"]["shakespeare_next_line"]["effective"] == 48
    assert r["acc,none"] >= 0.40 and r["acc_norm,none"] >= 0.40, r  # chance is 0.25
    errors = [e.stderr for kind, e in lm.estimates if kind == "loglikelihood"]
    # the shipped model runs with a causal prefix: its likelihoods are exact (the causal path), no Monte Carlo
    assert len(errors) >= 4 * 48 and all(se == 0 for se in errors)


def test_generation_task_runs(results, lm, generated):
    r = results["results"]["shakespeare_continue"]
    samples = results["samples"]["shakespeare_continue"]
    assert len(samples) == 4
    raw = {tuple(p): lm.tok.decode(t) for p, t in generated}
    cut = 0
    for s in samples:
        context, gen_kwargs = s["arguments"][0]
        assert gen_kwargs["until"] == ["\n\n"]
        text = raw[tuple(lm.tok.encode(context))]  # the sampler's whole continuation of this prompt
        # The response is the raw continuation up to (not including) the first blank line, cut independently here.
        want = text.split("\n\n", 1)[0]
        assert s["resps"][0][0] == want, (text, s["resps"][0][0])
        cut += len(want) < len(text)
    assert cut >= 1  # the stop string occurred (measured: in all 4 continuations), so the cut was exercised
    assert any(s["resps"][0][0].strip() for s in samples)
    # exact_match is the mean of response == target over the 4 items, as computed here
    assert r["exact_match,none"] == pytest.approx(sum(s["resps"][0][0] == s["target"] for s in samples) / 4)


def test_clover_eval_command(tmp_path, capsys, lm):
    out = tmp_path / "r.json"
    code = main(["eval", "--tasks", "shakespeare_next_line", "--include-path", str(TASKS), "--no-builtin-tasks",
                 "--limit", "3", "--model-args", "mc_num=4,batch_size=4", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "shakespeare_next_line" in printed and "acc" in printed
    assert "loglikelihood: 12 estimates, Monte-Carlo standard error" in printed
    doc = json.loads(out.read_text())
    # The accuracy, recomputed outside lm-eval: the model's log-likelihood of each of the first 3 items' choices
    # (same mc_num, batch_size and seed: the estimator's draws depend only on the seed and the ids, so the values
    # are the ones the command computed), argmax against the gold label.
    items = [json.loads(line) for line in (TASKS / "shakespeare_next_line.jsonl").read_text().splitlines()][:3]
    hits = 0
    for item in items:
        scores = [ll for ll, _ in lm.loglikelihood([_Request((item["context"], c)) for c in item["choices"]],
                                                   disable_tqdm=True)]
        hits += max(range(len(scores)), key=scores.__getitem__) == item["label"]
    assert doc["results"]["shakespeare_next_line"]["acc,none"] == pytest.approx(hits / 3)
    assert doc["clover"]["likelihood_error"]["loglikelihood"]["count"] == 12


def test_clover_eval_refuses_bad_requests(tmp_path, capsys, monkeypatch):
    assert main(["eval", "--tasks", "nope_task", "--include-path", str(TASKS), "--no-builtin-tasks"]) == 2
    assert "unknown task(s): nope_task" in capsys.readouterr().err
    assert main(["eval", "--tasks", "x", "--model-args", "mc_num=7,batch_size=2"]) == 2
    assert "multiple of batch_size" in capsys.readouterr().err
    assert main(["eval", "--tasks", "x", "--model-args", "colour=red"]) == 2
    assert "unknown model argument 'colour'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert main(["eval", "--tasks", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["clover eval: error: clover eval needs lm-evaluation-harness: pip install 'clover-jax[eval]'"]


def test_rolling_windows_sum(lm):
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."
    lm.max_length = 8  # several windows
    try:
        before = len(lm.estimates)
        (total,) = lm.loglikelihood_rolling([type("R", (), {"args": (text,)})()], disable_tqdm=True)
    finally:
        lm.max_length = lm.cfg.max_seq_len
    windows = [e for kind, e in lm.estimates[before:] if kind == "loglikelihood_rolling_window"]
    assert len(windows) >= 3 and total < 0
    assert abs(total - sum(e.mean for e in windows)) < 1e-6


def test_stop_strings_and_settings():
    assert cut_at_stop("abc\ndef. ghi", ["\n", "."]) == "abc"
    assert cut_at_stop("abc", ["x", ""]) == "abc"
    assert settings_from({"check_greedy": "true", "gen_length": "None"}).check_greedy is True
    with pytest.raises(EvaluationError, match="true or false"):
        settings_from({"check_greedy": "maybe"})


def test_model_args_win_over_lm_eval_settings():
    lm = CloverLM.create_from_arg_string("mc_num=8,batch_size=8", {"batch_size": 1, "device": None})
    assert (lm.settings.mc_num, lm.settings.batch_size) == (8, 8)
    assert CloverLM.create_from_arg_obj({"mc_num": 8}, {"batch_size": 4}).settings.batch_size == 4
