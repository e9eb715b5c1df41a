"""`clover serve`'s log lines: readable as text, parseable as JSON (`--log-format text|json`).

Every line `clover serve` writes to stderr goes through here: its own messages (`say`), uvicorn's
(`uvicorn_log_config` routes them), the HTTP layer's errors (logger `clover_jax.serving`) and one
access line per HTTP request (logger `clover_jax.serving.access`, `log_access`).

text: `clover serve: MESSAGE` (`clover serve: LEVEL: MESSAGE` above info); an access line is
      `clover serve: access key=value ...` with the fields of `ACCESS_FIELDS` in that order, values
      without spaces, quotes or control characters (anything else is escaped as \\xNN), so
      `key=value` splitting parses it;
json: one object per line: {"time": ISO-8601 UTC, "level", "logger", "message"} (+ "exception" with
      a traceback), an access line adds {"event": "access", ACCESS_FIELDS...} with typed values.

What an access line holds never includes a header's value (an API key cannot reach the logs), only
the path of the URL (never its query string).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

LOG_FORMATS = ("text", "json")
LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
          "debug": logging.DEBUG, "trace": 5}
ACCESS_LOGGER = "clover_jax.serving.access"
SERVING_LOGGER = "clover_jax.serving"
# The fields of an access line, in order (`Access.fields`).
ACCESS_FIELDS = ("request_id", "method", "path", "status", "tokens_in", "tokens_cached", "tokens_out", "passes",
                 "queue_s", "run_s",
                 "finish", "error", "client")
MAX_FIELD = 256  # characters of a text field kept (a path, a client address); the rest becomes "..."


def clean(value: Any) -> str:
    """A text-format field: printable ASCII but space, quote, backslash and '=' kept, everything else as
    \\xNN (\\uNNNN above 0xff), cut at MAX_FIELD characters; "-" for None or an empty value."""
    if value is None:
        return "-"
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    out = []
    for ch in text[:MAX_FIELD]:
        o = ord(ch)
        if 0x21 <= o <= 0x7E and ch not in "\"\\=":
            out.append(ch)
        else:
            out.append(f"\\x{o:02x}" if o <= 0xFF else f"\\u{o:04x}")
    return ("".join(out) + ("..." if len(text) > MAX_FIELD else "")) or "-"


def _time(record: logging.LogRecord) -> str:
    return datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    """`clover serve: MESSAGE` lines; access records (`extra={"access": {...}}`) as key=value fields."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            return "clover serve: access " + " ".join(f"{k}={clean(fields.get(k))}" for k in ACCESS_FIELDS)
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"clover serve: {level}{message}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (a traceback goes into "exception", newlines escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {"time": _time(record), "level": record.levelname.lower(), "logger": record.name}
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            obj |= {"event": "access", "message": "access", **{k: fields.get(k) for k in ACCESS_FIELDS}}
        else:
            obj["message"] = record.getMessage()
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=True, default=str)


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of `--log-format` `fmt` ("text" or "json")."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; choose one of {', '.join(LOG_FORMATS)}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def say(message: str, fmt: str = "text", level: str = "info") -> None:
    """One line of `clover serve`'s own on stderr, in format `fmt`."""
    record = logging.LogRecord("clover serve", LEVELS[level], __file__, 0, message, None, None)
    print(formatter(fmt).format(record), file=sys.stderr, flush=True)


def uvicorn_log_config(fmt: str, level: str) -> dict[str, Any]:
    """A `logging.config.dictConfig` for uvicorn.Config(log_config=...): uvicorn's messages, the HTTP
    layer's errors and the access lines all on stderr in format `fmt` at `level` (uvicorn's own access
    log is off: the access lines replace it)."""
    formatter(fmt)  # check it
    lvl = LEVELS[level]
    cls = "clover_jax.serving.logs." + ("JsonFormatter" if fmt == "json" else "TextFormatter")
    one = {"handlers": ["stderr"], "level": lvl, "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"clover": {"()": cls}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "clover", "stream": "ext://sys.stderr"}},
        "loggers": {"uvicorn": one, "uvicorn.error": {"level": lvl}, "uvicorn.access": {"handlers": [],
                                                                                          "propagate": False},
                    SERVING_LOGGER: one, "clover_jax.serving.engine": {"level": lvl}},
    }


def log_access(fields: dict[str, Any]) -> None:
    """One access line (at info) with `fields` (keys of ACCESS_FIELDS)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if logger.isEnabledFor(logging.INFO):
        logger.info("access", extra={"access": fields})
