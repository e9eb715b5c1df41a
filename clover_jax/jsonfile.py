"""Reading a JSON object a user supplied (config.json, generation_config.json), with one-line errors."""

from __future__ import annotations

import json
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
