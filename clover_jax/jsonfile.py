"""Reading JSON a user supplied (config.json, generation_config.json, jsonl prompts and SFT rows), with
one-line errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from clover_jax.errors import CloverError


def read_object(path: str, error: type[CloverError]) -> dict[str, Any]:
    """The JSON object in `path`; `error` naming the file when it cannot be read, is not valid UTF-8 JSON
    or holds something other than an object."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: not a JSON object")
    return doc


def read_lines(path: str, error: type[CloverError], what: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) for every non-blank line of the jsonl file `path`; `error` naming the
    file (`what`: how the user named it, e.g. "--input ") when it cannot be read, and the line when one is not
    UTF-8 or not a JSON object."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise error(f"cannot read {what}{path!r}: {e.strerror or e}") from None
    for n, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise error(f"{path}:{n}: each line must be a JSON object, got {type(obj).__name__}")
        yield n, obj
