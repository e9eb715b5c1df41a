"""Native Orbax checkpoints: round trips, resharding between meshes, atomic writes, clear errors."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from clover_jax import checkpoint
from clover_jax.config import get_config
from clover_jax.model import params
from clover_jax.model.params import weight_shardings


def _mesh(devices, n_expert: int, n_tensor: int = 1) -> Mesh:
    devs = np.array(devices[: n_expert * n_tensor]).reshape(1, n_expert, n_tensor)
    return Mesh(devs, ("data", "expert", "tensor"))


def random_weights(cfg, seed: int, shardings=None) -> params.Weights:
    """Random weights from numpy, placed with device_put: no jit compile, so tests stay fast."""
    rng = np.random.default_rng(seed)
    specs = params.abstract(cfg)
    shards = jax.tree.leaves(shardings) if shardings is not None else None
    leaves = []
    for i, s in enumerate(jax.tree.leaves(specs, is_leaf=params.is_spec)):
        a = rng.standard_normal(s.shape, np.float32).astype(s.dtype)
        leaves.append(jax.device_put(a, shards[i]) if shards else jax.device_put(a))
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=params.is_spec), leaves)


def _assert_equal(a: params.Weights, b: params.Weights) -> None:
    fa, fb = checkpoint.flatten_weights(a), checkpoint.flatten_weights(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name].dtype == fb[name].dtype, name
        np.testing.assert_array_equal(np.asarray(fa[name]), np.asarray(fb[name]), err_msg=name)


@pytest.mark.parametrize("preset", ["test-llada2", "test-clover"])
def test_round_trip_single_device(tmp_path, preset):
    cfg = get_config(preset, dtype="bfloat16")
    w = random_weights(cfg, 0)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"x": 1}')
    out = checkpoint.save_model(str(tmp_path / "ckpt"), cfg, w, tokenizer_dir=str(tok), extra_files={"NOTE.txt": "hi"})
    assert sorted(os.listdir(out)) == ["NOTE.txt", "config.json", "tokenizer.json", "weights"]
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == cfg.to_dict()
    cfg2, w2 = checkpoint.load_model(out)
    assert cfg2 == cfg
    _assert_equal(w, w2)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    # Storage chunks hold one layer of a stacked weight, so reading a layer decodes only that layer.
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(os.path.join(out, "weights")).item_metadata.tree
    gate = meta["moe_layers.mlp.gate"]
    assert gate.storage.chunk_shape == (1, *gate.shape[1:])


@pytest.mark.parametrize(("save_n", "load_n"), [(8, 1), (8, 4), (1, 8), (4, 8)])
def test_reshard_between_meshes(tmp_path, devices, save_n, load_n):
    cfg = get_config("test-llada2")  # 16 experts: divisible by 1, 4 and 8
    save_mesh = _mesh(devices, save_n) if save_n > 1 else None
    w = random_weights(cfg, 1, weight_shardings(cfg, save_mesh) if save_mesh else None)
    if save_mesh:
        assert len(w.moe_layers.mlp.gate.sharding.device_set) == save_n
    checkpoint.save_model(str(tmp_path / "c"), cfg, w)
    load_mesh = _mesh(devices, load_n)
    shardings = weight_shardings(cfg, load_mesh)
    _, w2 = checkpoint.load_model(str(tmp_path / "c"), shardings)
    gate = w2.moe_layers.mlp.gate
    assert gate.sharding == shardings.moe_layers.mlp.gate
    # Each device holds only its slice of the experts.
    assert gate.addressable_shards[0].data.shape[1] == cfg.n_experts // load_n
    _assert_equal(w, w2)


def test_existing_destination_needs_force(tmp_path):
    cfg = get_config("test-qwen3-moe")
    w = random_weights(cfg, 0)
    dest = tmp_path / "c"
    checkpoint.save_model(str(dest), cfg, w)
    with pytest.raises(checkpoint.CheckpointError, match="already exists"):
        checkpoint.save_model(str(dest), cfg, w)
    w2 = random_weights(cfg, 5)
    checkpoint.save_model(str(dest), cfg, w2, force=True)
    _assert_equal(checkpoint.load_model(str(dest))[1], w2)
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_failed_save_leaves_nothing(tmp_path):
    cfg = get_config("test-qwen3-moe")
    w = random_weights(cfg, 0)
    bad = w.replace(embed=w.embed[:10])
    with pytest.raises(checkpoint.CheckpointError, match=r"'embed' has shape \(10, 64\).*needs \(256, 64\)"):
        checkpoint.save_model(str(tmp_path / "c"), cfg, bad)
    assert os.listdir(tmp_path) == []


def test_load_errors(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=r"no config\.json"):
        checkpoint.load_model(str(tmp_path / "empty"))
    cfg = get_config("test-qwen3-moe")
    checkpoint.save_model(str(tmp_path / "c"), cfg, random_weights(cfg, 0))
    # A config that disagrees with the stored tensors names the weight and both shapes.
    cfg_json = tmp_path / "c" / "config.json"
    cfg_json.write_text(cfg.replace(d_model=32).to_json())
    with pytest.raises(checkpoint.CheckpointError, match=r"'embed' has shape \(256, 64\).*needs \(256, 32\)"):
        checkpoint.load_model(str(tmp_path / "c"))
    cfg_json.write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="not a valid config"):
        checkpoint.load_model(str(tmp_path / "c"))


def test_streaming_save_and_slice_reader(tmp_path, devices):
    cfg = get_config("test-llada2", dtype="bfloat16")
    w = random_weights(cfg, 3)
    flat = {n: np.asarray(a) for n, a in checkpoint.flatten_weights(w).items()}
    reads = []

    def lazy(name, a):
        stacked = "layers." in name
        if not stacked:
            return checkpoint.LazyLeaf(a.shape, a.dtype, lambda idx: a[idx], chunk=(100, *a.shape[1:]))
        chunk = (1, 5, *a.shape[2:]) if name == "moe_layers.mlp.gate" else (1, *a.shape[1:])  # 16 experts: 5+5+5+1
        return checkpoint.LazyLeaf(a.shape, a.dtype, lambda idx: (reads.append((name, idx[0].start)), a[idx])[1], chunk)

    checkpoint.save_streaming(str(tmp_path / "s"), cfg, {n: lazy(n, a) for n, a in flat.items()})
    # Stacked weights were produced one layer at a time.
    assert ("moe_layers.mlp.gate", 1) in reads and ("moe_layers.mlp.gate", 0) in reads
    _, w2 = checkpoint.load_model(str(tmp_path / "s"), weight_shardings(cfg, _mesh(devices, 4)))
    _assert_equal(w, w2)
    # The slice reader works on streamed checkpoints and on ones saved from 8 devices.
    r = checkpoint.WeightReader(str(tmp_path / "s"))
    np.testing.assert_array_equal(r.read("moe_layers.mlp.down", 1), flat["moe_layers.mlp.down"][1])
    checkpoint.save_model(str(tmp_path / "m"), cfg, w2)
    r = checkpoint.WeightReader(str(tmp_path / "m"))
    got = r.read("moe_layers.attn.q", 0)
    assert got.dtype == flat["moe_layers.attn.q"].dtype
    np.testing.assert_array_equal(got, flat["moe_layers.attn.q"][0])
    np.testing.assert_array_equal(r.read("embed"), flat["embed"])
