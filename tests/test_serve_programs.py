"""`clover plan --serve` compiles what `clover serve` runs: the engine's programs lowered from the concrete weights
and state `Engine.warm_up` compiles are the very programs `plan.programs.serve_programs` lowers from abstract
ones (same HLO, same input and output shardings), on a mesh that splits the hybrid model's Gated DeltaNet state
by heads; and single passes planned by `plan.aot` place the cache where the sampler and the server do."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from clover_jax.config import get_config
from clover_jax.mesh.rules import DEFAULT_RULES, MeshRules
from clover_jax.model import cache as kv_cache
from clover_jax.model import params
from clover_jax.plan.aot import abstract_inputs
from clover_jax.plan.arithmetic import PassShape
from clover_jax.plan.programs import serve_programs
from clover_jax.serving.engine import Engine

CFG = get_config("test-clover-hybrid")  # 2 key / 4 value Gated DeltaNet heads, 2 KV heads, 8 experts


@pytest.fixture(scope="module")
def mesh(devices):
    return MeshRules(Mesh(np.array(devices).reshape(2, 2, 2), ("data", "expert", "tensor")), DEFAULT_RULES)


@pytest.fixture(scope="module")
def engine(mesh):
    shardings = params.weight_shardings(CFG, mesh.mesh, mesh.rules)
    weights = params.init(CFG, jax.random.key(0), shardings)
    return Engine(weights, CFG, block_length=8, max_prompt=8, max_tokens=8, batch_sizes=(2,), mesh=mesh), shardings


def test_plan_lowers_the_programs_serve_compiles(engine):
    eng, shardings = engine
    served = eng.programs(eng.weights, eng._empty_state())  # what warm_up compiles
    planned = serve_programs(eng, params.shape_structs(CFG, shardings))  # what `clover plan --serve` compiles
    assert set(served) == set(planned) == {("block", 2), ("prefill", 8), ("move", 0)}
    for key in served:
        a = served[key][0].lower(*served[key][1])
        b = planned[key][0].lower(*planned[key][1])
        assert a.as_text() == b.as_text(), f"{key}: plan and serve lower different programs"
    block = served["block", 2][0].lower(*served["block", 2][1]).compile()
    planned_block = planned["block", 2][0].lower(*planned["block", 2][1]).compile()
    assert block.input_shardings == planned_block.input_shardings
    assert block.output_shardings == planned_block.output_shardings


def test_the_cache_is_placed_by_heads_everywhere(engine, mesh):
    """The serving state's, the plan's passes' and `model.cache`'s placement of a hybrid cache agree: K/V by KV
    head, the Gated DeltaNet state by value head, its conv tail by key-head group, rows over the data axis."""
    eng, _ = engine
    state = eng._empty_state()
    linear = state.cache.linear
    assert tuple(linear.recurrent.sharding.spec)[:3] == (None, "data", "tensor")
    assert tuple(linear.conv_tail.sharding.spec) == (None, "data", None, "tensor")
    assert tuple(state.cache.moe_k.sharding.spec)[:4] == (None, "data", None, "tensor")
    *_, planned, _ = abstract_inputs(CFG, PassShape("refine", 2, 8, 32, 8, True), mesh.mesh, mesh.rules)
    want = kv_cache.shardings(planned, mesh)
    got = jax.tree.map(lambda x: x.sharding, planned)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
    assert tuple(planned.linear.recurrent.sharding.spec)[:3] == (None, "data", "tensor")
