"""The text model's tensors against what its config describes: one judgement, shared by the conversion (which
refuses a source that differs) and `clover convert --check` (which reports every difference)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clover_jax.checkpoint.format import summary
from clover_jax.config import ModelConfig
from clover_jax.convert import mapping, published

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
IGNORED_KEYS = re.compile(r".*\.rotary_emb\.inv_freq$")  # buffers some checkpoints hold; never weights


def pattern(key: str) -> str:
    """`key` with its layer / expert numbers as `*` (`model.layers.*.mlp.gate.weight`)."""
    return re.sub(r"\.\d+\.", ".*.", key)


@dataclass(frozen=True)
class Differences:
    """How one part's tensors differ from what the config describes: keys missing and unexpected, and
    'KEY is SHAPE, expected SHAPE' / 'KEY is DTYPE, ...' lines; each sorted."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shapes: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.missing) + len(self.unexpected) + len(self.shapes) + len(self.dtypes)

    def counts(self) -> str:
        """How many of each kind, e.g. '2 missing, 1 wrong shape'."""
        return ", ".join(f"{len(items)} {what}" for what, items in (
            ("missing", self.missing), ("unexpected", self.unexpected), ("wrong shape", self.shapes),
            ("wrong dtype", self.dtypes)) if items)

    def lines(self, n_keys: int = 6, n: int = 4) -> list[str]:
        """One line per kind of difference present: its first `n_keys` keys (`n` shape / dtype lines) and how many
        more, in the words of the conversion's error."""
        return [f"{what}: {summary(list(items), k)}" for what, items, k in (
            ("missing tensors", self.missing, n_keys), ("unexpected tensors", self.unexpected, n_keys),
            ("shapes that disagree with config.json", self.shapes, n), ("dtypes", self.dtypes, n)) if items]


def tensor_problems(cfg: ModelConfig, groups: Sequence[mapping.Group],
                    tensors: Mapping[str, Any]) -> tuple[Differences, dict[str, str]]:
    """The text model's tensors among `tensors` (key -> object with `.shape` and a numpy dtype name `.dtype`, e.g.
    `hf_io.TensorInfo`; the vision tower's and MTP layers' keys (`published.part_of`) and `IGNORED_KEYS`
    are left out) against the `groups` of `cfg`: their `Differences` (matmul weights must be in cfg.dtype, the
    others of a float type), and the source dtypes by key pattern (`model.layers.*.mlp.gate.weight`) plus by exact
    key for any tensor that differs from its pattern. Pure: the conversion refuses a source whose differences are
    not empty, and records the dtypes so that an export restores them."""
    expected = {k: (tuple(s), g.kind) for g in groups for k, s in zip(g.hf, g.hf_shapes, strict=True)}
    found = {k: v for k, v in tensors.items()
             if published.part_of(k) == published.TEXT and not IGNORED_KEYS.match(k)}
    both = sorted(set(expected) & set(found))
    shapes = [f"{k} is {tuple(found[k].shape)}, expected {expected[k][0]}" for k in both
              if tuple(found[k].shape) != expected[k][0]]
    bad: list[str] = []
    dtypes: dict[str, str] = {}
    for k in both:
        dt, kind = found[k].dtype, expected[k][1]
        if kind == "matmul" and dt != cfg.dtype:
            bad.append(f"{k} is {dt}, the model is {cfg.dtype}")
        elif kind == "float32" and dt not in FLOAT_DTYPES:
            bad.append(f"{k} is {dt}, expected a float type")
        if dtypes.setdefault(pattern(k), dt) != dt:
            dtypes[k] = dt  # an exception to its pattern, kept so that export restores it exactly
    return Differences(tuple(sorted(set(expected) - set(found))), tuple(sorted(set(found) - set(expected))),
                       tuple(shapes), tuple(bad)), dtypes
