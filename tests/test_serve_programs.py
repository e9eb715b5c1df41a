"""`clover plan --serve` compiles what `clover serve` runs: the programs `Engine.warm_up` compiles from the concrete
weights and state are, executable for executable, the ones `plan.programs.serve_programs` builds from abstract ones
(same optimized HLO, same input and output shardings), on a mesh that splits the hybrid model's Gated DeltaNet state
by heads; and the cache of a pass `plan.aot` compiles is placed as the serving state's is."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from clover_jax.config import get_config
from clover_jax.mesh.rules import DEFAULT_RULES, MeshRules
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
    eng = Engine(weights, CFG, block_length=8, max_prompt=8, max_tokens=8, batch_sizes=(2,), mesh=mesh)
    eng.warm_up()
    return eng, shardings


def _spec(sharding) -> tuple:
    return (tuple(sharding.spec) + (None,) * 4)[:4]


def _hlo(exe) -> str:
    """A compiled program's HLO without its source locations (where in Python it was traced from)."""
    text = exe.as_text().split("\n\nFileNames")[0]
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def test_plan_compiles_the_programs_serve_runs(engine):
    eng, shardings = engine
    planned = serve_programs(eng, params.shape_structs(CFG, shardings))  # what `clover plan --serve` compiles
    served = {("block", 2): eng._advance[2], ("prefill", 8, 1): eng.admission._prefill[8, 1],
              ("prefill", 8, 2): eng.admission._prefill[8, 2],
              ("move", 0): eng._move}  # warm_up's
    assert set(planned) == set(served)
    for key, exe in served.items():
        fn, args = planned[key]
        ours = fn.lower(*args).compile()
        assert _hlo(ours) == _hlo(exe), f"{key}: plan and serve compile different programs"
        assert ours.input_shardings == exe.input_shardings and ours.output_shardings == exe.output_shardings, key


def test_the_cache_is_placed_by_heads_everywhere(engine, mesh):
    """The serving state's and the plan's passes' placement of a hybrid cache: K/V split by KV head, the Gated
    DeltaNet state by value head, its conv tail by key-head group, rows over the data axis."""
    eng, _ = engine
    *_, planned, _ = abstract_inputs(CFG, PassShape("refine", 2, 8, 32, 8, True), mesh.mesh, mesh.rules)
    for cache in (eng._state.cache, planned):
        assert _spec(cache.linear.recurrent.sharding) == (None, "data", "tensor", None)
        assert _spec(cache.linear.conv_tail.sharding) == (None, "data", None, "tensor")
        assert _spec(cache.moe_k.sharding) == (None, "data", None, "tensor")
