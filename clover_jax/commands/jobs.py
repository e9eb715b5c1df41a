"""Resumable JSONL batch jobs: read prompts, skip the ids already written, append results durably.

Input: one JSON object per line, {"prompt": "...", "id": optional}. Output: one line per prompt,
appended, flushed and fsynced after every batch. A second run of the same job skips the ids already
in the output (a torn last line, from a kill mid-write, is cut off first), so no row is lost and none
is written twice.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from clover_jax.errors import UsageError
from clover_jax.jsonfile import read_lines


def read_jobs(path: str) -> list[tuple[Any, str]]:
    """(id, prompt) per non-empty line; a line without an id gets its index. UsageError naming the line."""
    jobs: list[tuple[Any, str]] = []
    seen: dict[Any, tuple[int, bool]] = {}  # id -> (line, explicit)
    for n, obj in read_lines(path, UsageError, "--input "):
        if not isinstance(obj.get("prompt"), str):
            raise UsageError(f"{path}:{n}: each line must be an object with a string \"prompt\"")
        explicit = "id" in obj
        rid = obj["id"] if explicit else len(jobs)
        if isinstance(rid, bool) or not isinstance(rid, int | str):
            raise UsageError(f"{path}:{n}: \"id\" must be a string or an integer, got {json.dumps(rid)}")
        if rid in seen:
            line0, explicit0 = seen[rid]
            why = ("" if explicit and explicit0 else
                   " (a line without an id gets its 0-based position among the prompts: give every line an id, "
                   "or none)")
            raise UsageError(f"{path}:{n}: id {rid!r} is also the id of line {line0}{why}")
        seen[rid] = (n, explicit)
        jobs.append((rid, obj["prompt"]))
    return jobs


def finished_ids(path: str) -> set:
    """Ids already in the output. A torn last line (a kill mid-write) is cut off the file first."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    done = set()
    for n, line in enumerate(keep.splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"{path}:{n}: existing output line is not a result row; refusing to append") from e
    if len(keep) != len(data):
        print(f"clover generate: dropping a torn last line from {path}", file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(len(keep))
            f.flush()
            os.fsync(f.fileno())
    return done


def append_rows(path: str, rows: list[dict]) -> None:
    """Append result rows as JSON lines, flushed and fsynced before returning."""
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_batches(jobs: Sequence[Any], batch_size: int, output: str,
                run_batch: Callable[[Sequence[Any]], list[dict]]) -> None:
    """Run `jobs` `batch_size` at a time through `run_batch` (jobs -> result rows), appending each
    batch's rows to `output` before the next starts. Progress on stderr: one bar on a terminal (other lines go
    above it through `tqdm.write`), else one line per batch; nothing when there is nothing to do."""
    if not jobs:
        return
    tty = sys.stderr.isatty()
    with tqdm(total=len(jobs), desc="generate", unit="prompt", file=sys.stderr, disable=not tty) as bar:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start:start + batch_size]
            append_rows(output, run_batch(chunk))
            bar.update(len(chunk))
            if not tty:
                done = min(start + batch_size, len(jobs))
                print(f"clover generate: {done}/{len(jobs)} prompts done, written to {output}", file=sys.stderr,
                      flush=True)
