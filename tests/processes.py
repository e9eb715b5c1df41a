"""Several processes of one multi-host test, started together and collected with their logs' tails."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port free on loopback now (for the jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """`commands[i]` started with `envs[i]`, stdout and stderr to `log_dir/NAME{i}.log`."""

    def __init__(self, commands: list[list[str]], envs: list[dict], log_dir: Path, name: str) -> None:
        self.name = name
        self.logs = [open(log_dir / f"{name}{i}.log", "w+") for i in range(len(commands))]  # noqa: SIM115
        self.procs = [subprocess.Popen(c, env=e, stdout=f, stderr=subprocess.STDOUT)
                      for c, e, f in zip(commands, envs, self.logs, strict=True)]

    def wait(self, timeout_s: float, tail_lines: int = 25) -> tuple[list[int] | None, str]:
        """(exit codes, or None when one ran past `timeout_s` (all are killed then), the logs' last lines)."""
        try:
            codes = [p.wait(timeout=timeout_s) for p in self.procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tails = []
        for i, f in enumerate(self.logs):
            f.seek(0)
            tails.append(f"--- {self.name} {i} ---\n" + "".join(f.readlines()[-tail_lines:]))
            f.close()
        return codes, "\n".join(tails)
