"""Self-speculative requests in the serving engine (a request's `diffusion.self_speculative`, on a server started with
`--self-speculative`): the block diffusion drafts, the causal model checks, and the response is exactly the causal
model's greedy text (`sampler.speculative`).

Such a request accepts a different number of tokens every round, so it cannot share the engine's block-aligned
rows: it runs whole, alone, through the sampler's own self-speculative program (one per prompt width, compiled at
start like the engine's other programs), on a lane of its own beside the batched rows. Its response arrives in one
piece (one event), cut at its end token or at its max_tokens.

Contract: `programs(...)` are the lane's programs as {("speculative", width): (jitted function, arguments)};
`inputs(...)` lays one request out for them; `event(...)` turns a program's output into the request's last event.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.mesh.rules import MeshRules
from clover_jax.model.forward_fn import ForwardFn
from clover_jax.sampler.generate import Batch, prepare_batch
from clover_jax.sampler.program import ProgramOut, ProgramSpec, run_program
from clover_jax.sampler.settings import SamplerConfig, knobs
from clover_jax.serving.requests import Event

KIND = "speculative"


def spec(cfg: ModelConfig, block_length: int, width: int, gen_columns: int, mesh: MeshRules | None) -> ProgramSpec:
    """The sampler's program for one request of a prompt up to `width` tokens and `gen_columns` new columns."""
    return ProgramSpec(cfg, 1, width, gen_columns, block_length, "prefix", mesh=mesh, block_grid="prompt",
                       self_speculative=True)


def programs(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, widths: Sequence[int], gen_columns: int,
             weights: Any, mesh: MeshRules | None) -> dict[tuple[str, int], tuple[Any, tuple]]:
    """{(KIND, width): (jitted program, its arguments as ShapeDtypeStructs after `weights`)} per prompt width."""
    probe = knobs(SamplerConfig(gen_length=block_length, block_length=block_length), cfg)
    knob_structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.result_type(x)), probe)
    i32 = jnp.int32
    out = {}
    for w in widths:
        fn = jax.jit(functools.partial(run_program, spec(cfg, block_length, w, gen_columns, mesh), forward_fn))
        out[KIND, w] = (fn, (weights, jax.ShapeDtypeStruct((1, w), i32), jax.ShapeDtypeStruct((1,), i32),
                             jax.ShapeDtypeStruct((1, gen_columns), i32), knob_structs))
    return out


def inputs(cfg: ModelConfig, prompt: Sequence[int], width: int, gen_columns: int, max_tokens: int,
           block_length: int) -> Batch:
    """One request laid out for the program of `width`: the generated columns after the first `max_tokens` are
    not masked, so the program stops there."""
    batch = prepare_batch([prompt], block_length, cfg, gen_columns, batch=1, prompt_len=width)
    start = batch.start.copy()
    start[0, max_tokens:] = cfg.filler_id
    return batch._replace(start=start)


def event(cfg: ModelConfig, out: ProgramOut, max_tokens: int, queued_s: float) -> tuple[Event, int]:
    """The request's one event (its tokens cut at the end token, "stop", else at max_tokens, "length") and the
    forward passes it took."""
    row = [int(t) for t in np.asarray(out.tokens)[0, :max_tokens]]
    passes = int(out.nfe)
    if cfg.eos_token_id is not None and cfg.eos_token_id in row:
        return Event(tuple(row[:row.index(cfg.eos_token_id)]), "stop", passes, queued_s), passes
    return Event(tuple(row), "length", passes, queued_s), passes
