"""`clover generate --input` as a multi-host job from the command line: 2 processes x 4 CPU devices (gloo
collectives on loopback), the mesh's data axis spanning both, resuming an output that a one-process run began.
Exactly one process writes: every prompt's row appears once, the rows already there are kept byte for byte, the
settings record is untouched, and the texts are those of a one-process run."""

import json
import os
import socket
import subprocess
import sys

from clover_jax import cli

FLAGS = ["--model", "test-clover", "--gen-length", "16", "--block-length", "8", "--batch-size", "2"]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    port = _free_port()
    cmd = [sys.executable, "-m", "clover_jax.cli", "generate", "--input", every, "--output", str(out), *FLAGS,
           "--mesh", "cpu-8"]
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    procs = [subprocess.Popen(cmd, env=_process_env(i, port), stdout=logs[i], stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = []
    for i, f in enumerate(logs):
        f.seek(0)
        tails.append(f"--- process {i} ---\n" + "".join(f.readlines()[-15:]))
        f.close()
    assert codes == [0, 0], "\n".join(tails)

    text = out.read_text()
    assert text.startswith(begun)  # the one-process rows, byte for byte
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["id"] for r in rows] == ids  # each once: one writer
    want = {r["id"]: r["text"] for r in map(json.loads, ref.read_text().splitlines())}
    assert {r["id"]: r["text"] for r in rows} == want
    assert (tmp_path / "out.jsonl.settings.json").read_text() == record
    assert "4/4 prompts done" in tails[0] and "prompts done" not in tails[1]  # process 1 claims no rows
