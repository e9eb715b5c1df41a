"""The wheel built from the repository works outside the checkout: it carries the presets, the mesh
layouts and the shipped clover-tiny model, and `clover generate` runs from another directory."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _source_copy(dst: Path) -> Path:
    """The files git would ship (tracked, or untracked and not ignored), links kept as links: a build
    there sees no stale build/ folder and none of a user's own checkpoints."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                             capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listing):
        src, out = REPO / name, dst / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)
    return dst


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel, built with pip from a copy of the source and unpacked with `pip install --target`
    (dependencies come from this environment): a directory whose clover_jax is the wheel's copy."""
    work = tmp_path_factory.mktemp("wheel")
    source = _source_copy(work / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(source)],
                   check=True, cwd=work, capture_output=True)
    (wheel,) = (work / "dist").glob("clover_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "clover_jax/_shipped/sharding/cpu-8.toml" in names
    assert "clover_jax/_shipped/clover-tiny/config.json" in names
    assert any(n.startswith("clover_jax/_shipped/clover-tiny/weights/") for n in names)
    assert "clover_jax/kernels/grouped_swiglu.cc" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "sharding/", "checkpoints/")) for n in names)
    target = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    return target


def _run(target: Path, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run([str(target / "bin" / "clover"), *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=600)


def test_wheel_imports_its_own_copy_with_its_data(installed, tmp_path):
    code = ("import json, clover_jax, clover_jax.shipped as s\n"
            "from clover_jax.mesh import layout_names\n"
            "from clover_jax.config import preset_names\n"
            "tools = clover_jax.load_model(str(s.TOOLS_MODEL_DIR))[0].name\n"
            "print(json.dumps([clover_jax.__file__, str(s.MODEL_DIR), layout_names(), preset_names(), tools,\n"
            "                  str(s.TOOLS_MODEL_DIR)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(installed), "JAX_PLATFORMS": "cpu"})
    module, model_dir, layouts, presets, tools, tools_dir = json.loads(out.stdout)
    assert module.startswith(str(installed)) and model_dir.startswith(str(installed))
    assert tools == "clover-tiny-tools" and tools_dir.startswith(str(installed))  # the second shipped model loads
    assert {"cpu-8", "tpu-v5e-8", "gpu-8xh100"} <= set(layouts)
    assert {"clover-35b-a3b", "clover-tiny"} <= set(presets)


GENERATE = ["generate", "ROMEO:", "--gen-length", "32"]  # greedy (temperature 0 by default): one answer


@pytest.fixture(scope="module")
def one_device(installed, tmp_path_factory) -> subprocess.CompletedProcess:
    """`clover generate` of the wheel on one device, from a directory outside the checkout."""
    return _run(installed, GENERATE, tmp_path_factory.mktemp("elsewhere"))


def test_clover_generate_runs_from_another_directory(one_device):
    res = one_device
    assert res.returncode == 0, res.stderr
    assert "RANDOM weights" not in res.stderr  # the shipped, trained model, not the preset
    assert res.stdout.strip() and "forward passes" in res.stderr


def test_clover_generate_on_a_shipped_mesh_layout(installed, one_device, tmp_path):
    res = _run(installed, [*GENERATE, "--mesh", "cpu-8"], tmp_path,
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert res.returncode == 0, res.stderr
    assert "forward passes" in res.stderr
    # sharded over the 8 devices of the shipped layout, the greedy text is the one-device run's
    assert one_device.returncode == 0, one_device.stderr
    assert res.stdout.strip() and res.stdout == one_device.stdout
