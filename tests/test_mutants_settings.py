"""The sampler's settings (`clover_jax.sampler.settings`): what users read and what reaches the programs, exactly.
Written for the mutation run (`bash scripts/mutation.sh settings`; docs/testing.md, "Mutation score"): the rule of
each kind of setting in words and in JSON schema, the messages of `check_settings`, what `auto` resolves to per
family, the knobs' host values, `clover generate`'s flags and help, a checkpoint's stored defaults and lm-eval's
model_args. All of it runs without compiling a program."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.errors import SamplerError, UsageError
from clover_jax.sampler import SamplerConfig
from clover_jax.sampler import settings as S
from clover_jax.sampler.scoring import REMASKING

CLOVER = get_config("test-clover")  # block-causal
LLADA = get_config("test-llada-moe")  # bidirectional
LLADA2 = get_config("test-llada2")  # block-causal, the absolute grid and sampled confidence


# --- each setting's rule: in words, as a check, as a JSON schema --------------------------------------------

@pytest.mark.parametrize(("name", "words"), [
    ("gen_length", "an integer >= 1"),
    ("steps", "an integer >= 1"),
    ("threshold", "a number in (0, 1] (or 0 = off)"),
    ("temperature", "a number >= 0"),
    ("top_p", "a number in (0, 1]"),
    ("top_k", "an integer in [0, 2147483647]"),
    ("seed", "an integer in [-9223372036854775808, 18446744073709551615]"),
    ("presence_penalty", "a number in [-2, 2]"),
    ("repetition_penalty", "a number in (0, 10]"),
    ("remasking", "one of " + ", ".join(REMASKING)),
    ("cache", "one of auto, none, prefix, dual"),
    ("eos_stop", "true or false"),
])
def test_each_rule_in_words(name, words):
    assert S.SETTINGS[name].rule() == words


def test_a_rule_with_the_servers_bound():
    assert S.SETTINGS["steps_per_block"].rule(8) == "an integer in [1, 8]"
    assert S.SETTINGS["top_p"].rule(0.5) == "a number in (0, 0.5]"


@pytest.mark.parametrize(("name", "value", "ok"), [
    ("gen_length", 1, True), ("gen_length", 0, False), ("gen_length", np.int64(64), True),
    ("gen_length", 64.0, False), ("gen_length", True, False), ("gen_length", "64", False),
    ("steps", None, True), ("gen_length", None, False),
    ("threshold", 0.0, True), ("threshold", 1e-9, True), ("threshold", 1.0, True), ("threshold", 1.0 + 1e-9, False),
    ("threshold", -0.5, False), ("threshold", np.float32(0.5), True), ("threshold", 1, True),
    ("top_p", 0.0, False), ("top_p", 1.0, True), ("temperature", 0.0, True), ("temperature", -1e-9, False),
    ("temperature", float("inf"), False), ("temperature", float("nan"), False), ("temperature", 1e30, True),
    ("top_k", 2**31 - 1, True), ("top_k", 2**31, False),
    ("presence_penalty", -2.0, True), ("presence_penalty", -2.5, False), ("presence_penalty", 2.0, True),
    ("eos_stop", np.bool_(False), True), ("eos_stop", 0, False), ("eos_stop", "true", False),
    ("remasking", "margin", True), ("remasking", "Margin", False), ("remasking", 1, False),
])
def test_what_each_kind_of_rule_accepts(name, value, ok):
    assert bool(S.SETTINGS[name].accepts(value)) is ok


def test_the_servers_bound_replaces_the_tables():
    s = S.SETTINGS["steps_per_block"]
    assert s.accepts(8, 8) and not s.accepts(9, 8) and s.accepts(9) and s.accepts(None, 8)
    with pytest.raises(SamplerError, match=r"^diffusion\.steps must be an integer in \[1, 8\], got 9$") as e:
        s.check(9, "diffusion.steps", 8)
    assert (e.value.setting, e.value.param) == ("steps_per_block", "diffusion.steps")


def test_a_mistyped_choice_gets_a_suggestion():
    with pytest.raises(SamplerError) as e:
        S.SETTINGS["remasking"].check("low_confidense", "--remasking")
    assert str(e.value) == ("--remasking must be one of " + ", ".join(REMASKING) +
                            ", got 'low_confidense' (did you mean low_confidence?)")
    with pytest.raises(SamplerError) as e:
        S.SETTINGS["cache"].check(3)
    assert str(e.value) == "cache must be one of auto, none, prefix, dual, got 3"
    assert e.value.param == "cache"


@pytest.mark.parametrize(("name", "maximum", "schema"), [
    ("threshold", None, {"type": "number", "minimum": 0.0, "maximum": 1.0}),  # 0 is `off`: inclusive
    ("top_p", None, {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}),
    ("temperature", None, {"type": "number", "minimum": 0.0}),
    ("top_k", None, {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}),
    ("steps_per_block", 8, {"type": "integer", "minimum": 1, "maximum": 8}),
    ("remasking", None, {"type": "string", "enum": list(REMASKING)}),
    ("self_speculative", None, {"type": "boolean"}),
])
def test_json_schema_of_a_request_setting(name, maximum, schema):
    assert S.SETTINGS[name].json_schema(maximum) == {"anyOf": [schema, {"type": "null"}]}


# --- text to values: lm-eval's model_args ------------------------------------------------------------------

@pytest.mark.parametrize(("name", "given", "value"), [
    ("steps", "", None), ("steps", "none", None), ("steps", "None", None), ("steps", "12", 12),
    ("threshold", "0.5", 0.5), ("cache", "dual", "dual"),
    ("eos_stop", "True", True), ("eos_stop", "1", True), ("eos_stop", "yes", True),
    ("eos_stop", "false", False), ("eos_stop", "0", False), ("eos_stop", "NO", False),
    ("eos_stop", 1, True), ("eos_stop", 0, False), ("eos_stop", np.int64(1), True), ("eos_stop", True, True),
    ("cfg_scale", 1.5, 1.5), ("temperature", 0, 0),
])
def test_model_args_values(name, given, value):
    got = S.parse_value(name, given)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(("name", "given", "message"), [
    ("eos_stop", "maybe", "eos_stop must be true or false, got 'maybe'"),
    ("eos_stop", 2, "eos_stop must be true or false, got 2"),
    ("gen_length", "", "gen_length must be an integer >= 1, got ''"),
    ("gen_length", "12.5", "gen_length must be an integer >= 1, got '12.5'"),
    ("gen_length", "0", "gen_length must be an integer >= 1, got 0"),
    ("cfg_scale", "-1", "cfg must be a number >= 0, got -1.0"),
    ("cfg_scale", "lots", "cfg must be a number >= 0, got 'lots'"),
])
def test_model_args_errors_name_the_argument(name, given, message):
    with pytest.raises(SamplerError) as e:
        S.parse_value(name, given)
    assert str(e.value) == message
    assert (e.value.setting, e.value.param) == (name, S.SETTINGS[name].model_arg)


# --- check_settings: the rules between settings --------------------------------------------------------------

@pytest.mark.parametrize(("changes", "message", "setting"), [
    (dict(gen_length=48, block_length=32), "gen_length (48) must be a multiple of block_length (32)", "gen_length"),
    (dict(steps=8, steps_per_block=2), "give steps or steps_per_block, not both", "steps"),
    (dict(gen_length=64, block_length=16, steps=3),
     "steps (3) must be at least the number of blocks (gen_length / block_length = 4)", "steps"),
    (dict(self_speculative=True, temperature=0.5),
     "self_speculative decodes greedily: it takes temperature 0 and no guidance (got temperature 0.5, cfg_scale 0.0)",
     "self_speculative"),
    (dict(self_speculative=True, cfg_scale=1.0),
     "self_speculative decodes greedily: it takes temperature 0 and no guidance (got temperature 0.0, cfg_scale 1.0)",
     "self_speculative"),
    (dict(causal=True, temperature=0.5),
     "causal decodes greedily: it takes temperature 0 and no guidance (got temperature 0.5, cfg_scale 0.0)", "causal"),
    (dict(causal=True, self_speculative=True), "give self_speculative or causal, not both", "self_speculative"),
    (dict(steps_per_block=33), "steps_per_block must be an integer in [1, 32], got 33", "steps_per_block"),
])
def test_check_settings_messages(changes, message, setting):
    with pytest.raises(SamplerError) as e:
        S.check_settings(SamplerConfig(**changes))
    assert str(e.value) == message and e.value.setting == setting and e.value.param == setting


def test_check_settings_spells_the_settings_as_the_caller_does():
    with pytest.raises(SamplerError) as e:
        S.check_settings(SamplerConfig(gen_length=64, block_length=16, steps=3), S.FLAGS)
    assert str(e.value) == "--steps (3) must be at least the number of blocks (--gen-length / --block-length = 4)"
    assert e.value.param == "--steps" and e.value.setting == "steps"
    with pytest.raises(SamplerError) as e:
        S.check_settings(SamplerConfig(steps=8, steps_per_block=2), S.FLAGS)
    assert str(e.value) == "give --steps or --steps-per-block, not both"
    with pytest.raises(SamplerError) as e:
        S.check_settings(SamplerConfig(gen_length=48), S.REQUEST_NAMES)
    assert str(e.value) == "gen_length (48) must be a multiple of diffusion.block_length (32)"
    with pytest.raises(SamplerError) as e:
        S.check_settings(SamplerConfig(self_speculative=True, cfg_scale=2.0), S.FLAGS)
    assert str(e.value).startswith("--self-speculative decodes greedily") and "--cfg-scale 2.0" in str(e.value)


@pytest.mark.parametrize("sc", [
    SamplerConfig(), SamplerConfig(gen_length=64, block_length=16, steps=4),  # one step a block: the least
    SamplerConfig(steps_per_block=32), SamplerConfig(self_speculative=True),
    SamplerConfig(temperature=0.7, cfg_scale=1.0, threshold=0.9, seed=-5),
])
def test_check_settings_passes_what_the_rules_allow(sc):
    S.check_settings(sc)


# --- what `auto` means per family ----------------------------------------------------------------------------

def test_auto_cache_is_the_fastest_exact_one():
    assert S.resolve_cache(CLOVER, "auto") == "prefix" and S.resolve_cache(LLADA, "auto") == "none"
    assert S.resolve_cache(CLOVER, "dual") == "prefix"  # block-causal: later blocks are invisible anyway
    assert S.resolve_cache(LLADA, "dual") == "dual" and S.resolve_cache(LLADA, "prefix") == "prefix"
    assert S.resolve_cache(CLOVER, "none") == "none"


def test_auto_rules_are_the_familys():
    assert S.resolve_rule(LLADA2, "block_grid", "auto") == "absolute"
    assert S.resolve_rule(CLOVER, "block_grid", "auto") == "prompt"
    assert S.resolve_rule(LLADA2, "block_grid", "prompt") == "prompt"
    assert S.resolve_rule(LLADA2, "confidence", "auto") == "sampling"
    assert S.resolve_rule(CLOVER, "confidence", "auto") == "logits"
    assert S.resolve_rule(LLADA2, "confidence", "logits") == "logits"


# --- the knobs: what the compiled programs receive -----------------------------------------------------------

def test_knobs_carry_every_traced_value():
    sc = SamplerConfig(gen_length=64, block_length=16, steps=8, remasking="margin", threshold=0.25,
                       entropy_bound=0.5, temperature=0.75, top_p=0.5, top_k=7, cfg_scale=1.5, seed=2**32 + 3,
                       eos_stop=False, confidence="sampling", presence_penalty=0.5, frequency_penalty=-0.25,
                       repetition_penalty=1.25)
    k = S.knobs(sc, CLOVER)._asdict()
    assert {n: v.item() for n, v in k.items()} == {
        "remasking": list(REMASKING).index("margin"), "threshold": 0.25, "entropy_bound": 0.5, "temperature": 0.75,
        "top_p": 0.5, "top_k": 7, "cfg_scale": 1.5, "seed": 3, "eos_stop": False, "sampled_confidence": True,
        "steps_per_block": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.25}
    assert S.knobs(SamplerConfig(confidence="auto"), LLADA2).sampled_confidence
    assert not S.knobs(SamplerConfig(confidence="logits"), LLADA2).sampled_confidence


# --- `clover generate`'s flags and a checkpoint's stored defaults ----------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clover generate", formatter_class=lambda prog: argparse.HelpFormatter(
        prog, width=400, max_help_position=60))
    S.add_flags(p)
    return p


def test_flags_help_lists_choices_and_defaults():
    text = _parser().format_help()
    lines = {line.split()[0]: " ".join(line.split()) for line in text.splitlines() if line.strip().startswith("--")}
    assert lines["--gen-length"] == "--gen-length N tokens to generate (a multiple of block_length) (default 128)"
    assert lines["--steps"] == ("--steps N refinement steps over all blocks, at least one per block (default: "
                                "gen_length, one token a step)")  # no default value of its own
    assert lines["--remasking"] == ("--remasking NAME which masked positions a step commits first ("
                                    + ", ".join(REMASKING) + "; default low_confidence)")
    assert lines["--no-eos-stop"] == ("--no-eos-stop do not stop a row at its first end token once nothing before it "
                                      "is masked")
    assert lines["--self-speculative"].startswith("--self-speculative let the block diffusion draft")
    assert "--eos-stop" not in lines and "--no-self-speculative" not in lines


def test_flags_parse_to_values_and_none_when_not_given():
    p = _parser()
    args = p.parse_args([])
    assert all(getattr(args, k) is None for k in S.SETTINGS)
    args = p.parse_args(["--gen-length", "64", "--threshold", "0.5", "--cache", "dual", "--no-eos-stop",
                         "--self-speculative"])
    assert (args.gen_length, args.threshold, args.cache, args.eos_stop, args.self_speculative) == \
        (64, 0.5, "dual", False, True)
    with pytest.raises(SystemExit):
        p.parse_args(["--gen-length", "6.5"])


def test_flags_then_stored_defaults_then_the_table():
    p = _parser()
    stored = {"temperature": 0.5, "gen_length": 64, "steps": 32}
    assert S.from_flags(p.parse_args([]), stored) == SamplerConfig(temperature=0.5, gen_length=64, steps=32)
    assert S.from_flags(p.parse_args(["--temperature", "0.25"]), stored) == \
        SamplerConfig(temperature=0.25, gen_length=64, steps=32)
    assert S.from_flags(p.parse_args(["--steps-per-block", "4"]), stored) == \
        SamplerConfig(temperature=0.5, gen_length=64, steps_per_block=4)
    assert S.from_flags(p.parse_args([])) == SamplerConfig()
    assert S.from_flags(argparse.Namespace()) == SamplerConfig()  # a namespace without the flags
    # a greedy-only mode asked for by flag: the checkpoint's temperature (for sampling the diffusion) stays out
    for mode in ("--causal", "--self-speculative"):
        got = S.from_flags(p.parse_args([mode]), stored)
        assert (got.temperature, got.gen_length, got.steps) == (0.0, 64, 32) and S.check_settings(got) is None
    with pytest.raises(SamplerError, match="causal decodes greedily"):  # a temperature given with it is refused
        S.check_settings(S.from_flags(p.parse_args(["--causal", "--temperature", "0.25"]), stored))
    assert S.merge_defaults({"causal": False}, stored) == {**stored, "causal": False}  # not asked for: kept
    assert S.merge_defaults({"causal": True}, {"cfg_scale": 1.5, "top_k": 4}) == {"causal": True, "top_k": 4}


def test_stored_defaults_read_and_type_checked(tmp_path):
    path = tmp_path / "generation_config.json"
    assert S.read_defaults(str(tmp_path / "missing.json"), UsageError) == {}
    path.write_text(json.dumps({"max_new_tokens": 64, "steps": None, "threshold": 1, "cache": "dual",
                                "self_speculative": True, "top_k": 3, "pad_token_id": 0, "do_sample": False}))
    got = S.read_defaults(str(path), UsageError)
    assert got == {"gen_length": 64, "steps": None, "threshold": 1.0, "cache": "dual", "self_speculative": True,
                   "top_k": 3}
    assert type(got["threshold"]) is float and type(got["top_k"]) is int
    for key, value, words in [("top_k", True, "an integer"), ("eos_stop", 1, "true or false"),
                              ("temperature", "0.5", "a number"), ("cache", 1, "a string"),
                              ("gen_length", None, "an integer"), ("max_new_tokens", 64.0, "an integer")]:
        path.write_text(json.dumps({key: value}))
        with pytest.raises(UsageError) as e:
            S.read_defaults(str(path), UsageError)
        assert str(e.value) == f"{path}: {key} must be {words}, got {json.dumps(value)}"


def test_replace_leaves_the_original():
    sc = SamplerConfig()
    assert sc.replace(top_k=3, seed=4) == SamplerConfig(top_k=3, seed=4) and sc == SamplerConfig()


def test_stored_defaults_skip_unknown_keys_wherever_they_are(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.5, "transformers_version": "5.0", "top_k": 2}))
    assert S.read_defaults(str(path), UsageError) == {"temperature": 0.5, "top_k": 2}


def test_stored_defaults_that_are_not_json_are_the_callers_error(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text("{temperature: 0.5")
    with pytest.raises(UsageError, match=r"generation_config\.json"):
        S.read_defaults(str(path), UsageError)


def test_an_exclusive_minimum_without_a_maximum_in_words():
    """The words of a rule the table can declare: a number above its minimum (not at it), no upper bound."""
    row = S.Setting(name="margin", default=1.0, help="", kind=float, optional=False, minimum=0.0, exclusive=True,
                    maximum=None, off=None, choices=(), compiled=False, knob=None, knob_as=None, request=None,
                    eval_arg=None)
    assert row.rule() == "a number > 0" and not row.accepts(0.0) and row.accepts(1e-9)
    assert S.SETTINGS["temperature"].rule() == "a number >= 0"
