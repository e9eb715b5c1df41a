"""Mesh layouts (sharding/*.toml), logical-axis rules, and weights created straight into shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from clover_jax.config import get_config
from clover_jax.errors import ShardingError
from clover_jax.mesh import layouts
from clover_jax.mesh.rules import MeshRules, ShardingRules, constrain, logical_to_spec
from clover_jax.model import params
from clover_jax.plan import CHIPS, weight_bytes_per_chip

REQUIRED = ["cpu-1", "cpu-4", "cpu-8", "tpu-v5e-8", "tpu-v5e-16", "tpu-v5p-8", "tpu-v5p-64", "gpu-1xh200",
            "gpu-8xh100"]


def _write(tmp_path, text, name="bad"):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def test_shipped_layouts_load_and_shard_clover_35b():
    names = layouts.layout_names()
    assert set(REQUIRED) <= set(names)
    cfg = get_config("clover-35b-a3b")
    for name in names:
        lay = layouts.load_layout(name)
        assert set(lay.axes) <= set(layouts.MESH_AXES) and lay.platform in layouts.PLATFORMS, name
        if lay.platform == "tpu":
            dims = [int(d) for d in lay.topology.split(":")[1].split("x")]
            assert int(np.prod(dims)) == lay.n_devices, name
        if lay.platform == "cpu":
            continue
        # Every accelerator layout divides the flagship model (no ShardingError), and, except the
        # deliberately small v5e-4, its weights fit the chip by arithmetic.
        mesh = AbstractMesh(lay.shape, lay.axes)
        shardings = params.weight_shardings(cfg, mesh, lay.rules)
        total, per_chip = weight_bytes_per_chip(cfg, shardings, dict(zip(lay.axes, lay.shape, strict=True)))
        assert total > 60e9 and per_chip * lay.n_devices >= total, name
        assert (per_chip < CHIPS[lay.chip].hbm_bytes) == (name != "tpu-v5e-4"), (name, per_chip)


def test_cpu_layout_meshes(devices):
    for name, shape in [("cpu-1", (1, 1, 1)), ("cpu-4", (1, 4, 1)), ("cpu-8", (2, 4, 1))]:
        mesh = layouts.mesh_from_arg(name).mesh
        assert tuple(mesh.shape.values()) == shape and mesh.axis_names == ("data", "expert", "tensor")
    assert layouts.mesh_from_arg(None) is None
    with pytest.raises(ShardingError, match=r"needs 8 devices .* 4 are available"):
        layouts.make_mesh(layouts.load_layout("cpu-8"), devices[:4])


@pytest.mark.parametrize(("text", "match"), [
    ('[mesh]\nshape = [2, 4]\naxes = ["data"]\n', "same length"),
    ('[mesh]\nshape = [2, 4]\naxes = ["data", "model"]\n', "unknown mesh axes"),
    ('[mesh]\nshape = [2, 0]\naxes = ["data", "expert"]\n', "positive integers"),
    ('[mesh]\nshape = [8]\naxes = ["expert"]\n[rules]\nexperts = "experts"\n', "unknown mesh axis 'experts'"),
    ('platform = "tpu"\ntopology = "v5e:2x2"\n[mesh]\nshape = [8]\naxes = ["expert"]\n', "does not hold the 8"),
    ('platform = "fpga"\n[mesh]\nshape = [8]\naxes = ["expert"]\n', "platform 'fpga'"),
])
def test_bad_layouts_are_named(tmp_path, text, match):
    with pytest.raises(ShardingError, match=match):
        layouts.load_layout(_write(tmp_path, text))


def test_unknown_layout_lists_known():
    with pytest.raises(ShardingError, match=r"unknown mesh layout 'nope'.*tpu-v5e-8"):
        layouts.load_layout("nope")


def test_rule_that_does_not_divide_names_weight_axis_and_sizes(devices):
    cfg = get_config("test-clover")  # 2 kv heads
    mesh = jax.sharding.Mesh(np.array(devices[:4]).reshape(1, 1, 4), ("data", "expert", "tensor"))
    with pytest.raises(ShardingError,
                       match=r"weight 'moe_layers\.attn\.k' dim 2 \(logical axis 'kv_heads', size 2\) is not "
                             r"divisible by mesh axis 'tensor' of size 4"):
        params.weight_shardings(cfg, mesh)


def test_cli_reports_the_rule_error_before_compiling(tmp_path, capsys):
    from clover_jax.cli import main

    path = _write(tmp_path, 'platform = "tpu"\nchip = "v5e"\ntopology = "v5e:2x2"\n'
                            '[mesh]\nshape = [1, 1, 4]\naxes = ["data", "expert", "tensor"]\n', "tp4")
    assert main(["plan", "--config", "test-clover", "--mesh", path]) == 2
    err = capsys.readouterr().err
    assert "clover plan: error: weight 'moe_layers.attn.k'" in err and "size 2" in err and "size 4" in err


def test_logical_to_spec():
    rules = ShardingRules(experts="expert", batch=("data", "expert"), vocab=None)
    mesh = AbstractMesh((2, 4, 1), ("data", "expert", "tensor"))
    assert logical_to_spec(("experts", "vocab", None), rules, mesh) == PartitionSpec("expert", None, None)
    # one mesh axis shards one dim at most; size-1 axes are dropped
    assert logical_to_spec(("experts", "batch"), rules, mesh) == PartitionSpec("expert", "data")
    assert logical_to_spec(("batch",), ShardingRules(batch=("tensor", "data")), mesh) == PartitionSpec("data")


def test_rules_table_refuses_a_misspelt_logical_axis(tmp_path):
    with pytest.raises(TypeError):
        ShardingRules(expert="expert")  # the logical axis is `experts`
    with pytest.raises(ShardingError, match=r"unknown logical axes \['expert'\]"):
        ShardingRules.from_mapping({"expert": "expert"})
    bad = _write(tmp_path, '[mesh]\nshape = [8]\naxes = ["expert"]\n[rules]\nexpert = "expert"\n', "typo")
    with pytest.raises(ShardingError, match=r"\[rules\]: unknown logical axes \['expert'\]"):
        layouts.load_layout(bad)
    assert layouts.load_layout("cpu-8").rules.experts == "expert"


def test_weights_created_straight_into_shardings(devices):
    cfg = get_config("test-clover")
    mesh_rules = layouts.mesh_from_arg("cpu-8")
    mesh = mesh_rules.mesh
    shardings = params.weight_shardings(cfg, mesh, mesh_rules.rules)
    w = params.init(cfg, jax.random.key(0), shardings)
    gate = w.moe_layers.mlp.gate  # [layers, experts 8, embed, expert_mlp]
    assert gate.sharding == NamedSharding(mesh, PartitionSpec(None, "expert", None, None))
    shapes = {s.data.shape for s in gate.addressable_shards}
    assert shapes == {(cfg.n_moe_layers, cfg.n_experts // 4, cfg.d_model, cfg.expert_mlp_dim)}
    wanted = dict(params.named_leaves(shardings))
    one = dict(params.named_leaves(params.init(cfg, jax.random.key(0))))
    for name, leaf in params.named_leaves(w):
        assert leaf.sharding == wanted[name], name
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(one[name]), err_msg=name)  # same values, any layout


def test_constrain_is_a_no_op_without_a_mesh_and_shards_on_one(devices):
    x = jnp.ones((4, 8, 16))
    assert constrain(x, ("batch", "seq", "embed"), None) is x
    mesh = layouts.mesh_from_arg("cpu-8")
    assert isinstance(mesh, MeshRules) and hash(mesh) == hash(layouts.load_layout("cpu-8").mesh_rules())
    y = jax.jit(lambda x: constrain(x * 2, ("batch", "seq", "embed"), mesh))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh.mesh, PartitionSpec("data", None, None)), 3)
    np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((4, 8, 16)))


def test_gated_deltanet_splits_by_heads_where_the_layout_has_a_tensor_axis():
    """Clover-35B's Gated DeltaNet (16 key / 32 value heads) over `tensor` on the v5e layouts: every weight of the
    mixer by heads, the output projection by its input heads; on layouts whose tensor axis is 1, replicated."""
    cfg = get_config("clover-35b-a3b")
    for name, split in [("tpu-v5e-8", True), ("tpu-v5e-16", True), ("tpu-v5p-8", False), ("gpu-8xh100", False)]:
        lay = layouts.load_layout(name)
        attn = params.weight_shardings(cfg, AbstractMesh(lay.shape, lay.axes), lay.rules).linear_layers.attn
        t = "tensor" if split else None
        assert attn.conv.spec == attn.conv_right.spec == PartitionSpec(None, None, t, None), name
        assert attn.qkv.spec == PartitionSpec(None, None, t), name  # [layers, embed, C]: C grouped by key head
        assert attn.z.spec == PartitionSpec(None, None, t, None) and attn.out.spec == PartitionSpec(None, t, None, None)
        assert attn.a.spec == attn.b.spec == PartitionSpec(None, None, t), name
        assert attn.a_log.spec == attn.bd_logit_scale.spec == PartitionSpec(None, t), name


def test_gated_deltanet_rule_that_does_not_divide_names_weight_axis_and_sizes():
    cfg = get_config("test-clover-hybrid")  # 2 key heads: qkv's 96 channels split 4 ways, but not its 2 groups
    mesh = AbstractMesh((1, 1, 4), ("data", "expert", "tensor"))
    with pytest.raises(ShardingError,
                       match=r"weight 'linear_layers\.attn\.conv' dim 2 \(logical axis 'linear_key_heads', size 2\) is "
                             r"not divisible by mesh axis 'tensor' of size 4"):
        params.weight_shardings(cfg, mesh, ShardingRules(q_heads=None, kv_heads=None))
