"""Masked-diffusion training: one jitted train step, optax AdamW, Orbax checkpoints with exact resume.

The step takes the whole batch as [accum, micro_batch, L] and scans over the micro-batches, so gradient
accumulation lives inside one compiled program. Randomness is `fold_in(base_key, step)` and the data
of step s is `dataset.batch(s)`, so a run resumed from a checkpoint at step k computes bit for bit
the steps an uninterrupted run computes after k.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from clover_jax.config import ModelConfig
from clover_jax.errors import ConfigError
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import masks, params
from clover_jax.training import losses
from clover_jax.training.data import Batch

Array = jax.Array


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, objective and bookkeeping settings of one training run (validated on creation)."""

    steps: int = 1000
    batch_size: int = 16  # sequences per optimizer step (all micro-batches together)
    grad_accum: int = 1  # micro-batches per step
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    noise_eps: float = 1e-3  # t ~ U(noise_eps, noise_max)
    noise_max: float = 1.0  # < 1 with a larger noise_eps: BD3-LM's clipped schedule (lower-variance gradients)
    # where a response's blocks start (`masks.BLOCK_GRIDS`); auto: the grid the family's sampler uses, so SFT trains
    # the arrangement generation runs. Plain text (every column scored) is the same on both.
    block_grid: str = "auto"
    lb_coef: float = 0.01  # Switch load-balancing loss
    z_coef: float = 1e-3  # router z-loss
    # The clean half's next-token cross-entropy (causal-prefix models only: the causal path that commits blocks,
    # scores exact likelihoods and checks self-speculative drafts), weighted against the diffusion loss; 0: off.
    causal_coef: float = 0.0
    bias_update_rate: float = 1e-3  # aux-loss-free balancing for routers with a selection bias
    seed: int = 0
    dispatch: str = "dense"  # MoE dispatch used for training (must be differentiable)
    remat: bool = False
    eval_every: int = 200
    eval_seqs: int = 32
    ckpt_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 50

    def __post_init__(self) -> None:
        for f in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "ckpt_every", "log_every"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by grad_accum {self.grad_accum}")
        for f in ("lr", "clip_norm"):
            if not math.isfinite(getattr(self, f)) or getattr(self, f) <= 0:
                raise ValueError(f"{f} must be a positive number, got {getattr(self, f)}")
        for f in ("weight_decay", "lb_coef", "z_coef", "causal_coef"):
            if not math.isfinite(getattr(self, f)) or getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.noise_eps < self.noise_max <= 1:
            raise ValueError(f"need 0 < noise_eps < noise_max <= 1, got {self.noise_eps}, {self.noise_max}")
        if self.block_grid not in ("auto", *masks.BLOCK_GRIDS):
            raise ValueError(f"unknown block grid {self.block_grid!r}; choose one of {('auto', *masks.BLOCK_GRIDS)}")

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch (one scan step of the train step)."""
        return self.batch_size // self.grad_accum


@dataclass(frozen=True)
class EvalProtocol:
    """A deterministic eval: fixed sequences, fixed noise levels (every block at the same t), fixed mask seed.

    The figure is the 1/t-weighted masked CE per scored token averaged over the t grid: a Riemann sum
    of the diffusion bound on NLL (nats/token).
    """

    t_grid: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    seed: int = 1234
    micro_batch: int = 8
    n_seqs: int = 16  # consecutive windows of seq_len tokens from the start of the held-out text
    block_grid: str = "auto"  # as TrainConfig.block_grid

    def to_dict(self) -> dict[str, Any]:
        """The protocol as JSON-ready values (for model cards)."""
        return dataclasses.asdict(self)


@struct.dataclass
class TrainState:
    """Everything a resumed run needs: step, weights, optimizer state and the base key."""

    step: Array  # [] int32
    weights: Any
    opt_state: Any
    key: Array  # [2] uint32 base key (per-step keys are fold_in(key, step))


def decay_mask(cfg: ModelConfig) -> Any:
    """Weight decay on matrices only: not norms (init ones) or selection biases (init zeros)."""
    return params.map_specs(lambda s: s.init == "normal", cfg)


def make_optimizer(cfg: ModelConfig, tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW (decay on matrices only) after global-norm clipping, on a warmup + cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, min(tc.warmup_steps, tc.steps - 1) if tc.steps > 1 else 0, max(tc.steps, 1),
        end_value=tc.lr * tc.min_lr_ratio)
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(schedule, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask(cfg)))


def _expert_bias_update(weights: Any, load: Array, rate: float) -> Any:
    """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts. load [layers, E]."""
    moe = weights.moe_layers
    if moe is None or moe.mlp.expert_bias is None:
        return weights
    bias = moe.mlp.expert_bias + rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)
    return weights.replace(moe_layers=moe.replace(mlp=moe.mlp.replace(expert_bias=bias)))


def make_train_step(cfg: ModelConfig, tc: TrainConfig, tx: optax.GradientTransformation,
                    mesh: MeshRules | None = None) -> Callable:
    """step_fn(state, tokens, valid, loss_mask [accum, micro_batch, L]) -> (state, metrics): one optimizer
    step, gradients accumulated over the micro-batches by a scan inside the program."""

    block_grid = masks.resolve_block_grid(cfg, tc.block_grid)
    causal = tc.causal_coef > 0
    if causal and not cfg.causal_prefix:
        raise ConfigError(f"causal_coef {tc.causal_coef}: a causal next-token loss needs a causal-prefix model "
                          f"(bd_gdn='causal_prefix'); {cfg.name} runs no causal path")

    def micro_loss(weights: Any, tok: Array, val: Array, lm: Array, key: Array, n_scored: Array):
        k_t, k_m = jax.random.split(key)
        t = losses.block_noise_levels(k_t, cfg, tok.shape[0], tok.shape[1], block_grid, tc.noise_eps, tc.noise_max)
        terms = losses.diffusion_terms(weights, cfg, tok, val, lm, t, k_m, tc.dispatch, tc.remat, mesh, block_grid,
                                       causal=causal)
        diff = terms.weighted_ce / n_scored
        ar = terms.causal_ce / n_scored
        lb = z = jnp.zeros((), jnp.float32)
        if terms.moe is not None:
            lb = losses.load_balancing_loss(terms.moe, cfg.n_experts)
            z = losses.router_z_loss(terms.moe)
        total = diff + tc.causal_coef * ar + (tc.lb_coef * lb + tc.z_coef * z) / tc.grad_accum
        return total, (diff, lb, z, terms.correct, terms.n_masked, terms.moe, terms.causal_ce, terms.n_causal)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step_fn(state: TrainState, tokens: Array, valid: Array, loss_mask: Array) -> tuple[TrainState, dict]:
        key = jax.random.fold_in(state.key, state.step)
        n_scored = jnp.maximum(jnp.sum(loss_mask & valid).astype(jnp.float32), 1.0)
        keys = jax.random.split(key, tc.grad_accum)
        zeros = jax.tree.map(jnp.zeros_like, state.weights)

        def body(carry, xs):
            grads, acc = carry
            tok, val, lm, k = xs
            (_, (diff, lb, z, corr, nm, st, cce, nc)), g = grad_fn(state.weights, tok, val, lm, k, n_scored)
            grads = jax.tree.map(jnp.add, grads, g)
            load = st.load if st is not None else jnp.zeros((1, 1))
            acc = (acc[0] + diff, acc[1] + lb, acc[2] + z, acc[3] + corr, acc[4] + nm, acc[5] + load, acc[6] + cce,
                   acc[7] + nc)
            return (grads, acc), None

        n_layers_moe = cfg.n_moe_layers if cfg.n_moe_layers else 1
        e = cfg.n_experts if cfg.n_moe_layers else 1
        f0 = jnp.zeros((), jnp.float32)
        acc0 = (f0, f0, f0, f0, f0, jnp.zeros((n_layers_moe, e), jnp.float32), f0, f0)
        (grads, acc), _ = jax.lax.scan(body, (zeros, acc0), (tokens, valid, loss_mask, keys))
        diff, lb, z, corr, nm, load, cce, nc = acc
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.weights)
        weights = optax.apply_updates(state.weights, updates)
        if cfg.use_expert_bias and cfg.n_moe_layers:
            weights = _expert_bias_update(weights, load / tc.grad_accum, tc.bias_update_rate)
        metrics = {"loss": diff, "lb_loss": lb / tc.grad_accum, "z_loss": z / tc.grad_accum,
                   "masked_acc": corr / jnp.maximum(nm, 1.0), "grad_norm": grad_norm}
        if causal:
            metrics["causal_loss"] = cce / jnp.maximum(nc, 1.0)
        return TrainState(state.step + 1, weights, opt_state, state.key), metrics

    return step_fn


def make_eval_fn(cfg: ModelConfig, proto: EvalProtocol, dispatch: str | None,
                 mesh: MeshRules | None = None) -> Callable:
    """(weights, tokens, valid, loss_mask [chunks, mb, L]) -> dict of eval figures; one jitted program. A
    causal-prefix model's figures include `eval_causal_ce`: the causal path's next-token CE (nats/token)."""
    levels = jnp.asarray(proto.t_grid, jnp.float32)
    block_grid = masks.resolve_block_grid(cfg, proto.block_grid)
    causal = cfg.causal_prefix

    def eval_fn(weights: Any, tokens: Array, valid: Array, loss_mask: Array) -> dict:
        base = jax.random.PRNGKey(proto.seed)

        def chunk(acc, xs):
            i, tok, val, lm = xs

            def at_t(acc, j):
                t = jnp.full((tok.shape[0], losses.n_blocks(cfg, tok.shape[1], block_grid)), levels[j])
                key = jax.random.fold_in(jax.random.fold_in(base, i), j)
                terms = losses.diffusion_terms(weights, cfg, tok, val, lm, t, key, dispatch, mesh=mesh, grid=block_grid,
                                               causal=causal)
                return (acc[0] + terms.weighted_ce, acc[1] + terms.ce, acc[2] + terms.correct,
                        acc[3] + terms.n_masked, acc[4] + terms.causal_ce, acc[5] + terms.n_causal), None

            acc, _ = jax.lax.scan(at_t, acc, jnp.arange(levels.shape[0]))
            return acc, None

        f0 = jnp.zeros((), jnp.float32)
        idx = jnp.arange(tokens.shape[0])
        (wce, ce, corr, nm, cce, nc), _ = jax.lax.scan(chunk, (f0,) * 6, (idx, tokens, valid, loss_mask))
        n_scored = jnp.maximum(jnp.sum(loss_mask & valid).astype(jnp.float32), 1.0)
        out = {"eval_loss": wce / (n_scored * levels.shape[0]), "eval_masked_ce": ce / jnp.maximum(nm, 1.0),
               "eval_masked_acc": corr / jnp.maximum(nm, 1.0)}
        if causal:  # the clean half is the same at every t: the mean over the grid is its figure
            out["eval_causal_ce"] = cce / jnp.maximum(nc, 1.0)
        return out

    return eval_fn


def chunk_batch(b: Batch, n_chunks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n, L] -> [n_chunks, n / n_chunks, L] for the scan inside the step / eval."""

    def r(x: np.ndarray) -> np.ndarray:
        return x.reshape(n_chunks, x.shape[0] // n_chunks, *x.shape[1:])

    return r(b.tokens), r(b.valid), r(b.loss_mask)


@functools.lru_cache(maxsize=4)
def _single_device_step(cfg: ModelConfig, tc: TrainConfig) -> Callable:
    return jax.jit(make_train_step(cfg, tc, make_optimizer(cfg, tc)), donate_argnums=0)


@functools.lru_cache(maxsize=8)
def _eval_program(cfg: ModelConfig, proto: EvalProtocol, dispatch: str | None) -> Callable:
    return jax.jit(make_eval_fn(cfg, proto, dispatch))


def evaluate(weights: Any, cfg: ModelConfig, batch: Batch, proto: EvalProtocol = EvalProtocol(),
             dispatch: str | None = "dense") -> dict[str, float]:
    """Deterministic eval figures for `batch` (trimmed to a multiple of proto.micro_batch sequences)."""
    n_all = min(batch.tokens.shape[0], proto.n_seqs)
    mb = min(proto.micro_batch, n_all)
    n = n_all // mb * mb
    b = Batch(batch.tokens[:n], batch.valid[:n], batch.loss_mask[:n])
    out = _eval_program(cfg, proto, dispatch)(weights, *chunk_batch(b, n // mb))
    return {k: float(v) for k, v in out.items()}


# ---- the loop ----------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What `train` returns: the final state, this call's losses and evals, and the run's totals."""

    state: TrainState
    losses: list[float]  # per step, this run only (index = step - first step)
    first_step: int
    evals: list[dict]
    tokens_seen: int  # this call
    wall_s: float  # this call
    total_tokens: int = 0  # every call since step 0 (carried in the checkpoints)
    total_wall_s: float = 0.0


def _checkpoint_manager(directory: str, tc: TrainConfig) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=tc.keep_checkpoints, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts)


def _state_dict(state: TrainState) -> dict[str, Any]:
    leaves = jax.tree.leaves(state)
    return {f"{i:05d}": x for i, x in enumerate(leaves)}


def _save(mngr: ocp.CheckpointManager, state: TrainState, meta: dict) -> None:
    step = int(state.step)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state_dict(state)),
                                            meta=ocp.args.JsonSave(meta)), force=True)


def _restore(mngr: ocp.CheckpointManager, state: TrainState) -> tuple[TrainState, dict] | None:
    step = mngr.latest_step()
    if step is None:
        return None
    target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in _state_dict(state).items()}
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                     meta=ocp.args.JsonRestore()))
    leaves = [got.state[k] for k in sorted(got.state)]
    return jax.tree.unflatten(jax.tree.structure(state), leaves), dict(got.meta)


def _unnamed(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: v for k, v in d.items() if k != "name"}


def train(
    cfg: ModelConfig,
    tc: TrainConfig,
    train_data: Any,
    eval_data: Any | None = None,
    ckpt_dir: str | None = None,
    mesh: MeshRules | None = None,
    stop_at: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    init_weights: Any = None,
    eval_at_end: bool = True,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train from scratch or resume from the latest checkpoint in `ckpt_dir`.

    train_data / eval_data: objects with `batch(index, n) -> Batch` / `eval_batches(n) -> Batch`.
    mesh: train data-parallel / sharded on this mesh (weights in `params.weight_shardings` of it).
    stop_at: stop (and checkpoint) after this global step, as an interruption would.
    eval_at_end: evaluate after the last step (off when the caller runs its own final evaluation).
    on_step: called after every step with the global step number (1-based) and that step's metrics as
    floats (`loss`, `diffusion_loss`, ..., the same names the log prints), e.g. to draw a live loss curve.
    Start-up (initialisation, restore, the first step's compile) is announced through `log`.
    """
    if cfg.quantization != "none":
        raise ConfigError(f"config {cfg.name!r} has {cfg.quantization} weights: training needs float weights "
                          "(train the float model, then clover convert --quantize)")
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    tx = make_optimizer(cfg, tc)
    w_sh = batch_sh = None
    if mesh is not None:
        w_sh = params.weight_shardings(cfg, mesh.mesh, mesh.rules)
        data_axes = tuple(a for a in ("data", "fsdp") if mesh.size(a) > 1)
        if tc.micro_batch % max(1, math.prod(mesh.size(a) for a in data_axes)):
            raise ValueError(f"micro batch {tc.micro_batch} is not divisible by the data axes {data_axes} of the mesh")
        batch_sh = NamedSharding(mesh.mesh, PartitionSpec(None, data_axes or None, None))
    key = jax.random.PRNGKey(tc.seed)
    k_init, k_train = jax.random.split(key)
    if init_weights is None:
        log(f"initialising {cfg.name} ...")
    weights = init_weights if init_weights is not None else params.init(cfg, k_init, w_sh)
    opt_state = jax.jit(tx.init)(weights)
    state = TrainState(jnp.zeros((), jnp.int32), weights, opt_state, k_train)
    if mesh is not None:
        # Optimizer moments follow their weights' shardings; scalars (step, counts, key) are replicated.
        rep = NamedSharding(mesh.mesh, PartitionSpec())
        state = jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh.mesh
            else jax.device_put(x, rep), state)

    mngr = _checkpoint_manager(ckpt_dir, tc) if ckpt_dir else None
    meta_base = {"train_config": dataclasses.asdict(tc), "model_config": cfg.to_dict()}
    prev_tokens, prev_wall = 0, 0.0
    if mngr is not None:
        restored = _restore(mngr, state)
        if restored is not None:
            state, meta = restored
            # The same model under another name resumes; compared as JSON stores it (lists, not tuples).
            if _unnamed(meta.get("model_config")) != _unnamed(json.loads(json.dumps(cfg.to_dict()))):
                raise ValueError(f"checkpoint in {ckpt_dir} was written for a different model config")
            if meta.get("data_position") != int(state.step):
                raise ValueError(f"checkpoint data position {meta.get('data_position')} != step {int(state.step)}")
            prev_tokens, prev_wall = int(meta.get("tokens_seen", 0)), float(meta.get("wall_s", 0.0))
            log(f"resumed from {ckpt_dir} at step {int(state.step)}")

    state_sh = jax.tree.map(lambda x: x.sharding, state) if mesh is not None else None
    if mesh is None:
        # Shared by calls with the same configs (resume, tests), whatever the model's name: it is in no program.
        step_fn = _single_device_step(cfg.replace(name="train-step"), tc)
    else:
        step_fn = jax.jit(make_train_step(cfg, tc, tx, mesh), donate_argnums=0,
                          in_shardings=(state_sh, batch_sh, batch_sh, batch_sh), out_shardings=(state_sh, None))
    eval_arrays = None
    eval_fn = None
    proto = EvalProtocol(block_grid=tc.block_grid)
    if eval_data is not None:
        eb = eval_data.eval_batches(tc.eval_seqs)
        mb = min(proto.micro_batch, eb.tokens.shape[0])
        n = eb.tokens.shape[0] // mb * mb
        eval_arrays = chunk_batch(Batch(eb.tokens[:n], eb.valid[:n], eb.loss_mask[:n]), n // mb)
        eval_fn = jax.jit(make_eval_fn(cfg, proto, tc.dispatch, mesh))

    first = int(state.step)
    last = tc.steps if stop_at is None else min(stop_at, tc.steps)
    hist: list[float] = []
    evals: list[dict] = []
    tokens_seen = 0
    t0 = time.perf_counter()

    def totals() -> dict:
        return {"tokens_seen": prev_tokens + tokens_seen, "wall_s": prev_wall + time.perf_counter() - t0}

    def run_eval(step: int) -> None:
        if eval_fn is None:
            return
        ev = {k: float(v) for k, v in eval_fn(state.weights, *eval_arrays).items()}
        ev["step"] = step
        evals.append(ev)
        log(f"eval step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in ev.items() if k != "step"))

    bar = None
    if progress and sys.stderr.isatty():  # elsewhere the log lines (`log_every`) are the progress
        bar = tqdm(total=tc.steps, initial=first, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    step = first
    if first < last:
        log("compiling the train step (the first step waits for it) ...")
    try:
        while step < last:
            b = train_data.batch(step, tc.batch_size)
            arrays = chunk_batch(b, tc.grad_accum)
            ts = time.perf_counter()
            state, metrics = step_fn(state, *arrays)
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            dt = time.perf_counter() - ts
            step += 1
            n_tok = int(b.valid.sum())
            tokens_seen += n_tok
            hist.append(m["loss"])
            if on_step is not None:
                on_step(step, m)
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{n_tok / dt:.0f}")
                bar.update(1)
            if step % tc.log_every == 0 or step == last:
                log(f"step {step} " + " ".join(f"{k} {v:.4f}" for k, v in m.items())
                    + f" tok/s {n_tok / dt:.0f} elapsed {time.perf_counter() - t0:.0f}s")
            if (step % tc.eval_every == 0 or step == tc.steps) and (eval_at_end or step < last):
                run_eval(step)
            if mngr is not None and (step % tc.ckpt_every == 0 or step == last):
                _save(mngr, state, {**meta_base, **totals(), "data_position": step})
    except KeyboardInterrupt:
        # The interrupt may land after a step ran but before `step` counted it: trust the state's own step.
        if mngr is not None and not any(x.is_deleted() for x in jax.tree.leaves(state)):
            at = int(state.step)
            log(f"interrupted: saving a checkpoint at step {at} before exiting")
            _save(mngr, state, {**meta_base, **totals(), "data_position": at})
            mngr.wait_until_finished()
        raise
    finally:
        if bar is not None:
            bar.close()
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    wall = time.perf_counter() - t0
    return TrainResult(state, hist, first, evals, tokens_seen, wall, prev_tokens + tokens_seen, prev_wall + wall)
