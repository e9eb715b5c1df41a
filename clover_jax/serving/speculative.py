"""The causal lane of the serving engine (a server started with `--self-speculative`): requests that ask for
`diffusion.self_speculative` (the block diffusion drafts, the causal model checks) or `diffusion.causal` (one
token a pass, as an autoregressive model decodes); either response is exactly the causal model's greedy text
(`sampler.speculative`).

Such a request advances by a different number of tokens every round, so it cannot share the engine's block-aligned
rows: it runs whole, alone, through the sampler's own program of its kind (one per kind and prompt width, compiled
by the engine when a request first needs it), on a lane of its own beside the batched rows. Its response arrives in
one piece (one event), cut at its end token or at its max_tokens. With the engine's prefix cache, the programs take
the longest saved prompt its prompt begins with (saved by a row or by the lane) and give back the cache of its
stem (a chat's conversation before the assistant's opening, else its prompt but the last token) for the store.

Contract: `programs(...)` are the lane's programs as {(KIND or CAUSAL, width): (jitted function, arguments)}
(with `reuse_columns`, the engine's row width, they take a `sampler.speculative.Reuse` last and return
(`ProgramOut`, the stem's cache)); `kind(settings)` is the one a request runs; `inputs(...)` lays one request out
for them; `event(...)` turns a program's output into the request's last event.
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
from clover_jax.sampler.speculative import Reuse, run_speculative
from clover_jax.serving.requests import Event

KIND = "speculative"  # the self-speculative programs
CAUSAL = "causal"  # the causal (one token a pass) programs
KINDS = (KIND, CAUSAL)


def kind(settings: SamplerConfig) -> str | None:
    """The lane's kind of program a request with `settings` runs (None: it is not the lane's)."""
    return KIND if settings.self_speculative else CAUSAL if settings.causal else None


def spec(cfg: ModelConfig, block_length: int, width: int, gen_columns: int, mesh: MeshRules | None,
         of: str = KIND) -> ProgramSpec:
    """The sampler's program of kind `of` for one request of a prompt up to `width` tokens and `gen_columns` new
    columns."""
    return ProgramSpec(cfg, 1, width, gen_columns, block_length, "prefix", mesh=mesh, block_grid="prompt",
                       self_speculative=of == KIND, causal=of == CAUSAL)


def _reusing(spec: ProgramSpec, forward_fn: ForwardFn, weights: Any, prompt: Any, prompt_len: Any, start: Any,
             row_knobs: Any, reuse: Reuse) -> tuple[ProgramOut, Any]:
    *out, stem = run_speculative(spec, forward_fn, weights, prompt, prompt_len, start, row_knobs, reuse)
    return ProgramOut(*out, None), stem


def programs(cfg: ModelConfig, forward_fn: ForwardFn, block_length: int, widths: Sequence[int], gen_columns: int,
             weights: Any, mesh: MeshRules | None,
             reuse_columns: int | None = None) -> dict[tuple[str, int], tuple[Any, tuple]]:
    """{(kind, width): (jitted program, its arguments as ShapeDtypeStructs after `weights`)} per kind (`KINDS`) and
    prompt width; with `reuse_columns` (the engine's row width, its prefix cache on) the reusing form (see the
    module docstring)."""
    probe = knobs(SamplerConfig(gen_length=block_length, block_length=block_length), cfg)
    knob_structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.result_type(x)), probe)
    i32 = jnp.int32
    out = {}
    for of in KINDS:
        for w in widths:
            run = run_program if reuse_columns is None else _reusing
            fn = jax.jit(functools.partial(run, spec(cfg, block_length, w, gen_columns, mesh, of), forward_fn))
            args = (weights, jax.ShapeDtypeStruct((1, w), i32), jax.ShapeDtypeStruct((1,), i32),
                    jax.ShapeDtypeStruct((1, gen_columns), i32), knob_structs)
            if reuse_columns is not None:
                scalar = jax.ShapeDtypeStruct((), i32)
                args += (Reuse(jax.eval_shape(lambda: forward_fn.init_cache(1, reuse_columns)), scalar, scalar),)
            out[of, w] = (fn, args)
    return out


def inputs(cfg: ModelConfig, prompt: Sequence[int], width: int, gen_columns: int, max_tokens: int,
           block_length: int) -> Batch:
    """One request laid out for the program of `width`: the generated columns after the first `max_tokens` are
    not masked, so the program stops there."""
    batch = prepare_batch([prompt], block_length, cfg, gen_columns, batch=1, prompt_len=width)
    start = batch.start.copy()
    start[0, max_tokens:] = cfg.filler_id
    return batch._replace(start=start)


def event(cfg: ModelConfig, out: ProgramOut, max_tokens: int, queued_s: float, cached: int = 0) -> tuple[Event, int]:
    """The request's one event (its tokens cut at the end token, "stop", else at max_tokens, "length"; `cached`: its
    prompt tokens the prefix cache gave) and the forward passes it took."""
    row = [int(t) for t in np.asarray(out.tokens)[0, :max_tokens]]
    passes = int(out.nfe)
    if cfg.eos_token_id is not None and cfg.eos_token_id in row:
        return Event(tuple(row[:row.index(cfg.eos_token_id)]), "stop", passes, queued_s, cached), passes
    return Event(tuple(row), "length", passes, queued_s, cached), passes
