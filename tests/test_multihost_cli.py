"""`clover generate --input` as a multi-host job from the command line: 2 processes x 4 CPU devices (gloo
collectives on loopback), the mesh's data axis spanning both, resuming an output that a one-process run began.
Exactly one process writes: every prompt's row appears once, the rows already there are kept byte for byte, the
settings record is untouched, and the texts are those of a one-process run."""

import json
import os
import sys

from clover_jax import cli
from tests.processes import Processes, free_port

FLAGS = ["--model", "test-clover", "--gen-length", "16", "--block-length", "8", "--batch-size", "2"]
TIMEOUT_S = 300


def _prompts(path, ids):
    path.write_text("".join(json.dumps({"id": i, "prompt": f"ask {i}"}) + "\n" for i in ids))
    return str(path)


def _process_env(i: int, port: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=4"]),
               CLOVER_DISTRIBUTED="1", CLOVER_COORDINATOR=f"127.0.0.1:{port}", CLOVER_NUM_PROCESSES="2",
               CLOVER_PROCESS_ID=str(i), CLOVER_DISTRIBUTED_TIMEOUT_S="120")
    return env


def test_a_two_process_job_writes_each_row_once(tmp_path):
    ids = ["a", "b", "c", "d", "e"]
    every, first = _prompts(tmp_path / "all.jsonl", ids), _prompts(tmp_path / "first.jsonl", ids[:1])
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert cli.main(["generate", "--input", every, "--output", str(ref), *FLAGS]) == 0
    assert cli.main(["generate", "--input", first, "--output", str(out), *FLAGS]) == 0  # a one-process start
    begun, record = out.read_text(), (tmp_path / "out.jsonl.settings.json").read_text()

    port = free_port()
    cmd = [sys.executable, "-m", "clover_jax.cli", "generate", "--input", every, "--output", str(out), *FLAGS,
           "--mesh", "cpu-8"]
    codes, tails = Processes([cmd, cmd], [_process_env(i, port) for i in range(2)], tmp_path, "process").wait(
        TIMEOUT_S, tail_lines=15)
    assert codes == [0, 0], tails

    text = out.read_text()
    assert text.startswith(begun)  # the one-process rows, byte for byte
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["id"] for r in rows] == ids  # each once: one writer
    want = {r["id"]: r["text"] for r in map(json.loads, ref.read_text().splitlines())}
    assert {r["id"]: r["text"] for r in rows} == want
    assert (tmp_path / "out.jsonl.settings.json").read_text() == record
    process0, process1 = tails.split("--- process 1 ---")
    assert "4/4 prompts done" in process0 and "prompts done" not in process1  # process 1 claims no rows
