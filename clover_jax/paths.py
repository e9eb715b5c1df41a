"""Where a command may write: the one write probe every output check uses."""

from __future__ import annotations

import os
import tempfile


def unwritable_reason(path: str) -> str | None:
    """Why nothing can be created at `path` (its nearest existing directory refuses a new file, or a
    file sits where a directory must be), or None when it can. A real write probe: access() says yes to
    root on a read-only filesystem."""
    probe = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(probe):
        if os.path.lexists(probe):
            return f"{probe} is not a directory"
        probe = os.path.dirname(probe)
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".clover-write-test-"):
            pass
    except OSError as e:
        return f"cannot write into {probe} ({e.strerror or e})"
    return None
