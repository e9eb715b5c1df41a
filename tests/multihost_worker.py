"""One process of the 2-process x 4-CPU-device multi-host test (tests/test_multihost.py starts two).

    python tests/multihost_worker.py PROCESS_ID PORT OUT_DIR

Joins the job through `jax.distributed.initialize` on loopback with gloo CPU collectives, builds
the 8-device global mesh, creates the weights straight into their shardings (each process fills
only its own devices' shards), runs a sharded greedy generate and a sharded forward, saves the
weights with checkpoint.save_model from both processes (one atomically renamed directory) and
restores them with load_model into a different mesh layout. Process 0
writes what it saw to OUT_DIR/result.npz; the test compares it with the single-process run.
"""

import os
import sys

if __name__ == "__main__":  # only the worker process: the test imports this module for its inputs
    os.environ["JAX_PLATFORMS"] = "cpu"
    # 4 devices per process; the other flags are the test process's (its code generation level, which the
    # single-process reference is compiled with)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=4"])

import jax
import numpy as np

NUM_PROCESSES = 2
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def np_weight_arrays(cfg, seed: int, std: float) -> list[np.ndarray]:
    """The same random weights in every process (and in the single-process reference)."""
    from clover_jax.model import params

    rng = np.random.default_rng(seed)
    out = []
    for s in jax.tree.leaves(params.abstract(cfg), is_leaf=params.is_spec):
        a = rng.standard_normal(s.shape, np.float32) * std
        out.append((a + 1.0 if s.init == "ones" else a).astype(s.dtype))
    return out


def reference_inputs():
    """Config, weights (numpy), tokens for the forward check, sampler settings: shared with the test."""
    from clover_jax.config import get_config
    from clover_jax.sampler import SamplerConfig

    cfg = get_config("test-clover")
    rng = np.random.default_rng(1)
    tokens = rng.integers(2, cfg.vocab_size - 1, (4, 16)).astype(np.int32)
    sc = SamplerConfig(gen_length=16, block_length=8, steps=8, cache="prefix", eos_stop=False)
    return cfg, np_weight_arrays(cfg, 7, 0.3), tokens, sc


def main(process_id: int, port: int, out_dir: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    # The CLI's route into a multi-process job: `--mesh` + these variables make
    # layouts.mesh_from_arg call jax.distributed.initialize (gloo collectives for CPU layouts).
    os.environ.update(CLOVER_DISTRIBUTED="1", CLOVER_COORDINATOR=f"127.0.0.1:{port}",
                      CLOVER_NUM_PROCESSES=str(NUM_PROCESSES), CLOVER_PROCESS_ID=str(process_id),
                      CLOVER_DISTRIBUTED_TIMEOUT_S="60")
    # expert axis across both processes: every MoE layer's collectives cross the process boundary
    layout_path = os.path.join(out_dir, f"mh-8-{process_id}.toml")
    with open(layout_path, "w") as f:
        f.write('platform = "cpu"\n[mesh]\nshape = [1, 8, 1]\naxes = ["data", "expert", "tensor"]\n')

    from jax.experimental import multihost_utils

    from clover_jax import model
    from clover_jax.checkpoint import load_model, save_model
    from clover_jax.mesh import layouts
    from clover_jax.model import params
    from clover_jax.sampler import generate

    on = layouts.mesh_from_arg(layout_path)
    assert jax.process_count() == NUM_PROCESSES and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    cfg, arrays, tokens, sc = reference_inputs()
    shardings = params.weight_shardings(cfg, on.mesh, on.rules)
    specs = params.abstract(cfg)
    treedef = jax.tree.structure(specs, is_leaf=params.is_spec)
    weights = jax.tree.unflatten(treedef, [
        jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx])
        for a, sh in zip(arrays, jax.tree.leaves(shardings), strict=True)])

    from clover_jax.model.moe import expert_parallel

    with expert_parallel.capacity_factor(8.0):  # cf = n_ep: ep_a2a cannot drop
        res = generate(weights, cfg, PROMPTS, sc, dispatch="ep_gather", mesh=on)
        valid = np.ones(tokens.shape, bool)
        logits = jax.jit(lambda w, t, v: model.apply(w, cfg, t, v, dispatch="ep_a2a", mesh=on))(weights, tokens, valid)
    logits = multihost_utils.process_allgather(logits, tiled=True)

    # Native checkpoint: both processes save their shards into one (atomically renamed) directory,
    # then restore into another layout.
    ckpt = os.path.join(out_dir, "ckpt")
    save_model(ckpt, cfg, weights)
    lay2 = layouts.load_layout("cpu-8")  # data 2 x expert 4: a different sharding of the same weights
    mesh2 = layouts.make_mesh(lay2)
    target_shardings = params.weight_shardings(cfg, mesh2, lay2.rules)
    _, restored_weights = load_model(ckpt, target_shardings)
    restored = dict(params.named_leaves(restored_weights))
    target = {n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for (n, s), (_, sh) in
              zip(params.named_leaves(specs), params.named_leaves(target_shardings), strict=True)}
    mismatched = 0
    for (name, a) in zip([n for n, _ in params.named_leaves(specs)], arrays, strict=True):
        arr = restored[name]
        assert arr.sharding == target[name].sharding, name
        for shard in arr.addressable_shards:  # only this process's shards live here
            mismatched += int(not np.array_equal(np.asarray(shard.data), a[shard.index]))
    mismatched = int(multihost_utils.process_allgather(np.int32(mismatched)).sum())
    multihost_utils.sync_global_devices("done")
    if process_id == 0:
        np.savez(os.path.join(out_dir, "result.npz"), raw=np.asarray(res.raw), nfe=res.stats.nfe,
                 logits=np.asarray(logits), restore_mismatches=mismatched)
    print(f"process {process_id}: ok", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
