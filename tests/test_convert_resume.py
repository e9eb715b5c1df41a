"""A killed `clover convert` (HF -> native) resumes where it stopped: kill -9 mid-run, rerun, and only the chunks
the journal does not list are written; the result is bit for bit an uninterrupted conversion's. Other options (another
fingerprint) do not resume from it; --restart starts over."""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clover_jax.checkpoint import WeightReader, streaming
from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.convert import FAMILIES, convert
from tests.test_convert import synthetic_tensors, write_hf

CFG = get_config("test-qwen3-moe", dtype="float32", n_layers=40, n_experts=32, expert_mlp_dim=128)  # ~120 MB


@pytest.fixture
def src(tmp_path) -> str:
    write_hf(tmp_path / "src", synthetic_tensors(CFG, "qwen3_moe", small_dtype=np.float32),
             FAMILIES["qwen3_moe"].config_to_hf(CFG), n_files=3)
    return str(tmp_path / "src")


def chunks(entries: list) -> set:
    """The (weight, chunk start) of the chunk lines among journal entries."""
    return {(e[0], tuple(e[1])) for e in entries if isinstance(e, list)}


def kill_midway(src: str, dst: str, min_chunks: int = 30) -> set:
    """Run `python -m clover_jax convert SRC DST`, SIGKILL it once its journal lists `min_chunks` chunks; check
    that only its temp dir is left, journal and all; returns the chunks the journal lists."""
    proc = subprocess.Popen([sys.executable, "-m", "clover_jax", "convert", src, dst, "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            paths = glob.glob(f"{dst}.tmp-*/{streaming.JOURNAL_FILE}")
            if paths and Path(paths[0]).read_text().count("\n[") >= min_chunks:
                break
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not os.path.exists(dst)
    (tmp,) = glob.glob(f"{dst}.tmp-*")
    header, entries = streaming._Journal.read(tmp)
    assert header is not None and len(chunks(entries)) >= min_chunks
    assert not any(isinstance(e, dict) and "weights" in e for e in entries), "killed too late: all weights written"
    return chunks(entries)


def assert_same_checkpoint(a: str, b: str) -> None:
    """Every weight bit for bit, and the files next to config.json byte for byte."""
    ra, rb = WeightReader(a), WeightReader(b)
    assert ra.leaves == rb.leaves
    for name in ra.leaves:
        x, y = ra.read(name), rb.read(name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=name)
    for f in ("config.json", "hf_source.json", "tokenizer_config.json"):
        assert (Path(a) / f).read_bytes() == (Path(b) / f).read_bytes(), f


def test_killed_conversion_resumes_and_writes_only_the_rest(tmp_path, src, monkeypatch, capsys):
    written = []  # what the in-process runs journal
    add = streaming._Journal.add
    monkeypatch.setattr(streaming._Journal, "add", lambda self, e: (written.append(e), add(self, e))[1])
    ref = convert(src, str(tmp_path / "ref"), progress=False)
    every = chunks(written)
    dst = str(tmp_path / "dst")
    first = kill_midway(src, dst)
    assert first < every

    written.clear()
    capsys.readouterr()
    assert main(["convert", src, dst, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"clover convert: resuming {dst} from an interrupted run: {len(first)} of {len(every)} chunks (" in err
    lines = err.splitlines()  # that line, then the closing line saying how to run the result
    assert len(lines) == 2 and lines[1].startswith("clover convert: it carries"), err
    again = chunks(written)
    assert not again & first and again | first == every  # the rest, each once
    assert written[-2:] == [{"weights": "finalizing"}, {"weights": "done"}]
    assert_same_checkpoint(dst, ref)
    assert not glob.glob(f"{dst}.tmp-*") and not os.path.exists(os.path.join(dst, streaming.JOURNAL_FILE))


def test_other_options_do_not_resume_and_restart_starts_over(tmp_path, src, capsys):
    dst = str(tmp_path / "dst")
    kill_midway(src, dst)
    (stale,) = glob.glob(f"{dst}.tmp-*")
    capsys.readouterr()
    # Other options: another fingerprint. The interrupted run's temp dir is reported as today, and left alone.
    assert main(["convert", src, dst, "--no-progress", "--mask-token-id", "3"]) == 0
    err = capsys.readouterr().err
    assert "resuming" not in err and "warning: 1 unfinished dst.tmp-*" in err, err
    assert glob.glob(f"{dst}.tmp-*") == [stale]
    assert json.loads((Path(dst) / "config.json").read_text())["mask_token_id"] == 3
    # --restart: the matching temp dir is removed (one line says so) and the import starts over.
    assert main(["convert", src, dst, "--no-progress", "--force", "--restart"]) == 0
    err = capsys.readouterr().err
    assert "resuming" not in err and f"clover convert: starting {dst} over: removed the interrupted run's {stale}" \
        in err, err
    assert not glob.glob(f"{dst}.tmp-*")
    assert WeightReader(dst).config.mask_token_id == CFG.mask_token_id


def test_ctrl_c_keeps_the_temp_dir_and_a_kill_in_finalize_starts_over(tmp_path, monkeypatch, capsys):
    """In process, on a tiny model: KeyboardInterrupt in Orbax's finalize (the OCDBT merge) keeps the temp dir, and
    the rerun, which cannot trust a half-merged database, says so and starts over."""
    import orbax.checkpoint as ocp

    cfg = get_config("test-qwen3-moe", dtype="bfloat16")
    write_hf(tmp_path / "src", synthetic_tensors(cfg, "qwen3_moe"), FAMILIES["qwen3_moe"].config_to_hf(cfg))
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")

    def interrupted(self, directory):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ocp.PyTreeCheckpointHandler, "finalize", interrupted)
        with pytest.raises(KeyboardInterrupt):
            convert(src, dst, progress=False)
    (tmp,) = glob.glob(f"{dst}.tmp-*")
    assert streaming._Journal.read(tmp)[1][-1] == {"weights": "finalizing"}
    capsys.readouterr()
    convert(src, dst, progress=False)
    err = capsys.readouterr().err
    assert err == f"clover convert: the interrupted run of {dst} was killed while finalizing its weights (the OCDBT " \
        "merge); starting over\n", err
    assert not glob.glob(f"{dst}.tmp-*")
    convert(src, str(tmp_path / "ref"), progress=False)
    assert_same_checkpoint(dst, str(tmp_path / "ref"))
