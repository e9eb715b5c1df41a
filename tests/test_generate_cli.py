"""`clover generate` end to end on a tiny preset: one prompt, a jsonl batch job, resuming after a kill."""

import json
import os
import subprocess
import sys
import time

import pytest

from clover_jax import cli, loading
from clover_jax.commands import generate as gen_cmd
from clover_jax.commands import jobs
from clover_jax.config import get_config
from clover_jax.errors import UsageError
from clover_jax.sampler import settings as sampler_settings
from clover_jax.tokenizer import ByteTokenizer

FLAGS = ["--model", "test-clover", "--gen-length", "16", "--block-length", "8"]


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_one_prompt_with_show(capsys):
    assert cli.main(["generate", "Hi there", *FLAGS, "--steps", "4", "--show", "--no-eos-stop"]) == 0
    out, err = capsys.readouterr()
    assert "RANDOM weights" in err
    frames = [ln for ln in err.splitlines() if ln.startswith("[block ")]
    assert len(frames) == 4 and gen_cmd.PLACEHOLDER in frames[0]  # 4 steps, masks shown while filling
    # the default cache for a block-causal model is the exact prefix cache: 4 steps + the prompt prefill
    assert "5 forward passes, 3.20 tokens/pass" in err and "tokens/s" in err and "compile" in err
    assert out.endswith("\n")


class _Terminal:
    """A stream that says it is a terminal and keeps what is written to it."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_show_redraws_in_place_on_a_terminal(monkeypatch):
    """On a terminal each frame goes back up over the previous one (as many rows as it took, wrapped lines counted)
    and erases only from there down: the screen is never cleared, so the command line above stays."""
    monkeypatch.setattr(gen_cmd.shutil, "get_terminal_size", lambda: os.terminal_size((20, 24)))
    cfg = get_config("test-clover")
    tok, term = ByteTokenizer(), _Terminal()
    show = gen_cmd.make_show(tok, cfg, "Hi: ", term)
    canvas = [[cfg.mask_token_id] * 8]
    show(canvas, 0, 1)
    show([tok.encode("a" * 30)], 0, 2)  # "Hi: " + 30 characters: two rows of 20
    show([tok.encode("b")], 1, 3)
    assert not any("\x1b[2J" in w or "\x1b[H" in w for w in term.writes)  # no clear screen, no cursor home
    assert term.writes[0].startswith("\x1b[J[block 0, pass 1]\n")  # the first frame: nothing to go back over
    assert term.writes[1].startswith("\x1b[2F\x1b[J[block 0, pass 2]\n")  # over the 2 rows of the first frame
    assert term.writes[2].startswith("\x1b[3F\x1b[J[block 1, pass 3]\n")  # the second took 1 + 2 rows


def test_a_run_says_nothing_but_its_own_lines():
    """Without JAX_PLATFORMS (as a user runs it, libtpu installed by the `tpu` extra, no TPU chip here) a run writes
    only its own lines: no runtime start-up warnings; --verbose adds the backend line."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    run = subprocess.run([sys.executable, "-m", "clover_jax", "--verbose", "--compile-cache", "off", "generate", "x",
                          *FLAGS, "--steps", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[0].startswith("clover generate: backend ")
    stats = [ln for ln in lines if "forward passes" in ln]
    assert len(stats) == 1 and all(ln.startswith("clover generate: ") for ln in lines if ln not in stats), lines


def test_python_dash_m_runs_the_clover_command():
    from clover_jax.version import __version__

    run = subprocess.run([sys.executable, "-m", "clover_jax", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and __version__ in run.stdout + run.stderr, run


def test_bad_input_is_one_line_before_loading(capsys, tmp_path):
    assert cli.main(["generate", "x", *FLAGS, "--gen-length", "12"]) == 2
    assert "--gen-length (12) must be a multiple of --block-length (8)" in capsys.readouterr().err  # flags named
    assert cli.main(["generate", "x", *FLAGS, "--threshold", "2"]) == 2
    assert "--threshold must be a number in (0, 1] (or 0 = off), got 2.0" in capsys.readouterr().err
    assert cli.main(["generate", "x", *FLAGS, "--remasking", "best"]) == 2
    assert "--remasking must be one of low_confidence, random, margin, entropy" in capsys.readouterr().err
    assert cli.main(["generate", "x", *FLAGS, "--steps-per-block", "9"]) == 2
    assert "--steps-per-block must be an integer in [1, 8], got 9" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--model", "no-such-model"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    assert cli.main(["generate", "--input", str(bad), "--output", str(tmp_path / "o.jsonl"), *FLAGS]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_batch_job_resumes_after_a_kill(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"ask {i}"}) + "\n" for i in range(5)))
    args = ["generate", "--input", str(prompts), *FLAGS, "--batch-size", "2"]
    whole = tmp_path / "whole.jsonl"
    assert cli.main([*args, "--output", str(whole)]) == 0
    ref = {r["id"]: r for r in _rows(whole)}
    assert sorted(ref) == [f"p{i}" for i in range(5)]
    assert all(r["prompt"] == f"ask {r['id'][1:]}" and {"text", "stats"} <= set(r) for r in ref.values())

    # Kill the second batch halfway through writing its lines: a torn line is left on disk.
    real_append = jobs.append_rows
    calls = []

    def dying_append(path, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            with open(path, "a") as f:
                f.write(json.dumps(rows[0])[:10])
            raise KeyboardInterrupt
        real_append(path, rows)

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(jobs, "append_rows", dying_append)
    assert cli.main([*args, "--output", str(out)]) == 130
    assert not out.read_text().endswith("\n")
    monkeypatch.setattr(jobs, "append_rows", real_append)
    capsys.readouterr()
    assert cli.main([*args, "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "torn last line" in err and "2 rows already" in err
    # off a terminal: one progress line per batch (no bar drawn twice), counted over what this run does
    assert [ln.split(" prompts done")[0] for ln in err.splitlines() if "prompts done" in ln] == \
        ["clover generate: 2/3", "clover generate: 3/3"]
    assert "prompt/s" not in err and "it/s" not in err
    rows = _rows(out)
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(5)]  # nothing lost, nothing twice
    assert all(r["text"] == ref[r["id"]]["text"] for r in rows)
    # again, with nothing left to do: no progress at all
    assert cli.main([*args, "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "5 rows already" in err and "0 to go" in err and "prompts done" not in err and "generate:   0%" not in err
    # a finished job run again does nothing
    assert cli.main([*args, "--output", str(out)]) == 0
    assert len(_rows(out)) == 5


def test_batch_job_resumes_after_sigkill(tmp_path, capsys):
    """A real kill: SIGKILL the job process once it has written its first row, then run it again."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(12)))
    out = tmp_path / "out.jsonl"
    args = ["generate", "--input", str(prompts), "--output", str(out), "--model", "test-clover",
            "--gen-length", "64", "--block-length", "8", "--batch-size", "1", "--cache", "none"]
    proc = subprocess.Popen([sys.executable, "-m", "clover_jax.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if out.exists() and out.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    written = out.read_bytes().count(b"\n")
    assert written >= 1
    assert cli.main(args) == 0
    assert [r["id"] for r in _rows(out)] == list(range(12))  # nothing lost, nothing twice
    if written < 12:
        assert f"{written} rows already" in capsys.readouterr().err


def test_checkpoint_directory_model(tmp_path, capsys):
    """--model DIR loads config + weights with checkpoint.load_model (same weights as the preset run)."""
    import jax

    from clover_jax import checkpoint
    from clover_jax.config import get_config
    from clover_jax.model import params

    cfg = get_config("test-clover")
    ckpt = checkpoint.save_model(str(tmp_path / "ckpt"), cfg, params.init(cfg, jax.random.key(0)))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ask 1"}\n{"prompt": "ask 22"}\n')
    runs = []
    for model in (ckpt, "test-clover"):
        out = tmp_path / f"{len(runs)}.jsonl"
        args = ["generate", "--input", str(prompts), "--output", str(out), *FLAGS, "--batch-size", "2"]
        assert cli.main([*args, "--model", model]) == 0
        runs.append([r["text"] for r in _rows(out)])
        assert ("RANDOM weights" in capsys.readouterr().err) == (model == "test-clover")
    assert runs[0] == runs[1] and [r["id"] for r in _rows(tmp_path / "0.jsonl")] == [0, 1]


def test_refuses_to_append_to_a_file_that_is_not_its_output(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(UsageError, match=r"o\.jsonl:2"):
        jobs.finished_ids(str(out))
    out.write_text('{"id": 1}\n{"id": 2}\n{"id": 3, "te')
    assert jobs.finished_ids(str(out)) == {1, 2}
    assert out.read_text() == '{"id": 1}\n{"id": 2}\n'


def test_chat_template_is_applied_unless_disabled():
    class Tok:
        def apply_chat_template(self, prompt):
            return f"<user>{prompt}</user><assistant>"

        def encode(self, text):
            return [ord(c) for c in text]

    assert gen_cmd.encode(Tok(), "hi", chat=True) == [ord(c) for c in "<user>hi</user><assistant>"]
    assert gen_cmd.encode(Tok(), "hi", chat=False) == [ord("h"), ord("i")]


def test_generation_config_sets_defaults_and_flags_win(tmp_path):
    """A checkpoint's generation_config.json changes the sampler defaults; an explicit flag beats it."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "remasking": "margin", "max_new_tokens": 64, "top_k": 40, "unrelated": 1}))
    defaults = loading.sampler_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.7, "remasking": "margin", "gen_length": 64, "top_k": 40}
    parser = cli.build_parser()
    sc = sampler_settings.from_flags(parser.parse_args(["generate", "x"]), defaults)
    assert (sc.temperature, sc.remasking, sc.gen_length, sc.top_k, sc.block_length) == (0.7, "margin", 64, 40, 32)
    flags = parser.parse_args(["generate", "x", "--temperature", "0", "--top-k", "0"])
    sc = sampler_settings.from_flags(flags, defaults)
    assert (sc.temperature, sc.top_k, sc.remasking) == (0.0, 0, "margin")
    assert sampler_settings.from_flags(parser.parse_args(["generate", "x"]), {}).temperature == 0.0
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(UsageError, match=r"generation_config\.json"):
        loading.sampler_defaults(str(tmp_path))
