"""Training data: token streams for pretraining and prompt/response pairs for SFT.

Batches are a pure function of (seed, batch index), so the data position saved in a checkpoint is
just the index of the next batch, and a resumed run reads exactly the batches the uninterrupted
run would have read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from clover_jax.errors import DataError
from clover_jax.jsonfile import read_lines


@dataclass(frozen=True)
class Batch:
    """Host-side numpy arrays [n, L]: tokens, which positions are real (not padding), which are scored."""

    tokens: np.ndarray  # int32
    valid: np.ndarray  # bool
    loss_mask: np.ndarray  # bool: positions that may be masked and scored (all valid ones, or the response)


def split_text(text: str, holdout: float) -> tuple[str, str]:
    """(train, eval): the eval split is the last `holdout` fraction of the characters."""
    cut = len(text) - int(len(text) * holdout)
    return text[:cut], text[cut:]


def read_text(path: str) -> str:
    """The UTF-8 text of a training file; DataError if it does not exist."""
    if not os.path.isfile(path):
        raise DataError(f"training data {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None


class TokenStream:
    """Random windows of `seq_len` tokens from one long token array (pretraining)."""

    def __init__(self, ids: np.ndarray, seq_len: int, seed: int):
        if len(ids) <= seq_len:
            raise DataError(f"the corpus has {len(ids)} tokens, fewer than one sequence of {seq_len}")
        self.ids, self.seq_len, self.seed = np.asarray(ids, np.int32), seq_len, seed

    def batch(self, index: int, n: int) -> Batch:
        """Batch `index` of `n` windows: the same for the same (seed, index), so resumed runs repeat it."""
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.ids) - self.seq_len + 1, size=n)
        tokens = np.stack([self.ids[s: s + self.seq_len] for s in starts])
        ones = np.ones(tokens.shape, bool)
        return Batch(tokens, ones, ones)

    def eval_batches(self, n_seqs: int) -> Batch:
        """Up to `n_seqs` consecutive non-overlapping windows from the start: fixed, for a deterministic eval."""
        n = min(n_seqs, len(self.ids) // self.seq_len)
        tokens = self.ids[: n * self.seq_len].reshape(n, self.seq_len)
        ones = np.ones(tokens.shape, bool)
        return Batch(tokens, ones, ones)


class PairDataset:
    """SFT examples from jsonl lines {"prompt": str, "response": str}: [prompt | response eos | eos ... eos].

    Only response tokens (and what follows them) are masked and scored; the prompt stays clean as context.
    eos_padding (LLaDA's SFT recipe, the default): the row is filled to `seq_len` with end tokens that are
    scored like the response, so the model learns to close the canvas after an answer (the sampler shows it a
    whole canvas of masks after the prompt and commits whichever slot it is surest of, so a model that only ever
    saw invisible padding after answers writes answer words into the slots after them too). Off: the row ends in
    invisible padding (`pad_id`, valid False, unscored). `eos_id` None (a model without an end token): responses
    end without one and rows are padded.
    """

    def __init__(self, path: str, encode, seq_len: int, eos_id: int | None, pad_id: int, seed: int,
                 eos_padding: bool = True):
        if not os.path.isfile(path):
            raise DataError(f"SFT data {path!r} does not exist")
        rows, n_cut = [], 0
        for lineno, rec in read_lines(path, DataError, "SFT data "):
            prompt, response = rec.get("prompt"), rec.get("response")
            if not (isinstance(prompt, str) and isinstance(response, str)):
                raise DataError(f"{path}:{lineno}: expected a JSON object with 'prompt' and 'response' strings")
            p, r = list(encode(prompt)), [*encode(response), *([] if eos_id is None else [eos_id])]
            if len(p) >= seq_len:
                n_cut += 1
                continue
            r = r[: seq_len - len(p)]
            rows.append((p, r))
        if not rows:
            raise DataError(f"{path}: no usable examples ({n_cut} prompts longer than seq_len {seq_len})")
        n = len(rows)
        self.tokens = np.full((n, seq_len), pad_id, np.int32)
        self.valid = np.zeros((n, seq_len), bool)
        self.loss_mask = np.zeros((n, seq_len), bool)
        fill = eos_padding and eos_id is not None
        for i, (p, r) in enumerate(rows):
            end = seq_len if fill else len(p) + len(r)
            self.tokens[i, : len(p) + len(r)] = p + r
            self.tokens[i, len(p) + len(r): end] = eos_id if fill else pad_id
            self.valid[i, :end] = True
            self.loss_mask[i, len(p): end] = True
        self.seed = seed

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, index: int, n: int) -> Batch:
        """Batch `index` of `n` examples drawn with replacement, fixed by (seed, index)."""
        rng = np.random.default_rng([self.seed, index])
        idx = rng.integers(0, len(self), size=n)
        return Batch(self.tokens[idx], self.valid[idx], self.loss_mask[idx])

    def split(self, holdout: float) -> tuple[PairDataset, PairDataset]:
        """(train, eval) by the last `holdout` fraction of examples (at least one each)."""
        n_eval = max(1, int(len(self) * holdout))
        if len(self) - n_eval < 1:
            raise DataError(f"{len(self)} SFT examples are too few to hold out {n_eval} for eval")
        tr, ev = _view(self, slice(0, len(self) - n_eval)), _view(self, slice(len(self) - n_eval, None))
        return tr, ev

    def eval_batches(self, n_seqs: int) -> Batch:
        """The first `n_seqs` examples, for a deterministic eval."""
        n = min(n_seqs, len(self))
        return Batch(self.tokens[:n], self.valid[:n], self.loss_mask[:n])


def _view(ds: PairDataset, sl: slice) -> PairDataset:
    out = object.__new__(PairDataset)
    out.tokens, out.valid, out.loss_mask, out.seed = ds.tokens[sl], ds.valid[sl], ds.loss_mask[sl], ds.seed
    return out
