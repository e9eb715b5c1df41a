"""Watching the canvas fill in: a `generate(..., progress=...)` callback that records each snapshot.

    rec = CanvasRecorder()
    res = generate(weights, cfg, prompts, sc, progress=rec)
    passes = rec.commit_pass(cfg.mask_token_id)  # [gen_length]: the forward pass that committed each position
"""

from __future__ import annotations

import numpy as np


class CanvasRecorder:
    """A `progress` callback: row `row`'s generated columns after every refinement step, with the number of
    forward passes run so far (`frames`, in call order)."""

    def __init__(self, row: int = 0) -> None:
        self.row = row
        self.frames: list[tuple[int, np.ndarray]] = []  # (forward passes so far, canvas [gen_length])

    def __call__(self, tokens: np.ndarray, block: int, nfe: int) -> None:
        self.frames.append((nfe, np.array(tokens[self.row])))

    def commit_pass(self, mask_id: int) -> np.ndarray:
        """[gen_length] ints: the forward pass in which each position was first seen committed (0: still masked
        at the end). ValueError when nothing was recorded (the callback was not passed to `generate`)."""
        if not self.frames:
            raise ValueError("CanvasRecorder saw no step: pass it as generate(..., progress=recorder)")
        passes = np.zeros(self.frames[0][1].shape, int)
        for nfe, canvas in self.frames:
            passes[(canvas != mask_id) & (passes == 0)] = nfe
        return passes
