"""Damaged native checkpoints: `checkpoint.verify` names the file at fault in one line before Orbax
reads anything, and `clover generate` / `clover convert` say so in one line with exit code 2."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from clover_jax import checkpoint
from clover_jax.cli import main
from clover_jax.config import get_config
from clover_jax.model import params

DATA = r"weights/ocdbt\.process_0/d/[0-9a-f]+"
DAMAGED = "the checkpoint is damaged: re-create it"


def _random_weights(cfg) -> params.Weights:
    """Random weights from numpy (no jit compile)."""
    rng = np.random.default_rng(0)
    specs = params.abstract(cfg)
    leaves = [jax.device_put(rng.standard_normal(s.shape, np.float32).astype(s.dtype))
              for s in jax.tree.leaves(specs, is_leaf=params.is_spec)]
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=params.is_spec), leaves)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = get_config("test-clover")
    w = _random_weights(cfg)
    path = checkpoint.save_model(str(tmp_path_factory.mktemp("saved") / "ckpt"), cfg, w)
    return path, cfg, {n: np.asarray(a) for n, a in checkpoint.flatten_weights(w).items()}


def _copy(saved, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], dst)
    return dst


def _largest_data_file(path: str) -> str:
    wdir = os.path.join(path, "weights", "ocdbt.process_0", "d")
    return max((os.path.join(wdir, f) for f in os.listdir(wdir)), key=os.path.getsize)


def _remove_data(path: str) -> None:
    os.remove(_largest_data_file(path))


def _truncate_data(path: str) -> None:
    os.truncate(_largest_data_file(path), 1000)


def _remove(rel: str):
    return lambda path: os.remove(os.path.join(path, *rel.split("/")))


def _bad_config(path: str) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"name": "x",\n  oops}')


def _assert_cli_error(capsys, argv: list[str], pattern: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"clover {argv[0]}: error: "), err
    assert "Traceback" not in err
    assert re.search(pattern, lines[0]), lines[0]


DAMAGES = {
    # name: (damage, what load_model says, what convert says when it differs)
    "data file deleted": (_remove_data, DATA + r" is missing \(the manifest expects \d+ bytes\); " + DAMAGED, None),
    "data file truncated": (_truncate_data, DATA + r" is truncated: 1000 bytes, the manifest expects \d+; " + DAMAGED,
                            None),
    "_METADATA deleted": (_remove("weights/_METADATA"), r"the Orbax metadata file weights/_METADATA is missing; "
                          + DAMAGED, None),
    "manifest.ocdbt deleted": (_remove("weights/manifest.ocdbt"), r"the Orbax file weights/manifest\.ocdbt is missing",
                               None),
    "_CHECKPOINT_METADATA deleted": (_remove("weights/_CHECKPOINT_METADATA"),
                                     r"weights/_CHECKPOINT_METADATA is missing \(the manifest expects \d+ bytes\)",
                                     None),
    "config.json invalid": (_bad_config, r"ckpt/config\.json is not a valid config: invalid JSON at line 2 column 3 "
                            r"\(char 16\): Expecting property name",
                            # not native without a parsable config.json: convert reads it as a HF source
                            r"ckpt/config\.json is not valid JSON: Expecting property name"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damage_is_named_in_one_line(saved, tmp_path, capsys, damage):
    fn, pattern, convert_pattern = DAMAGES[damage]
    path = _copy(saved, tmp_path)
    fn(path)
    with pytest.raises(checkpoint.CheckpointError, match=pattern) as e:
        checkpoint.load_model(path)
    assert "\n" not in str(e.value)
    if damage != "config.json invalid":
        with pytest.raises(checkpoint.CheckpointError, match=pattern):
            checkpoint.WeightReader(path)
    _assert_cli_error(capsys, ["generate", "x", "--model", path], pattern)
    out = str(tmp_path / "hf")
    _assert_cli_error(capsys, ["convert", path, out, "--no-progress"], convert_pattern or pattern)
    assert not os.path.exists(out)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_undamaged_loads_and_manifest_lists_every_file(saved, tmp_path):
    path, cfg, flat = saved
    wdir = checkpoint.verify(path)
    assert wdir == os.path.join(path, "weights")
    with open(os.path.join(wdir, checkpoint.MANIFEST_FILE)) as f:
        manifest = json.load(f)
    on_disk = {os.path.relpath(os.path.join(r, n), wdir): os.path.getsize(os.path.join(r, n))
               for r, _, names in os.walk(wdir) for n in names if n != checkpoint.MANIFEST_FILE}
    assert manifest["files"] == on_disk
    assert manifest["total_bytes"] == sum(on_disk.values())
    assert {"_METADATA", "manifest.ocdbt"} <= set(on_disk)
    cfg2, w2 = checkpoint.load_model(path)
    assert cfg2 == cfg
    got = checkpoint.flatten_weights(w2)
    assert got.keys() == flat.keys()
    for name, a in flat.items():
        np.testing.assert_array_equal(np.asarray(got[name]), a, err_msg=name)
    # The streaming writer (HF import) records a manifest too.
    lazy = {n: checkpoint.LazyLeaf(a.shape, a.dtype, lambda idx, a=a: a[idx]) for n, a in flat.items()}
    s = checkpoint.save_streaming(str(tmp_path / "s"), cfg, lazy)
    assert os.path.isfile(os.path.join(s, "weights", checkpoint.MANIFEST_FILE))
    np.testing.assert_array_equal(checkpoint.WeightReader(s).read("embed"), flat["embed"])


def test_checkpoint_without_manifest(saved, tmp_path, capsys):
    """Checkpoints written before the manifest: undamaged ones load; empty files are named; other damage
    reaches Orbax, whose error becomes one line naming the directory and tensorstore's message."""
    flat = saved[2]
    old = _copy(saved, tmp_path)
    os.remove(os.path.join(old, "weights", checkpoint.MANIFEST_FILE))
    _, w2 = checkpoint.load_model(old)
    np.testing.assert_array_equal(np.asarray(w2.embed), flat["embed"])
    assert checkpoint.WeightReader(old).leaves.keys() == flat.keys()

    victim = _largest_data_file(old)
    size = os.path.getsize(victim)
    os.truncate(victim, 0)
    with pytest.raises(checkpoint.CheckpointError, match=DATA + r" is empty \(0 bytes\); " + DAMAGED):
        checkpoint.load_model(old)

    os.truncate(victim, 0)
    with open(victim, "wb") as f:
        f.write(b"\0" * (size // 2))
    # tensorstore's status code and detail depend on which chunk it decodes first (OUT_OF_RANGE "not valid",
    # FAILED_PRECONDITION "Unknown frame descriptor", ...): the one line names the checkpoint and the damage
    last_line = r"cannot read the weights of checkpoint .*ckpt: [A-Z_]+: Error reading .*may be damaged"
    with pytest.raises(checkpoint.CheckpointError, match=last_line) as e:
        checkpoint.load_model(old)
    assert "\n" not in str(e.value) and e.value.__cause__ is None
    out = str(tmp_path / "hf")
    _assert_cli_error(capsys, ["convert", old, out, "--no-progress"],
                      r"cannot read weight '[\w.]+' of checkpoint .*ckpt: \w+: Error reading")
    assert not os.path.exists(out)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_damaged_manifest_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    with open(os.path.join(path, "weights", checkpoint.MANIFEST_FILE), "w") as f:
        f.write("{")
    with pytest.raises(checkpoint.CheckpointError, match=r"weights manifest weights/clover_manifest\.json is damaged"):
        checkpoint.load_model(path)
