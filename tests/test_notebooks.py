"""The four notebooks of notebooks/ run top to bottom on the CPU, as CI and a Colab CPU runtime would, show what
they promise (their pictures, their checked claims), and are committed without outputs.

Each notebook checks its own claims with `assert` cells (sharded tokens equal the single-device ones, a
conversion round trip is bit-exact, the loss fell, ...): an assertion that fails is an error, and an error
fails the test. The lines below are what each one must print, and how many pictures it must draw.
"""

import glob
import os
from dataclasses import dataclass

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the notebooks extra (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="needs the notebooks extra (nbformat, nbclient, ipykernel)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")


@dataclass(frozen=True)
class Promise:
    """What a notebook's run must show: lines of printed text (substrings) and at least `pictures` images."""

    text: tuple[str, ...]
    pictures: int


PROMISES = {
    "01_quickstart.ipynb": Promise(("runtime: cpu", "forward passes", "tokens/pass"), pictures=2),
    "02_sharded_inference.ipynb": Promise(
        ("runtime: cpu", "8 devices", "sharded tokens equal the single-device tokens"), pictures=2),
    "03_convert_checkpoints.ipynb": Promise(("runtime: cpu", "max |logit difference|", "round trip: bit-exact"),
                                            pictures=1),
    "04_finetune.ipynb": Promise(("runtime: cpu", "before fine-tuning", "after fine-tuning", "reloaded"), pictures=1),
    "05_agent_loop.ipynb": Promise(("runtime: cpu", "finish_reason 'tool_calls'", "tool call: square",
                                    "answered through the tools", "server stopped"), pictures=1),
}


def _paths() -> list[str]:
    return sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))


def test_the_notebooks_are_the_promised_ones():
    assert sorted(os.path.basename(p) for p in _paths()) == sorted(PROMISES)


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_committed_without_outputs(name):
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code"
    dirty = [i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count") is not None]
    assert not dirty, f"{name}: code cells {dirty} carry outputs or execution counts (strip them before committing)"


def _kernel_env() -> dict[str, str]:
    """The test process's environment without the 8-fake-device flag: a kernel is a fresh process with the
    runtime's own devices (02_sharded_inference asks for 8 CPU devices itself, as it would in Colab)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_notebook_runs_and_shows_what_it_promises(name, monkeypatch):
    for key, value in _kernel_env().items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOK_DIR}})
    client.execute()  # raises CellExecutionError (with the traceback) on the first failing cell
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    text += "".join(o.get("data", {}).get("text/plain", "") for o in outputs
                    if o.get("output_type") in ("execute_result", "display_data"))
    missing = [line for line in PROMISES[name].text if line not in text]
    assert not missing, f"{name} did not print {missing}; its output ends with:\n{text[-3000:]}"
    pictures = sum("image/png" in o.get("data", {}) for o in outputs)
    assert pictures >= PROMISES[name].pictures, f"{name} drew {pictures} pictures, promised {PROMISES[name].pictures}"
