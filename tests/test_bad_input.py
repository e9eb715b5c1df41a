"""What a user can get wrong, through the CLI: each case exits non-zero with one line that names the
problem, and leaves every file on disk as it was. Plus the warnings, the on-disk compile cache and the
exit status of `clover plan`."""

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from clover_jax import checkpoint
from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.model import params

CFG = get_config("test-clover")


def tree_digest(root) -> dict[str, str]:
    """Every file under `root` with a digest of its bytes: what 'untouched' means."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    path = tmp_path_factory.mktemp("native") / "m"
    checkpoint.save_model(str(path), CFG, params.init(CFG, jax.random.key(0)),
                          extra_files={"MODEL_CARD.md": "# a model card\n"})
    return path


def one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err), err
    line = err[-1]
    assert line.startswith("clover ") and ": error: " in line and needle in line, err
    return line


# ---- nothing a user owns is destroyed -------------------------------------------------------------------


def test_convert_never_writes_onto_or_into_its_source(native, tmp_path, capsys):
    before = tree_digest(native)
    assert main(["convert", str(native), str(native), "--force", "--no-progress"]) == 2
    one_line_error(capsys, "is the source")
    assert main(["convert", str(native), str(native / "sub"), "--no-progress"]) == 2
    one_line_error(capsys, "lies inside the source")
    assert main(["convert", str(native), str(native.parent), "--force", "--no-progress"]) == 2
    one_line_error(capsys, "holds the source")
    assert tree_digest(native) == before


def test_convert_force_replaces_atomically_and_reports_stale_temporaries(native, tmp_path, capsys):
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep me")
    assert main(["convert", str(native), str(dst), "--no-progress"]) == 2
    one_line_error(capsys, "already exists (pass --force")
    assert (dst / "mine.txt").read_text() == "keep me"
    stale = tmp_path / "hf.tmp-deadbeef"  # what a killed conversion leaves
    stale.mkdir()
    (stale / "junk").write_bytes(b"x" * 100)
    out = tmp_path / "other"
    assert main(["convert", str(native), str(tmp_path / "hf2"), "--no-progress"]) == 0  # unrelated: silent
    assert "unfinished" not in capsys.readouterr().err
    os.rename(stale, tmp_path / "other.tmp-deadbeef")
    assert main(["convert", str(native), str(out), "--no-progress"]) == 0
    assert "unfinished other.tmp-* left by an earlier killed run" in capsys.readouterr().err
    assert (tmp_path / "other.tmp-deadbeef").exists()  # reported, not touched without --force
    assert main(["convert", str(native), str(out), "--force", "--no-progress"]) == 0
    assert "removed 1 unfinished" in capsys.readouterr().err
    assert not (tmp_path / "other.tmp-deadbeef").exists() and (out / "config.json").is_file()


def test_train_export_and_tokenizer_output_need_force(native, tmp_path, capsys):
    before = tree_digest(native)
    data = tmp_path / "d.txt"
    data.write_text("to be or not to be " * 400)
    assert main(["train", "--config", "test-clover", "--data", str(data), "--out", str(tmp_path / "run"),
                 "--steps", "1", "--export", str(native), "--no-progress"]) == 2
    one_line_error(capsys, "--export")
    assert not (tmp_path / "run").exists()  # refused before training started
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.model").write_bytes(b"my tokenizer")
    assert main(["tokenizer", "train", "--input", str(data), "--vocab-size", "300", "--output", str(tok)]) == 2
    one_line_error(capsys, "tokenizer.model already exists (pass --force")
    assert (tok / "tokenizer.model").read_bytes() == b"my tokenizer"
    assert tree_digest(native) == before


def test_bad_numbers_for_training_are_refused(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("to be or not to be " * 400)
    for flag, value, msg in (("--lr", "-1", "lr must be a positive number"),
                             ("--weight-decay", "-0.1", "weight_decay must be >= 0")):
        assert main(["train", "--config", "test-clover", "--data", str(data), "--out", str(tmp_path / "run"),
                     flag, value, "--no-progress"]) == 2
        one_line_error(capsys, msg)
    assert not (tmp_path / "run").exists()


# ---- one line, naming the problem ---------------------------------------------------------------------


@pytest.mark.parametrize(("content", "msg"), [
    (b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n', ":2: not UTF-8 text (byte 0xff)"),
    (b'{"prompt": "a", "id": [1, 2]}\n', ':1: "id" must be a string or an integer, got [1, 2]'),
    (b'{"prompt": "a"}\n\n{"prompt": \n', ":3: not valid JSON (Expecting value)"),
    (b'["a"]\n', ":1: each line must be a JSON object, got list"),
    (b'{"text": "a"}\n', ':1: each line must be an object with a string "prompt"'),
    (b'{"prompt": "a", "id": 1}\n{"prompt": "b"}\n', ":2: id 1 is also the id of line 1 (a line without an id"),
])
def test_bad_jsonl_input(tmp_path, capsys, content, msg):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--model",
                 "test-clover"]) == 2
    one_line_error(capsys, msg)
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_outputs_are_refused_before_any_work(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    (tmp_path / "adir").mkdir()
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "adir"), "--model", "test-clover"]) == 2
    one_line_error(capsys, "is a directory")
    assert main(["generate", "--input", str(src), "--output", str(src), "--model", "test-clover"]) == 2
    one_line_error(capsys, "is the --input file")
    try:  # /sys refuses new files even to root (access() would say yes): a read-only place to write to
        with open("/sys/clover-probe", "w"):
            pass
        os.remove("/sys/clover-probe")
    except OSError:
        assert main(["generate", "--input", str(src), "--output", "/sys/out.jsonl", "--model", "test-clover"]) == 2
        one_line_error(capsys, "cannot write into /sys")
        assert main(["convert", str(tmp_path), "/sys/converted", "--no-progress"]) == 2
        one_line_error(capsys, "cannot write into /sys")
    assert src.read_text() == '{"prompt": "a"}\n'


def test_non_utf8_training_text(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_bytes(b"fine text " * 300 + b"\xc3\x28")
    assert main(["train", "--config", "clover-tiny", "--data", str(data), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 2  # clover-tiny: a vocabulary the byte tokenizer fits
    one_line_error(capsys, "not UTF-8 text (byte 0xc3 at offset 3000)")
    assert main(["tokenizer", "train", "--input", str(data), "--vocab-size", "300", "--output",
                 str(tmp_path / "tok")]) == 2
    one_line_error(capsys, "not UTF-8 text (byte 0xc3")


def test_bad_generation_config_and_corrupt_tokenizer(native, tmp_path, capsys):
    model = tmp_path / "m"
    checkpoint.save_model(str(model), CFG, params.init(CFG, jax.random.key(0)))
    (model / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    assert main(["generate", "x", "--model", str(model)]) == 2
    one_line_error(capsys, "generation_config.json: temperature must be a number, got \"hot\"")
    (model / "generation_config.json").unlink()
    (model / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    assert main(["generate", "x", "--model", str(model)]) == 2
    one_line_error(capsys, "tokenizer.model: not a SentencePiece model")


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["--debug", "generate", "x", "--model", "test-clover", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("clover generate: error: --steps must be")


# ---- warnings where the result would surprise ---------------------------------------------------------


def test_warnings_no_tokenizer_steps_and_stored_settings(native, tmp_path, capsys):
    model = tmp_path / "m"
    checkpoint.save_model(str(model), CFG, params.init(CFG, jax.random.key(0)))
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_k": 0}))
    assert main(["generate", "x", "--model", str(model), "--gen-length", "32", "--block-length", "16",
                 "--steps", "33"]) == 0
    err = capsys.readouterr().err
    assert "has no tokenizer (tokenizer.json or tokenizer.model): using the byte tokenizer" in err
    assert "--steps 33 over 2 blocks of 16 runs at most 32 steps" in err
    assert "generation_config.json: temperature=0.5 (flags override them)" in err  # top_k is the default: unsaid
    assert "compiling the sampler for" in err


def test_nan_weights_are_reported_on_import(tmp_path, capsys):
    from clover_jax.convert import FAMILIES
    from tests.test_convert import synthetic_tensors, write_hf  # the same synthetic HF checkpoints

    cfg = get_config("test-qwen3-moe", dtype="float32")
    tensors = synthetic_tensors(cfg, "qwen3_moe")
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key] = tensors[key].copy()
    tensors[key][0, :3] = np.nan
    write_hf(tmp_path / "hf", tensors, FAMILIES["qwen3_moe"].config_to_hf(cfg))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "n"), "--no-progress"]) == 0
    assert "warning: 3 NaN/Inf values in 1 weights (moe_layers.attn.q: 3)" in capsys.readouterr().err


# ---- plan's exit status --------------------------------------------------------------------------------


def test_plan_exit_status_says_whether_it_fits(capsys):
    assert main(["plan", "--config", "clover-35b-a3b", "--mesh", "gpu-1xh200", "--dtype", "float32"]) == 3
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", "--config", "clover-tiny", "--mesh", "gpu-1xh200"]) == 0
    assert "FITS" in capsys.readouterr().out


# ---- the on-disk compile cache -------------------------------------------------------------------------


def test_second_process_loads_the_compiled_sampler_from_the_cache(tmp_path):
    env = {**os.environ, "CLOVER_COMPILE_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "clover_jax.cli", "generate", "ROMEO:", "--gen-length", "32", "--block-length", "16"]
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:]
    assert "(from the compile cache)" not in runs[0].stderr
    assert "(from the compile cache)" in runs[1].stderr, runs[1].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout  # the same tokens
    assert os.listdir(tmp_path / "cache" / "programs") and os.listdir(tmp_path / "cache" / "xla")
    off = subprocess.run([*cmd[:3], "--compile-cache", "off", *cmd[3:]], env=env, capture_output=True, text=True,
                         timeout=600)
    assert off.returncode == 0 and "(from the compile cache)" not in off.stderr and off.stdout == runs[0].stdout


def test_invalid_config_json_for_info(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{bad")
    assert main(["info", "--config", str(tmp_path)]) == 2
    one_line_error(capsys, "config.json: not valid JSON (Expecting property name")


def test_malicious_pickle_is_refused_by_name(tmp_path, capsys):
    pytest.importorskip("torch")
    import pickle

    from clover_jax.convert import FAMILIES

    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(FAMILIES["qwen3_moe"].config_to_hf(get_config("test-qwen3-moe"))))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Evil()}))
    assert main(["convert", str(src), str(tmp_path / "n"), "--allow-pickle", "--no-progress"]) == 2
    one_line_error(capsys, "pytorch_model.bin: refused by torch.load(weights_only=True)")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "n").exists()
