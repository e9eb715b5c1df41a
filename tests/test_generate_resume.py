"""A resumed `clover generate --input ... --output OUT` job: OUT.settings.json records the model and every setting
that changes the tokens; the same settings resume (finished rows are not redone), other ones (a sampler flag, another
--model, a changed generation_config.json) are refused with one line before the model loads, and --force starts the
output over."""

import json

import jax
import pytest

from clover_jax import checkpoint, cli, loading
from clover_jax.commands import jobs
from clover_jax.config import get_config
from clover_jax.model import params

FLAGS = ["--gen-length", "16", "--block-length", "8", "--batch-size", "2"]
BYTES = get_config("test-clover").replace(name="test-clover-bytes", vocab_size=260, pad_token_id=0, eos_token_id=2,
                                          mask_token_id=3)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _prompts(path, n):
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"ask {i}"}) + "\n" for i in range(n)))
    return path


def _one_line_error(capsys, *parts):
    lines = capsys.readouterr().err.splitlines()  # (a line on settings from generation_config.json may come first)
    errors = [ln for ln in lines if ln.startswith("clover generate: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    err = errors[0]
    for part in parts:
        assert part in err, err
    return err


@pytest.fixture
def job(tmp_path):
    """(argv of a job over 4 prompts into out.jsonl on test-clover, the output path, the settings record path)."""
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(_prompts(tmp_path / "in.jsonl", 4)), "--output", str(out), "--model",
            "test-clover", *FLAGS]
    return argv, out, tmp_path / "out.jsonl.settings.json"


def test_the_same_settings_resume_without_redoing_rows(job, tmp_path, capsys):
    argv, out, record = job
    half = _prompts(tmp_path / "half.jsonl", 2)
    assert cli.main([*argv[:2], str(half), *argv[3:]]) == 0  # the first two prompts, then the whole file
    first = out.read_text()
    assert jobs.settings_path(str(out)) == str(record)
    settings = json.loads(record.read_text())
    assert settings["model"] == "test-clover" and settings["temperature"] == 0.0 and settings["gen_length"] == 16
    assert settings["chat_template"] is True and settings["bd_gdn"] is None and settings["seed"] == 0
    capsys.readouterr()
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "2 rows already in" in err and "2 to go" in err and "other settings" not in err
    done = [ln.split(" prompts done")[0] for ln in err.splitlines() if "prompts done" in ln]
    assert done == ["clover generate: 2/2"]  # one batch of the two new prompts: the first two were not redone
    assert out.read_text().startswith(first)  # the first rows, byte for byte
    assert [r["id"] for r in _rows(out)] == ["p0", "p1", "p2", "p3"]
    assert json.loads(record.read_text()) == settings
    # the same flags spelt otherwise (the default temperature given) are the same settings
    assert cli.main([*argv, "--temperature", "0", "--seed", "0"]) == 0
    assert "4 rows already in" in capsys.readouterr().err


def test_other_settings_are_refused_before_the_model_loads(job, tmp_path, capsys, monkeypatch):
    argv, out, record = job
    assert cli.main([*argv[:2], str(_prompts(tmp_path / "half.jsonl", 2)), *argv[3:]]) == 0
    before, recorded = out.read_bytes(), record.read_bytes()
    capsys.readouterr()

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "open_model", no_loading)
    for extra, said in ((["--temperature", "0.7"], "--temperature 0.0 -> 0.7"),
                        (["--seed", "3", "--top-k", "5"], "--top-k 0 -> 5; --seed 0 -> 3"),
                        (["--no-chat-template"], "the chat template (--no-chat-template) true -> false"),
                        (["--no-eos-stop"], "EOS stop (--no-eos-stop) true -> false")):
        assert cli.main([*argv, *extra]) == 2
        _one_line_error(capsys, f"--output {str(out)!r} holds rows made with other settings ({said}; recorded in "
                        f"{record})", "pass --force to start over", "use another --output")
    other = checkpoint.save_model(str(tmp_path / "ckpt"), BYTES, params.init(BYTES, jax.random.key(0)))
    assert cli.main([*argv, "--model", other]) == 2
    _one_line_error(capsys, f'--model "test-clover" -> "{other}"', "--force")
    assert out.read_bytes() == before and record.read_bytes() == recorded  # nothing written, nothing redone
    # not what makes the tokens: how they are computed (mesh, dispatch, batch size) is not part of the record
    with pytest.raises(AssertionError, match="the model was loaded"):  # past the check, on to loading the model
        cli.main([*argv, "--batch-size", "4", "--dispatch", "dense", "--mesh", "cpu-1"])


def test_a_checkpoints_generation_config_is_part_of_the_settings(tmp_path, capsys):
    """A checkpoint directory is recorded by its real path; a sampler default its generation_config.json changes
    between runs is a change of settings, named by its flag."""
    cfg = BYTES  # a checkpoint without a tokenizer runs on the byte tokenizer's 260 ids
    ckpt = tmp_path / "ckpt"
    checkpoint.save_model(str(ckpt), cfg, params.init(cfg, jax.random.key(0)))
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "seed": 1}))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(_prompts(tmp_path / "in.jsonl", 2)), "--output", str(out), *FLAGS]
    assert cli.main([*argv, "--model", str(ckpt)]) == 0
    record = json.loads((tmp_path / "out.jsonl.settings.json").read_text())
    assert record["model"] == str(ckpt.resolve()) and record["temperature"] == 0.5 and record["seed"] == 1
    capsys.readouterr()
    (tmp_path / "link").symlink_to(ckpt)  # the same directory by another name resumes
    assert cli.main([*argv, "--model", str(tmp_path / "link")]) == 0
    assert "2 rows already in" in capsys.readouterr().err
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "seed": 1}))
    assert cli.main([*argv, "--model", str(ckpt)]) == 2
    _one_line_error(capsys, "--temperature 0.5 -> 0.9")
    assert cli.main([*argv, "--model", str(ckpt), "--temperature", "0.5"]) == 0  # a flag puts it back


def test_force_starts_the_output_over(job, tmp_path, capsys):
    argv, out, record = job
    assert cli.main(argv) == 0
    greedy = {r["id"]: r["text"] for r in _rows(out)}
    new = ["--temperature", "1.0", "--seed", "7", "--remasking", "random"]
    assert cli.main([*argv, *new]) == 2
    capsys.readouterr()
    assert cli.main([*argv, *new, "--force"]) == 0
    err = capsys.readouterr().err
    assert "--force: starting" in err and "rows already" not in err
    done = [ln.split(" prompts done")[0] for ln in err.splitlines() if "prompts done" in ln]
    assert done == ["clover generate: 2/4", "clover generate: 4/4"]  # every row made again
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["p0", "p1", "p2", "p3"]  # once each: the old rows are gone
    settings = json.loads(record.read_text())
    assert (settings["temperature"], settings["seed"], settings["remasking"]) == (1.0, 7, "random")
    # the rows are those of the new settings: the same as a fresh output gives
    fresh = tmp_path / "fresh.jsonl"
    assert cli.main([*argv[:4], str(fresh), *argv[5:], *new]) == 0
    assert [r["text"] for r in rows] == [r["text"] for r in _rows(fresh)]
    assert [r["text"] for r in rows] != [greedy[r["id"]] for r in rows]
    # and the new settings now resume; the old ones are refused
    capsys.readouterr()
    assert cli.main([*argv, *new]) == 0 and "4 rows already in" in capsys.readouterr().err
    assert cli.main(argv) == 2
    _one_line_error(capsys, "--temperature 1.0 -> 0.0")


def test_an_output_without_a_record_resumes_and_gets_one(job, capsys):
    """An output written before records were kept: resumed as before (with a note), and recorded from then on."""
    argv, out, record = job
    assert cli.main(argv) == 0
    record.unlink()
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]))
    capsys.readouterr()
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "has no record of the settings" in err and "3 rows already in" in err
    assert record.is_file() and len(_rows(out)) == 4
    assert cli.main([*argv, "--temperature", "0.5"]) == 2
    _one_line_error(capsys, "--temperature 0.0 -> 0.5")
    record.write_text("{not json")  # a damaged record: refused, naming it
    assert cli.main(argv) == 2
    _one_line_error(capsys, "out.jsonl.settings.json: not valid JSON", "pass --force")
    assert cli.main([*argv, "--force"]) == 0
    assert len(_rows(out)) == 4 and json.loads(record.read_text())["temperature"] == 0.0
