"""Progress of long work on stderr that reads well wherever stderr goes.

`progress_bar(total, desc, ...)` is a tqdm bar on a terminal; elsewhere (a log file, a pipe, CI) a redrawn bar
would write a carriage-return frame every half second into the log, so it writes whole lines instead, one each
time another tenth of the work is done and at most one every `every_s` seconds between them:
"clover convert: import: 40% (648.0 MB of 1.6 GB, 12 s)". Both have `update(n)` and `close()` and work as context
managers.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm


def _amount(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f}"
    for size, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= size:
            return f"{n / size:.1f} {name}"
    return f"{n:.0f} B"


class LineProgress:
    """Whole lines of progress (see the module docstring)."""

    def __init__(self, total: float, desc: str, prefix: str, unit: str = "B", every_s: float = 60.0,
                 stream: TextIO | None = None) -> None:
        self.total, self.desc, self.prefix, self.unit, self.every_s = total, desc, prefix, unit, every_s
        self.stream = stream or sys.stderr
        self.n = 0.0
        self._start = self._last = time.monotonic()
        self._tenth = 0
        self._closed = False

    def update(self, n: float = 1) -> None:
        """Count `n` more units done; write a line when another tenth is done or `every_s` passed."""
        self.n += n
        tenth = int(10 * self.n / self.total) if self.total else 10
        now = time.monotonic()
        if tenth > self._tenth or now - self._last >= self.every_s:
            self._tenth = max(tenth, self._tenth)
            self._say(now)

    def _say(self, now: float) -> None:
        self._last = now
        share = f"{100 * self.n / self.total:.0f}% " if self.total else ""
        of = f" of {_amount(self.total, self.unit)}" if self.total else ""
        print(f"{self.prefix}: {self.desc}: {share}({_amount(self.n, self.unit)}{of}, {now - self._start:.0f} s)",
              file=self.stream, flush=True)

    def close(self) -> None:
        """Done: nothing more is written (the last tenth was written by `update`)."""
        self._closed = True

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(total: float, desc: str, prefix: str, *, unit: str = "B", enabled: bool = True,
                 stream: TextIO | None = None, **tqdm_args: Any) -> Any:
    """A tqdm bar when `stream` (default stderr) is a terminal, else `LineProgress` lines prefixed `prefix`
    ("clover convert"); a disabled tqdm bar (writes nothing) when not `enabled`."""
    stream = stream or sys.stderr
    if enabled and not stream.isatty():
        return LineProgress(total, desc, prefix, unit, stream=stream)
    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not enabled, dynamic_ncols=True,
                **scale, **tqdm_args)
