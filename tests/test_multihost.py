"""Multi-host for real: 2 processes x 4 CPU devices (jax.distributed on loopback, gloo collectives)
run a sharded generate, a sharded forward and an Orbax save/restore, and match one process."""

import os
import sys

import jax
import numpy as np

from tests.processes import Processes, free_port

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
TIMEOUT_S = 240


def _single_process_reference():
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        import multihost_worker
    finally:
        sys.path.pop(0)
    from clover_jax import model
    from clover_jax.model import params
    from clover_jax.sampler import generate

    cfg, arrays, tokens, sc = multihost_worker.reference_inputs()
    specs = params.abstract(cfg)
    weights = jax.tree.unflatten(jax.tree.structure(specs, is_leaf=params.is_spec), [jax.device_put(a) for a in arrays])
    res = generate(weights, cfg, multihost_worker.PROMPTS, sc, dispatch="tiled")
    logits = model.apply(weights, cfg, jax.numpy.asarray(tokens), dispatch="dense")
    return np.asarray(res.raw), res.stats.nfe, np.asarray(logits)


def test_two_processes_match_one(tmp_path):
    port = free_port()
    env = dict(os.environ)  # the worker replaces the device count of XLA_FLAGS and keeps the rest
    workers = Processes([[sys.executable, WORKER, str(i), str(port), str(tmp_path)] for i in range(2)], [env] * 2,
                        tmp_path, "worker")
    # The reference runs here while the workers start up (this process has 8 fake devices).
    ref_raw, ref_nfe, ref_logits = _single_process_reference()
    codes, tails = workers.wait(TIMEOUT_S)
    assert codes is not None, f"multi-host workers did not finish within {TIMEOUT_S} s\n" + tails
    assert codes == [0, 0], f"multi-host workers failed with exit codes {codes}\n" + tails

    got = np.load(tmp_path / "result.npz")
    assert int(got["restore_mismatches"]) == 0, "Orbax restore into the cpu-8 layout changed some weights"
    np.testing.assert_allclose(got["logits"], ref_logits, atol=1e-5, rtol=1e-5,
                               err_msg="2-process sharded forward (ep_a2a) differs from one process")
    assert len(set(ref_raw.reshape(-1).tolist())) > 2  # the model says something
    np.testing.assert_array_equal(got["raw"], ref_raw, err_msg="2-process sharded generate differs from one process")
    assert int(got["nfe"]) == ref_nfe
