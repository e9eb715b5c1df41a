"""Resumable JSONL batch jobs: read prompts, skip the ids already written, append results durably.

Input: one JSON object per line, {"prompt": "...", "id": optional}. Output: one line per prompt,
appended, flushed and fsynced after every batch. A second run of the same job skips the ids already
in the output (a torn last line, from a kill mid-write, is cut off first), so no row is lost and none
is written twice.

Settings: next to the output, OUTPUT.settings.json records what the rows were made with (the model and every
setting that changes the tokens, `fingerprint` in clover_jax/commands/generate.py). A run that would append to rows
made under another record is refused, naming what differs; `--force` starts the output over.

Multi-host: every process runs the same job (same input, same batches: the sampler's collectives span them all),
but only process 0 writes: the rows, the settings record, the cut of a torn line. Which ids are done is process 0's
reading of the output, broadcast to the others (`shared_finished_ids`), so the processes agree on the batches
whether or not they share a filesystem.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from clover_jax.checkpoint.atomic import is_primary, share_from_primary
from clover_jax.errors import UsageError
from clover_jax.jsonfile import read_lines, read_object

SETTINGS_SUFFIX = ".settings.json"


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
    if len(keep) != len(data) and is_primary():
        print(f"clover generate: dropping a torn last line from {path}", file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(len(keep))
            f.flush()
            os.fsync(f.fileno())
    return done


def shared_finished_ids(path: str, ids: Sequence[Any]) -> set:
    """Which of `ids` are already in the output, as process 0 reads it, in every process (a multi-host job's
    processes must run the same batches). Call it in every process: it is a collective when there are several."""
    done = finished_ids(path)
    mask = share_from_primary(np.array([rid in done for rid in ids], dtype=np.bool_))
    return {rid for rid, d in zip(ids, mask, strict=True) if d}


def append_rows(path: str, rows: list[dict]) -> None:
    """Append result rows as JSON lines, flushed and fsynced before returning (process 0 only)."""
    if not is_primary():
        return
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
            if not tty and is_primary():
                done = min(start + batch_size, len(jobs))
                print(f"clover generate: {done}/{len(jobs)} prompts done, written to {output}", file=sys.stderr,
                      flush=True)


def settings_path(output: str) -> str:
    """Where the settings record of the job writing `output` lives: beside it, OUTPUT.settings.json."""
    return output + SETTINGS_SUFFIX


def _has_rows(output: str) -> bool:
    return os.path.exists(output) and os.path.getsize(output) > 0


_MISSING = object()


def _shown(value: Any) -> str:
    return "(none)" if value is _MISSING else json.dumps(value, ensure_ascii=False)


def settings_changes(recorded: dict[str, Any], fingerprint: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """What differs between a recorded fingerprint and this run's, one "LABEL OLD -> NEW" each, in the order of
    `fingerprint` (then keys only the record has); `labels` spells a key as the user sets it (a flag)."""
    keys = [*fingerprint, *(k for k in recorded if k not in fingerprint)]
    return [f"{labels.get(k, k)} {_shown(recorded.get(k, _MISSING))} -> {_shown(fingerprint.get(k, _MISSING))}"
            for k in keys if recorded.get(k, _MISSING) != fingerprint.get(k, _MISSING)]


def check_settings(output: str, fingerprint: dict[str, Any], labels: dict[str, str], force: bool) -> None:
    """UsageError (one line, before any work) when `output` holds rows made under another fingerprint than this
    run's: it names what differs and says to pass --force or use another --output. Nothing to check with
    `force` (the output starts over), without rows, or without a record (an output written before records were
    kept: `record_settings` says so)."""
    if force or not _has_rows(output):
        return
    side = settings_path(output)
    if not os.path.exists(side):
        return
    try:
        recorded = read_object(side, UsageError)
    except UsageError as e:
        raise UsageError(f"{e}; cannot tell which settings made the rows in --output {output!r}: pass --force to "
                         "start over, or use another --output") from None
    changed = settings_changes(recorded, fingerprint, labels)
    if changed:
        raise UsageError(f"--output {output!r} holds rows made with other settings ({'; '.join(changed)}; "
                         f"recorded in {side}): pass --force to start over (its rows are discarded), or use another "
                         "--output")


def record_settings(output: str, fingerprint: dict[str, Any], force: bool) -> None:
    """Before the first row is appended: with `force` empty `output` (its rows discarded), then write this run's
    fingerprint to its settings record (atomically) unless the output's rows already carry that record. The output
    is emptied first, so a crash between the two never leaves old rows beside a new record. Process 0 only."""
    if not is_primary():
        return
    side = settings_path(output)
    if force and _has_rows(output):
        with open(output, "r+b") as f:
            f.truncate(0)
            f.flush()
            os.fsync(f.fileno())
        print(f"clover generate: --force: starting {output} over (its rows were discarded)", file=sys.stderr)
    if _has_rows(output):
        if os.path.exists(side):
            return  # the same settings: check_settings compared them
        print(f"clover generate: {output} has no record of the settings its rows were made with (written before "
              f"records were kept): resuming, and recording this run's in {side}", file=sys.stderr)
    tmp = f"{side}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(fingerprint, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, side)
