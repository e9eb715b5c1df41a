"""mkdocs hook: put benchmarks/README.md into the site as `benchmarks.md`.

The benchmark figures stay in benchmarks/README.md, next to the scripts that print them; the site shows that file
as its "Benchmarks" page. Its links into the repository's README point at the sections that now live on the
documentation pages (ANCHORS); any other link out of the docs folder becomes plain text, so the strict build never
breaks on a link the site cannot hold.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "README.md"
PAGE = "benchmarks.md"

# README anchors that benchmarks/README.md links to -> the page (and section) that holds them now.
ANCHORS = {
    "clover-plan-will-it-fit-and-what-does-a-pass-cost": "plan.md",
    "quantized-weights-int8-and-fp8": "quantization.md",
    "performance": "performance.md",
    "serving-clover-serve": "serving.md",
    "the-model": "model.md",
}
_LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)\s]*)\)")


def rewrite(text: str) -> str:
    """benchmarks/README.md with its links out of the benchmarks folder pointed into the site."""

    def one(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        path, _, anchor = target.partition("#")
        if path == "../README.md":
            return f"[{label}]({ANCHORS.get(anchor, 'index.md')})"
        return label  # a file of the repository: no page of the site

    return _LINK.sub(one, text)


def on_files(files: Files, config) -> Files:
    if SOURCE.exists():
        files.append(File.generated(config, PAGE, content=rewrite(SOURCE.read_text(encoding="utf-8"))))
    return files
