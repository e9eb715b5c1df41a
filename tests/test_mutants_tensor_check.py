"""`clover_jax.convert.tensor_check`: the judgement of a checkpoint's text-model tensors that `clover convert`
(refusing) and `clover convert --check` (reporting) share, on small hand-made key sets, without writing a
checkpoint. Written for the mutation run (`bash scripts/mutation.sh tensor_check`; docs/testing.md, "Mutation
score"): every count, line and dtype record below is what the user reads in the report or what an export restores."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from clover_jax.config import get_config
from clover_jax.convert.mapping import Group
from clover_jax.convert.tensor_check import FLOAT_DTYPES, Differences, pattern, tensor_problems

CFG = get_config("test-qwen3-5-moe", dtype="bfloat16")


@dataclass(frozen=True)
class Info:  # what tensor_problems reads of hf_io.TensorInfo
    shape: tuple[int, ...]
    dtype: str


def group(keys: list[str], shape: tuple[int, ...], kind: str = "matmul") -> Group:
    return Group(hf=tuple(keys), hf_shapes=tuple(shape for _ in keys), native=(), to_native=list, to_hf=list,
                 kind=kind)


L = "model.layers"
GROUPS = [
    group(["model.embed_tokens.weight"], (16, 8)),
    group([f"{L}.{i}.self_attn.q_proj.weight" for i in range(3)], (8, 8)),
    group([f"{L}.{i}.input_layernorm.weight" for i in range(3)], (8,), kind="float32"),
]


def tensors(**changes: Info | None) -> dict[str, Info]:
    """The tensors the groups describe, in bfloat16 (norms float32), with `changes` (key with '__' for '.'; None
    removes the key)."""
    out = {k: Info(s, "float32" if g.kind == "float32" else "bfloat16")
           for g in GROUPS for k, s in zip(g.hf, g.hf_shapes, strict=True)}
    for key, info in changes.items():
        key = key.replace("__", ".")
        if info is None:
            out.pop(key)
        else:
            out[key] = info
    return out


def test_pattern_stars_layer_and_expert_numbers():
    assert pattern("model.layers.12.mlp.experts.3.down_proj.weight") == "model.layers.*.mlp.experts.*.down_proj.weight"
    assert pattern("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert pattern("model.layers.0.self_attn.q_proj.weight") == "model.layers.*.self_attn.q_proj.weight"
    assert pattern("lm_head.weight2") == "lm_head.weight2"  # a number inside a name is not an index


def test_a_checkpoint_that_matches_has_no_differences():
    diff, dtypes = tensor_problems(CFG, GROUPS, tensors())
    assert diff == Differences() and len(diff) == 0 and not diff and diff.counts() == "" and diff.lines() == []
    assert dtypes == {"model.embed_tokens.weight": "bfloat16", f"{L}.*.self_attn.q_proj.weight": "bfloat16",
                      f"{L}.*.input_layernorm.weight": "float32"}


def test_vision_mtp_and_rotary_buffers_are_not_the_text_models():
    extra = {"model.visual.blocks.0.attn.qkv.weight": Info((4, 4), "bfloat16"),
             "visual.merger.weight": Info((4,), "float32"), "mtp.fc.weight": Info((8, 16), "bfloat16"),
             f"{L}.0.self_attn.rotary_emb.inv_freq": Info((4,), "float32")}
    diff, dtypes = tensor_problems(CFG, GROUPS, tensors() | extra)
    assert diff == Differences() and len(dtypes) == 3
    # a key that merely contains the buffer's name is a tensor like any other
    diff, _ = tensor_problems(CFG, GROUPS, tensors() | {"model.rotary_emb.inv_freq.bias": Info((4,), "float32")})
    assert diff.unexpected == ("model.rotary_emb.inv_freq.bias",)


def test_each_kind_of_difference_is_named_and_sorted():
    found = tensors(**{f"{L}__2__self_attn__q_proj__weight": None, "model__embed_tokens__weight": None,
                       f"{L}__0__self_attn__q_proj__weight": Info((8, 9), "bfloat16"),
                       f"{L}__1__self_attn__q_proj__weight": Info((8, 8), "float16"),
                       f"{L}__1__input_layernorm__weight": Info((8,), "int8"),
                       "model__norm__bias": Info((8,), "float32"), "lm_head__bias": Info((8,), "float32")})
    diff, _ = tensor_problems(CFG, GROUPS, found)
    assert diff.missing == ("model.embed_tokens.weight", f"{L}.2.self_attn.q_proj.weight")
    assert diff.unexpected == ("lm_head.bias", "model.norm.bias")
    assert diff.shapes == (f"{L}.0.self_attn.q_proj.weight is (8, 9), expected (8, 8)",)
    assert diff.dtypes == (f"{L}.1.input_layernorm.weight is int8, expected a float type",
                           f"{L}.1.self_attn.q_proj.weight is float16, the model is bfloat16")
    assert len(diff) == 7 and diff
    assert diff.counts() == "2 missing, 2 unexpected, 1 wrong shape, 2 wrong dtype"
    assert diff.lines() == [
        f"missing tensors: model.embed_tokens.weight, {L}.2.self_attn.q_proj.weight",
        "unexpected tensors: lm_head.bias, model.norm.bias",
        f"shapes that disagree with config.json: {L}.0.self_attn.q_proj.weight is (8, 9), expected (8, 8)",
        f"dtypes: {L}.1.input_layernorm.weight is int8, expected a float type, "
        f"{L}.1.self_attn.q_proj.weight is float16, the model is bfloat16"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_norms_may_be_any_float_type(dtype):
    found = tensors(**{f"{L}__{i}__input_layernorm__weight": Info((8,), dtype) for i in range(3)})
    diff, dtypes = tensor_problems(CFG, GROUPS, found)
    assert diff == Differences() and dtypes[f"{L}.*.input_layernorm.weight"] == dtype


def test_matmul_weights_must_be_the_models_dtype():
    found = tensors(model__embed_tokens__weight=Info((16, 8), "float32"))
    diff, _ = tensor_problems(CFG, GROUPS, found)
    assert diff.dtypes == ("model.embed_tokens.weight is float32, the model is bfloat16",)
    assert diff.counts() == "1 wrong dtype"
    # the model's dtype is the config's: the same tensors judged against a float32 config
    diff, _ = tensor_problems(get_config("test-qwen3-5-moe", dtype="float32"), GROUPS[:1],
                              {"model.embed_tokens.weight": found["model.embed_tokens.weight"]})
    assert diff == Differences()


def test_a_tensor_whose_dtype_differs_from_its_pattern_is_recorded_by_key():
    """What an export restores: the pattern's dtype for the layers that follow it, the exact key for the exception."""
    found = tensors(**{f"{L}__1__input_layernorm__weight": Info((8,), "bfloat16")})
    diff, dtypes = tensor_problems(CFG, GROUPS, found)
    assert diff == Differences()
    assert dtypes == {"model.embed_tokens.weight": "bfloat16", f"{L}.*.self_attn.q_proj.weight": "bfloat16",
                      f"{L}.*.input_layernorm.weight": "float32", f"{L}.1.input_layernorm.weight": "bfloat16"}


def test_the_report_lines_show_a_few_keys_and_how_many_more():
    missing = tuple(f"k{i:02d}" for i in range(9))
    shapes = tuple(f"s{i} is (1,), expected (2,)" for i in range(6))
    d = Differences(missing=missing, unexpected=("u1",), shapes=shapes, dtypes=("d1", "d2", "d3", "d4", "d5"))
    assert len(d) == 9 + 1 + 6 + 5
    assert d.counts() == "9 missing, 1 unexpected, 6 wrong shape, 5 wrong dtype"
    assert d.lines() == ["missing tensors: k00, k01, k02, k03, k04, k05 ... and 3 more",
                         "unexpected tensors: u1",
                         "shapes that disagree with config.json: s0 is (1,), expected (2,), s1 is (1,), expected "
                         "(2,), s2 is (1,), expected (2,), s3 is (1,), expected (2,) ... and 2 more",
                         "dtypes: d1, d2, d3, d4 ... and 1 more"]
    assert d.lines(2, 1) == ["missing tensors: k00, k01 ... and 7 more", "unexpected tensors: u1",
                             "shapes that disagree with config.json: s0 is (1,), expected (2,) ... and 5 more",
                             "dtypes: d1 ... and 4 more"]
    assert Differences(dtypes=("d1",)).lines() == ["dtypes: d1"] and Differences(dtypes=("d1",)).counts() == \
        "1 wrong dtype"
