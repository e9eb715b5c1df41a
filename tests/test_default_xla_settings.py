"""The suite runs under settings users do not: tests/conftest.py sets `--xla_backend_optimization_level=0` in
XLA_FLAGS (LLVM's cheapest code generation: faster compiles) and `jax.config.update("jax_default_matmul_precision",
"highest")`. This module runs the shipped model once more in a subprocess WITHOUT them (XLA_FLAGS stripped of the
test flags, JAX's default matmul precision) and checks it against the same run under the test settings, in process:

- greedy generation (`clover generate "ROMEO:" --gen-length 32 --temperature 0 --remasking low_confidence`) gives
  the same text and the same number of forward passes;
- a forward's logits agree within LOGITS_ATOL.

JAX's default matmul precision is None ("DEFAULT": the backend's choice). On CPU, XLA computes float32 dots in full
float32 whatever the precision asks (it only selects bfloat16 passes on TPU or TF32 on GPU), so "highest" changes
nothing here: the subprocess checks that, its logits at "highest" equal its default ones bit for bit (the shipped
model is float32). What does differ is the code XLA generates at its default optimisation level: vectorised,
reassociated float32 sums (no fast-math: XLA:CPU keeps it off by default), so results move by float32 rounding only.

LOGITS_ATOL: measured 9.5e-6 at most on these 2 x 64 positions x 2048 logits (1.8e-5 on random tokens; the largest
|logit| is 14 to 16), i.e. about 1e-6 relative: float32 rounding through dots of 192 to 2048 terms over 4 layers.
5e-4 leaves a 25x margin over the worst measured and stays far below what a real change causes (a wrong mask, norm
or weight moves logits by 0.1 or more).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

LOGITS_ATOL = 5e-4
GENERATE = ["generate", "ROMEO:", "--gen-length", "32", "--temperature", "0", "--remasking", "low_confidence"]
TEST_FLAGS = ("--xla_backend_optimization_level", "--xla_force_host_platform_device_count")


def probe(model: str, out_dir: str, both_precisions: bool = False) -> dict:
    """Run the shipped model's greedy generation through the CLI and one forward pass; write probe.json (the
    settings in force, stdout, the stats line) and logits.npy (with `both_precisions`, logits_highest.npy too)."""
    import jax
    import jax.numpy as jnp

    from clover_jax import model as clover_model
    from clover_jax.checkpoint import load_model
    from clover_jax.cli import main
    from clover_jax.tokenizer import load_tokenizer

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*GENERATE, "--model", model])
    stats = [ln for ln in err.getvalue().splitlines() if "forward passes" in ln]
    cfg, weights = load_model(model)
    ids = load_tokenizer(model).encode("ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet "
                                       "is the sun. Arise, fair sun, and kill the envious moon")
    tokens = np.full((2, 64), cfg.mask_token_id, np.int32)
    tokens[0, :min(len(ids), 40)] = ids[:40]  # a prompt, then a masked block
    tokens[1, :] = (ids * 4)[:64]  # all text
    forward = jax.jit(lambda w, t: clover_model.apply(w, cfg, t))
    np.save(os.path.join(out_dir, "logits.npy"), np.asarray(forward(weights, jnp.asarray(tokens))))
    if both_precisions:
        with jax.default_matmul_precision("highest"):
            highest = jax.jit(lambda w, t: clover_model.apply(w, cfg, t))(weights, jnp.asarray(tokens))
        np.save(os.path.join(out_dir, "logits_highest.npy"), np.asarray(highest))
    found = {"exit": code, "stdout": out.getvalue(), "stats": stats, "stderr": err.getvalue(),
             "precision": jax.config.jax_default_matmul_precision, "xla_flags": os.environ.get("XLA_FLAGS", ""),
             "dtype": cfg.dtype}
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(found, f)
    return found


def default_env() -> dict[str, str]:
    """This process's environment without the test settings: XLA_FLAGS stripped of conftest's flags (dropped when
    nothing else is left), no JAX_DEFAULT_MATMUL_PRECISION (conftest sets the precision through jax.config, which a
    subprocess does not inherit)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_DEFAULT_MATMUL_PRECISION"}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(TEST_FLAGS)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A copy of the shipped model, so that both runs read the same files even if the checkout's copy is replaced."""
    from clover_jax import shipped

    if not (shipped.MODEL_DIR / "config.json").is_file():
        pytest.skip("the shipped model is not there")
    dst = tmp_path_factory.mktemp("default_xla") / "clover-tiny"
    shutil.copytree(shipped.MODEL_DIR, dst)
    return str(dst)


def test_default_xla_settings_give_the_test_settings_tokens_and_logits(model, tmp_path):
    import jax

    # the test settings are in force here (else this compares nothing)
    assert jax.config.jax_default_matmul_precision == "highest"
    assert "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    (tmp_path / "test").mkdir()
    (tmp_path / "default").mkdir()
    under_test = probe(model, str(tmp_path / "test"))
    run = subprocess.run([sys.executable, __file__, model, str(tmp_path / "default")], env=default_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    default = json.loads((tmp_path / "default" / "probe.json").read_text())
    assert default["precision"] is None and "optimization_level" not in default["xla_flags"]  # JAX's and XLA's own
    assert default["dtype"] == "float32"
    assert under_test["exit"] == default["exit"] == 0, (under_test["stderr"], default["stderr"])

    # greedy generation: the same text, in the same number of passes
    assert under_test["stdout"].strip() and default["stdout"] == under_test["stdout"]
    passes = [s.split(" tokens in ")[0] for s in (under_test["stats"][0], default["stats"][0])]
    assert passes[0] == passes[1], passes

    # a forward: default precision is full float32 on CPU (bit for bit what "highest" gives) ...
    d = np.load(tmp_path / "default" / "logits.npy")
    np.testing.assert_array_equal(d, np.load(tmp_path / "default" / "logits_highest.npy"))
    # ... and the default optimisation level moves the logits by float32 rounding only
    t = np.load(tmp_path / "test" / "logits.npy")
    assert d.shape == t.shape == (2, 64, d.shape[-1]) and np.isfinite(d).all()
    np.testing.assert_allclose(d, t, rtol=0, atol=LOGITS_ATOL)
    assert (d.argmax(-1) == t.argmax(-1)).mean() > 0.99


if __name__ == "__main__":  # the subprocess: default settings
    probe(sys.argv[1], sys.argv[2], both_precisions=True)
