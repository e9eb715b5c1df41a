"""The sampler's settings table (`clover_jax.sampler.settings`) and everything derived from it: one rule per setting
wherever a setting is typed (the Python config, `clover generate`'s flags, a `clover serve` request and its OpenAPI
schema, lm-eval's model_args, generation_config.json), each message naming the setting as it was typed there, and
the traced knobs of the compiled programs."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import numpy as np
import pytest

from clover_jax import cli
from clover_jax.config import get_config
from clover_jax.errors import SamplerError, UsageError
from clover_jax.evaluation.harness import EvaluationError, settings_from
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.sampler import settings as S
from clover_jax.serving.requests import BadRequest, Request
from clover_jax.serving.schema import sampler_fields

CFG = get_config("test-clover")


def _probes(s: S.Setting) -> list:
    """Values on and around a setting's rule: its bounds, just past them, its choices, wrong types."""
    if s.choices:
        return [*s.choices, "nope", 3]
    if s.kind is bool:
        return [True, False, 1, "yes"]
    out: list = [None, "1", True]
    for x in (s.minimum, s.maximum, s.off):
        if x is not None:
            out += [x, x - 1, x + 1] if s.kind is int else [x, x - 0.5, x + 0.5, x + 1e-9]
    return out + ([2.5] if s.kind is int else [float("inf"), float("nan")])


def test_the_config_is_the_table():
    fields = {f.name: f.default for f in dataclasses.fields(SamplerConfig)}
    assert list(S.SETTINGS) == list(fields)
    assert all(S.SETTINGS[k].default == v for k, v in fields.items())
    traced = [s.knob_as or s.name for s in S.SETTINGS.values() if s.knob is not None]
    assert list(S.Knobs._fields) == traced
    assert not any(S.SETTINGS[k].compiled for k in S.SETTINGS if k in S.Knobs._fields)
    assert {"gen_length", "block_length", "cache", "block_grid", "self_speculative", "causal"} == \
        {k for k, s in S.SETTINGS.items() if s.compiled}


@pytest.mark.parametrize("name", list(S.SETTINGS))
def test_every_rule_in_words_matches_the_rule(name):
    """What `rule()` says a value must be is what `accepts` lets through, at the bounds and past them."""
    s = S.SETTINGS[name]
    for v in _probes(s):
        ok = s.accepts(v)
        if ok:
            s.check(v)
        else:
            with pytest.raises(SamplerError, match=rf"^{name} must be .*, got ") as e:
                s.check(v)
            assert (e.value.setting, e.value.param) == (name, name)
    assert s.accepts(s.default)


@pytest.mark.parametrize("name", list(S.REQUEST_NAMES))
def test_the_openapi_schema_of_a_request_setting_is_its_rule(name):
    """The schema `clover serve` publishes for a per-request setting admits exactly what the rule admits (the
    server's block length and cache mode fixed in)."""
    s = S.SETTINGS[name]
    top, inner = sampler_fields(block_length=8, cache_modes=("auto", "prefix"))
    wire = S.REQUEST_NAMES[name]
    schema = inner[wire.removeprefix("diffusion.")] if wire.startswith("diffusion.") else top[wire]
    probes = [v for v in _probes(s) if not (isinstance(v, float) and not np.isfinite(v))]  # JSON has no NaN
    if name == "block_length":
        probes, rule = [8, 32, 7], (lambda v: v == 8)
    elif name == "cache":
        probes, rule = ["auto", "prefix", "none", "dual"], (lambda v: v in ("auto", "prefix"))
    elif name == "steps_per_block":
        probes, rule = [1, 8, 9, 0, None], (lambda v: v is None or 1 <= v <= 8)
    else:
        rule = s.accepts
    for v in probes:
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(json.dumps(v)))
        assert valid == (rule(v) or v is None), f"{wire}={v!r}: schema {valid}, rule {rule(v)}"


def test_one_message_names_the_setting_as_typed_there(capsys):
    bad = SamplerConfig(gen_length=64, top_k=-1)
    with pytest.raises(SamplerError, match=r"^top_k must be an integer in \[0, 2147483647\], got -1$"):
        S.check_settings(bad)
    with pytest.raises(SamplerError, match=r"^--top-k must be an integer in \[0, 2147483647\], got -1$"):
        S.check_settings(bad, S.FLAGS)
    req = Request((5, 6), 8, SamplerConfig(top_k=-1))
    with pytest.raises(BadRequest, match=r"^diffusion.top_k must be an integer in \[0, 2147483647\], got -1$") as e:
        req.check(8, "prefix", 100, 16, 16, S.REQUEST_NAMES)
    assert e.value.param == "diffusion.top_k"
    with pytest.raises(BadRequest, match=r"^diffusion.steps must be an integer in \[1, 8\], got 9$"):
        Request((5, 6), 8, SamplerConfig(steps_per_block=9)).check(8, "prefix", 100, 16, 16, S.REQUEST_NAMES)
    with pytest.raises(BadRequest, match=r"^max_tokens must be an integer in \[1, 16\], got 17$"):
        Request((5, 6), 17).check(8, "prefix", 100, 16, 16, S.REQUEST_NAMES)
    with pytest.raises(BadRequest, match="cfg_scale is not a per-request setting"):
        Request((5, 6), 8, SamplerConfig(cfg_scale=1.0)).check(8, "prefix", 100, 16, 16)
    with pytest.raises(EvaluationError, match=r"model_args: top_k must be an integer in \[0, 2147483647\], got -1"):
        settings_from({"top_k": "-1"})
    assert cli.main(["generate", "x", "--model", "test-clover", "--top-k", "-1"]) == 2
    assert "clover generate: error: --top-k must be an integer in [0, 2147483647], got -1" in capsys.readouterr().err


def test_every_setting_is_a_flag_and_a_model_argument():
    """`clover generate` has a flag for every setting and lm-eval a model argument; both land on the field."""
    parser = cli.build_parser()
    values = {"gen_length": 64, "block_length": 16, "steps": 8, "remasking": "margin", "threshold": 0.5,
              "entropy_bound": 0.25, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "cfg_scale": 1.5, "seed": 11,
              "cache": "dual", "block_grid": "absolute", "confidence": "sampling"}
    argv = ["generate", "x", "--no-eos-stop"]
    for k, v in values.items():
        argv += [S.FLAGS[k], str(v)]
    sc = S.from_flags(parser.parse_args(argv))
    assert sc == SamplerConfig(**values, eos_stop=False)
    assert S.from_flags(parser.parse_args(["generate", "x", "--steps-per-block", "4"])).steps_per_block == 4
    eval_args = {S.SETTINGS[k].model_arg: str(v) for k, v in values.items()} | {"eos_stop": "false"}
    assert set(S.MODEL_ARGS) == {s.model_arg for s in S.SETTINGS.values()}
    assert settings_from(eval_args).sampling == {**values, "eos_stop": False}


def test_generation_config_defaults_are_type_checked(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"max_new_tokens": 64, "temperature": 1, "eos_stop": False, "do_sample": True}))
    assert S.read_defaults(str(path), UsageError) == {"gen_length": 64, "temperature": 1.0, "eos_stop": False}
    path.write_text(json.dumps({"top_k": 2.5}))
    with pytest.raises(UsageError, match=r"generation_config.json: top_k must be an integer, got 2.5"):
        S.read_defaults(str(path), UsageError)


def test_steps_per_block_is_steps_over_the_blocks():
    """steps_per_block=k and steps=k x blocks are the same program knobs and the same tokens."""
    a = SamplerConfig(gen_length=32, block_length=8, steps=16, cache="none")
    b = SamplerConfig(gen_length=32, block_length=8, steps_per_block=4, cache="none")
    ka, kb = S.knobs(a, CFG), S.knobs(b, CFG)
    assert ka == kb and int(ka.steps_per_block) == 4 and a.total_steps == b.total_steps == 16
    with pytest.raises(SamplerError, match="give steps or steps_per_block, not both"):
        S.check_settings(a.replace(steps_per_block=4))


def test_knobs_have_fixed_dtypes_and_resolve_the_family_rules():
    k = S.knobs(SamplerConfig(seed=-1, remasking="entropy", top_k=3), CFG)
    assert [np.asarray(x).dtype for x in k] == [np.dtype(s.knob) for s in S.SETTINGS.values() if s.knob is not None]
    assert int(k.seed) == 2**32 - 1 and int(k.remasking) == 3 and int(k.top_k) == 3
    assert not bool(k.sampled_confidence)
    assert bool(S.knobs(SamplerConfig(), get_config("test-llada2")).sampled_confidence)  # LLaDA2's own rule


def test_traced_settings_never_recompile_and_compiled_ones_do():
    """A compiled program serves every value of every traced setting (`Knobs`); each compiled setting changes it."""
    from clover_jax.sampler import compile_count

    w = {"cond": None}

    class Uniform:
        def __call__(self, weights, tokens, *a, **k):
            import jax.numpy as jnp

            return jnp.zeros((tokens.shape[0], a[-1], CFG.vocab_size)).at[..., 7].set(1.0), None

    model = Uniform()  # one forward function: it is part of the compiled program's key
    base = SamplerConfig(gen_length=16, block_length=8, cache="none")
    generate(w, CFG, [[5, 6]], base, forward_fn=model)
    before = compile_count()
    for change in (dict(temperature=0.5), dict(top_k=3, temperature=0.5), dict(threshold=0.5), dict(seed=9),
                   dict(remasking="random"), dict(steps_per_block=2), dict(entropy_bound=1.0), dict(eos_stop=False),
                   dict(confidence="sampling")):
        generate(w, CFG, [[5, 6]], base.replace(**change), forward_fn=model)
    assert compile_count() == before
    generate(w, CFG, [[5, 6]], base.replace(block_length=16), forward_fn=model)
    assert compile_count() == before + 1


def test_model_args_as_lm_eval_hands_them_over():
    """lm-eval passes strings from the command line and ints / floats from Python; None or "None" for unset."""
    got = settings_from({"eos_stop": 1, "steps": 8, "temperature": 0, "cache": "none", "gen_length": None,
                         "block_length": "None", "threshold": "0.5"}).sampling
    assert got == {"eos_stop": True, "steps": 8, "temperature": 0, "cache": "none", "threshold": 0.5}
    with pytest.raises(EvaluationError, match="model_args: give steps or steps_per_block, not both"):
        from clover_jax.evaluation.harness import CloverLM

        CloverLM.sampler_config(type("LM", (), {"settings": settings_from({"steps": 8, "steps_per_block": 2})})(),
                                {"max_gen_toks": 32})


def test_a_flag_for_either_steps_replaces_both_stored_defaults():
    parser = cli.build_parser()
    stored = {"steps_per_block": 8, "temperature": 0.5}
    sc = S.from_flags(parser.parse_args(["generate", "x", "--steps", "64"]), stored)
    assert (sc.steps, sc.steps_per_block, sc.temperature) == (64, None, 0.5)
    sc = S.from_flags(parser.parse_args(["generate", "x", "--steps-per-block", "4"]), {"steps": 128})
    assert (sc.steps, sc.steps_per_block) == (None, 4)


def test_a_stored_setting_out_of_range_is_named_by_its_file(tmp_path, capsys):
    from clover_jax import checkpoint
    from clover_jax.model import params

    model = tmp_path / "m"
    checkpoint.save_model(str(model), CFG, params.init(CFG, __import__("jax").random.key(0)))
    (model / "generation_config.json").write_text(json.dumps({"threshold": 2}))
    assert cli.main(["generate", "x", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "error: --threshold must be a number in (0, 1] (or 0 = off), got 2.0; --threshold comes from " in err
    assert "generation_config.json when not given (a flag overrides it)" in err


def test_request_defaults_the_server_would_refuse_stop_it_at_start():
    from clover_jax.commands.serve import check_defaults
    from clover_jax.serving.http_request import request_defaults

    defaults = request_defaults({"steps_per_block": 32, "temperature": 0.5, "gen_length": 64, "seed": 3,
                                 "block_length": 32, "cache": "prefix"})
    assert defaults == {"steps_per_block": 32, "temperature": 0.5, "max_tokens": 64}
    engine = type("E", (), {"block_length": 16, "cache": "prefix", "max_tokens": 64,
                            "cfg": get_config("test-clover")})()
    with pytest.raises(UsageError, match=r"^g.json: steps_per_block must be an integer in \[1, 16\], got 32$"):
        check_defaults(defaults, engine, "g.json")
    check_defaults({"temperature": 0.5, "max_tokens": 64}, engine, "g.json")


def test_every_request_field_lands_on_its_setting():
    """Each request field of the table reaches the SamplerConfig field it names (through the HTTP parser)."""
    from clover_jax.serving.http_request import parse_job

    engine = type("E", (), {"block_length": 16, "cache": "prefix", "max_tokens": 64, "max_prompt": 64,
                            "cfg": get_config("test-clover")})()
    values = {"block_length": 16, "steps_per_block": 3, "remasking": "margin", "threshold": 0.25, "temperature": 0.5,
              "top_p": 0.75, "top_k": 7, "seed": 12, "cache": "prefix", "presence_penalty": 0.5,
              "frequency_penalty": -0.25, "repetition_penalty": 1.5}
    assert set(values) | {"self_speculative", "causal"} == set(S.REQUEST_NAMES)  # those greedy, below
    body: dict = {"prompt": [5, 6], "max_tokens": 8, "diffusion": {}}
    for name, wire in S.REQUEST_NAMES.items():
        if name in values:
            (body["diffusion"] if wire.startswith("diffusion.") else body)[wire.removeprefix("diffusion.")] = \
                values[name]
    sampling = parse_job(body, engine, (5, 6), False).requests[0].sampling
    assert {k: getattr(sampling, k) for k in values} == values
    for mode in ("self_speculative", "causal"):
        engine.self_speculative = False
        spec = {"prompt": [5, 6], "max_tokens": 8, "diffusion": {mode: True}}
        with pytest.raises(BadRequest, match=rf"diffusion\.{mode} needs a server started with --self-speculative"):
            parse_job(spec, engine, (5, 6), False)
        engine.self_speculative = True
        assert getattr(parse_job(spec, engine, (5, 6), False).requests[0].sampling, mode) is True


def test_each_compiled_setting_compiles_a_new_program():
    from clover_jax.sampler import compile_count

    class Uniform:
        def __call__(self, weights, tokens, *a, **k):
            import jax.numpy as jnp

            return jnp.zeros((tokens.shape[0], a[-1], CFG.vocab_size)).at[..., 7].set(1.0), None

    model = Uniform()
    base = SamplerConfig(gen_length=16, block_length=8, cache="none")
    generate(None, CFG, [[5, 6]], base, forward_fn=model)
    for change in (dict(gen_length=24), dict(block_length=16), dict(block_grid="absolute")):
        before = compile_count()
        generate(None, CFG, [[5, 6]], base.replace(**change), forward_fn=model)
        assert compile_count() == before + 1, change
