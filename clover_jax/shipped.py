"""Files that ship inside the package: the named mesh layouts, the trained `clover-tiny` model and
`clover-tiny-tools`, clover-tiny fine-tuned to call the toy task's tools (the repository's `examples/toy_agent`).

In the repository they live in the top-level `sharding/` and `checkpoints/` folders;
`clover_jax/_shipped/` links to them, and a wheel carries copies, so the same paths work from a
checkout, an editable install and a wheel installed anywhere.
"""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent / "_shipped"

LAYOUT_DIR = _ROOT / "sharding"  # NAME.toml mesh layouts (`--mesh NAME`)
MODEL_DIR = _ROOT / "clover-tiny"  # the default model of `clover generate`
TOOLS_MODEL_DIR = _ROOT / "clover-tiny-tools"  # calls square / double / capital (`examples/toy_agent`)
