"""Every notebook in notebooks/ runs top to bottom on the CPU (as CI and a Colab CPU runtime would)."""

import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the notebooks extra (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="needs the notebooks extra (nbformat, nbclient, ipykernel)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
    # The kernel is a fresh process: one CPU device, no fake-device flags from conftest.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "forward passes" in text and "tok/pass" in text, text[-2000:]
