"""`clover train` end to end from the command line, in process: a run resumed with more --steps continues from its
checkpoint (the weights are exactly what `train` gives for that resumed schedule), --export writes a model that
`clover generate --model DIR` runs, --init-from starts from given weights, and --sft trains on prompt/response rows.

tests/test_train.py tests the training loop through the Python API; this module tests what the command wires up.
The runs share one tiny model (test-clover with the byte tokenizer's vocabulary) and one TrainConfig, so the train
step is compiled once for the module (`_single_device_step` is cached per config)."""

from __future__ import annotations

import contextlib
import io
import json
import re

import jax
import numpy as np
import pytest

from clover_jax import checkpoint
from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.tokenizer import ByteTokenizer
from clover_jax.training import TokenStream, TrainConfig, read_text, split_text, train

pytestmark = pytest.mark.xdist_group("train_cli")  # one worker runs the module fixture's two training runs

# test-clover (block-causal, blocks of 8) with the byte tokenizer's 260 ids: pad 0, eos 2, [MASK] 3.
CFG = get_config("test-clover").replace(name="test-clover-bytes", vocab_size=260, pad_token_id=0, eos_token_id=2,
                                        mask_token_id=3)
# What every run here passes: small, one eval at the very end only, a log line every step.
FLAGS = ["--batch-size", "8", "--seq-len", "16", "--lr", "1e-2", "--warmup", "2", "--eval-every", "1000",
         "--eval-seqs", "4", "--ckpt-every", "1000", "--log-every", "1", "--no-progress"]
FIRST, MORE = 15, 100  # --steps of the first run, and of the same command run again (SFT: 100 steps learn it)
PERIOD = "abcdefghijkl"  # a corpus any unmasked byte of a window determines: learnt in a few steps


def tc_of(steps: int) -> TrainConfig:
    """The TrainConfig `clover train` builds from FLAGS and `--steps steps` (its defaults otherwise)."""
    return TrainConfig(steps=steps, batch_size=8, seq_len=16, lr=1e-2, warmup_steps=2, eval_every=1000, eval_seqs=4,
                       ckpt_every=1000, log_every=1, dispatch="tiled")


def step_losses(err: str) -> dict[int, float]:
    """{step: loss} from the log lines `step N ... loss X ...` on stderr."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+) .*?\bloss (\S+)", err, re.M)}


def final_line(out: str) -> dict:
    """The JSON line `clover train` prints on stdout at the end."""
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))


def assert_same_weights(a, b, atol: float = 1e-6) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_cli")
    (d / "config.json").write_text(json.dumps(CFG.to_dict()))
    (d / "corpus.txt").write_text(PERIOD * 400)
    return d


@pytest.fixture(scope="module")
def resumed(work):
    """`clover train ... --steps FIRST`, then the same command with `--steps MORE --export`: (stdout, stderr) of
    each run, and the export's path."""
    base = ["train", "--config", str(work / "config.json"), "--data", str(work / "corpus.txt"), "--out",
            str(work / "run"), *FLAGS]
    runs = []
    for extra in (["--steps", str(FIRST)], ["--steps", str(MORE), "--export", str(work / "model")]):
        out, err = io.StringIO(), io.StringIO()  # capsys is per test: the module fixture catches its own output
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main([*base, *extra]) == 0, err.getvalue()
        runs.append((out.getvalue(), err.getvalue()))
    return runs, work / "model"


def test_the_same_command_with_more_steps_resumes(resumed, work):
    (out1, err1), (out2, err2) = resumed[0]
    first, second = step_losses(err1), step_losses(err2)
    assert sorted(first) == list(range(1, FIRST + 1)) and "resumed" not in err1
    assert f"resumed from {work / 'run'} at step {FIRST}" in err2
    assert sorted(second) == list(range(FIRST + 1, MORE + 1))  # it went on from the checkpoint, not from step 0
    assert final_line(out1)["step"] == FIRST and final_line(out2)["step"] == MORE
    assert final_line(out2)["tokens_seen"] == MORE * 8 * 16  # the token count carried over too
    assert np.mean([second[s] for s in range(MORE - 2, MORE + 1)]) < 0.5 * np.mean([first[s] for s in (1, 2, 3)])

    # The weights are exactly what the resumed schedule gives: the first FIRST steps on a cosine spanning FIRST
    # steps, the rest on one spanning MORE, from the same batches (`train` through the API, resumed the same way).
    text = read_text(str(work / "corpus.txt"))
    ids = np.asarray(ByteTokenizer().encode(split_text(text, 0.05)[0]), np.int32)
    data = TokenStream(ids, 16, 0)
    ckpt = str(work / "api-run")
    train(CFG, tc_of(FIRST), data, ckpt_dir=ckpt, progress=False, eval_at_end=False)
    api = train(CFG, tc_of(MORE), data, ckpt_dir=ckpt, progress=False, eval_at_end=False)
    assert api.first_step == FIRST
    np.testing.assert_allclose(api.losses, [second[s] for s in sorted(second)], rtol=0, atol=1e-4)  # logged: 4 decimals
    cfg, exported = checkpoint.load_model(str(resumed[1]))
    assert cfg.to_dict() == CFG.to_dict()
    assert_same_weights(exported, api.state.weights)
    # ... which is not what one uninterrupted run of MORE steps gives: its first steps ran on the longer cosine
    fresh = train(CFG, tc_of(MORE), data, progress=False, eval_at_end=False)
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
               zip(jax.tree.leaves(fresh.state.weights), jax.tree.leaves(exported), strict=True)) > 1e-4


def test_export_runs_in_clover_generate(resumed, capsys):
    model = resumed[1]
    assert (model / "MODEL_CARD.md").is_file() and (model / "config.json").is_file()
    card = (model / "MODEL_CARD.md").read_text()
    assert "test-clover-bytes" in card
    capsys.readouterr()
    assert main(["generate", "abcdefgh", "--model", str(model), "--gen-length", "16", "--block-length", "8",
                 "--temperature", "0", "--no-eos-stop"]) == 0
    out, err = capsys.readouterr()
    assert "forward passes" in err and "RANDOM weights" not in err
    # the model's own greedy text: what the sampler makes of the trained weights (equal to the exported ones, above)
    cfg, weights = checkpoint.load_model(str(model))
    tok = ByteTokenizer()
    res = generate(weights, cfg, [tok.encode("abcdefgh")], SamplerConfig(gen_length=16, block_length=8,
                                                                          eos_stop=False))
    assert out == tok.decode(res.tokens[0]) + "\n" and len(res.tokens[0]) == 16


def test_init_from_starts_from_the_given_weights(resumed, work, capsys):
    """--init-from the exported model: step 1 (the same batch and masks as the first run's step 1, the same
    TrainConfig) scores far below a fresh model's step 1; --stop-at 1 keeps the schedule, so the program too."""
    first = step_losses(resumed[0][0][1])
    capsys.readouterr()
    assert main(["train", "--config", str(work / "config.json"), "--data", str(work / "corpus.txt"), "--out",
                 str(work / "init-run"), *FLAGS, "--steps", str(FIRST), "--stop-at", "1", "--init-from",
                 str(resumed[1])]) == 0
    err = capsys.readouterr().err
    got = step_losses(err)
    assert sorted(got) == [1] and "initialising" not in err
    assert got[1] < 0.5 * first[1], (got[1], first[1])


def test_sft_from_the_command_line(work, capsys):
    """--sft on prompt/response rows (every response "yes"), exported: the model answers a prompt it never saw with
    "yes" and stops (the end tokens after the response are trained too, LLaDA's recipe)."""
    rows = [{"prompt": f"q{i * 7 % 100}?", "response": "yes"} for i in range(60)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["train", "--config", str(work / "config.json"), "--sft", str(work / "pairs.jsonl"), "--out",
                 str(work / "sft-run"), *FLAGS, "--steps", str(MORE), "--export", str(work / "sft")]) == 0
    out, err = capsys.readouterr()
    assert final_line(out)["step"] == MORE and np.isfinite(final_line(out)["eval_loss"]), out
    losses_ = step_losses(err)
    assert sorted(losses_) == list(range(1, MORE + 1))
    assert "q20?" not in {r["prompt"] for r in rows}  # (unseen, and of the length most rows have)
    assert main(["generate", "q20?", "--model", str(work / "sft"), "--gen-length", "8", "--block-length", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "yes\n"
