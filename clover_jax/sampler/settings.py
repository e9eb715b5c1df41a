"""The sampler's settings, written once.

`SamplerConfig`'s field declarations are the table: each field is declared with `setting(...)`, which records its
type and range, its default, whether it is compiled into the program (a new value compiles a new program) or
traced (never a recompile), its name in a `clover serve` request and in lm-eval's model_args, and its help text.
Everything else is derived from that table:

  check_settings(sc, spell)  the one validation, one message per rule, naming the setting as the user wrote it
                        (`FLAGS`: `--gen-length`; `REQUEST_NAMES`: `max_tokens`, `diffusion.steps`; default: the
                        field name)
  Knobs, knobs(sc, cfg) the traced values of the compiled programs: the sampler's (one per batch) and the serving
                        engine's (one per row, [B] leaves)
  add_flags, from_flags the `clover generate` flags
  read_defaults         a checkpoint's generation_config.json as sampler defaults
  parse_value           a setting from text (lm-eval's model_args)
  json_schema           a setting's JSON schema (`clover serve`'s /openapi.json)

Steps: `steps` counts refinement steps over all blocks (LLaDA's convention, default gen_length: one token a
step); `steps_per_block` counts them per block (LLaDA2's and the server's; at most block_length). Give one or
neither. The compiled programs take `steps_per_block`.

`auto` values are resolved per model family (`resolve_cache`, `resolve_rule`): the family's own reference
generator's rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.errors import CloverError, SamplerError, did_you_mean
from clover_jax.jsonfile import read_object
from clover_jax.model import masks
from clover_jax.sampler.scoring import REMASKING, remasking_index

CACHE_MODES = ("none", "prefix", "dual")
BLOCK_GRIDS = masks.BLOCK_GRIDS
CONFIDENCES = ("logits", "sampling")
MAX_INT32 = 2**31 - 1  # an int32 knob (top_k) travels to the device as such
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # seeds are reduced mod 2**32 on the device
# What `auto` means per model family: the rules of the family's own reference generator (the block grid's is
# `masks.family_block_grid`, which training shares).
FAMILY_DEFAULTS: dict[str, dict[str, str]] = {"llada2_moe": {"confidence": "sampling"}}


def setting(default: Any, help: str, kind: type, *, optional: bool = False, minimum: float | None = None,
            exclusive: bool = False, maximum: float | None = None, off: float | None = None,
            choices: tuple[str, ...] = (), compiled: bool = False, knob: Any = None, knob_as: str | None = None,
            request: str | None = None, eval_arg: str | None = None) -> Any:
    """A `SamplerConfig` field and its row of the table (see `Setting` for the arguments)."""
    row = dict(default=default, help=help, kind=kind, optional=optional, minimum=minimum, exclusive=exclusive,
               maximum=maximum, off=off, choices=choices, compiled=compiled, knob=knob, knob_as=knob_as,
               request=request, eval_arg=eval_arg)
    return field(default=default, metadata={"setting": row})


@dataclass(frozen=True)
class SamplerConfig:
    """One sampling request's settings (the module docstring: the table they form). Hashable, never mutated."""

    gen_length: int = setting(128, "tokens to generate (a multiple of block_length)", int, minimum=1,
                              compiled=True)
    block_length: int = setting(32, "tokens per semi-autoregressive block", int, minimum=1, compiled=True,
                                request="diffusion.block_length")
    steps: int | None = setting(None, "refinement steps over all blocks, at least one per block (default: "
                                      "gen_length, one token a step)", int, optional=True, minimum=1)
    remasking: str = setting("low_confidence", "which masked positions a step commits first", str,
                             choices=tuple(REMASKING), knob=np.int32, request="diffusion.remasking")
    threshold: float = setting(0.0, "also commit every masked position whose confidence exceeds it", float,
                               minimum=0.0, exclusive=True, maximum=1.0, off=0.0, knob=np.float32,
                               request="diffusion.threshold")
    entropy_bound: float = setting(0.0, "also commit the lowest-entropy positions while their entropy sum stays "
                                        "within it (EB-sampler)", float, minimum=0.0, knob=np.float32)
    temperature: float = setting(0.0, "sampling temperature (0: greedy)", float, minimum=0.0, knob=np.float32,
                                 request="temperature")
    top_p: float = setting(1.0, "nucleus filter (1: off)", float, minimum=0.0, exclusive=True, maximum=1.0,
                           knob=np.float32, request="top_p")
    top_k: int = setting(0, "keep the k most likely tokens (0: off)", int, minimum=0, maximum=MAX_INT32,
                         knob=np.int32, request="diffusion.top_k")
    cfg_scale: float = setting(0.0, "classifier-free guidance scale (0: off; guidance doubles the rows, so on/off "
                                    "is compiled in)", float, minimum=0.0, knob=np.float32, eval_arg="cfg")
    seed: int = setting(0, "random seed", int, minimum=SEED_MIN, maximum=SEED_MAX, knob=np.uint32, request="seed")
    cache: str = setting("auto", "the cache (auto: prefix for block-causal models, exact; none otherwise; prefix "
                                 "and dual approximate bidirectional models)", str,
                         choices=("auto", *CACHE_MODES), compiled=True, request="diffusion.cache")
    eos_stop: bool = setting(True, "stop a row at its first end token once nothing before it is masked", bool,
                             knob=np.bool_)
    block_grid: str = setting("auto", "where blocks lie: prompt (generated blocks start after the prompt: LLaDA) "
                                      "or absolute (every block_length positions from 0, the prompt's partial "
                                      "last block completed first: LLaDA2); auto: the model family's", str,
                              choices=("auto", *BLOCK_GRIDS), compiled=True)
    confidence: str = setting("auto", "the probability low_confidence ranks and the threshold compares: logits "
                                      "(the model's softmax at temperature 1: LLaDA) or sampling (the "
                                      "tempered, filtered distribution the token was drawn from: LLaDA2); equal "
                                      "at temperature 0; auto: the model family's", str,
                              choices=("auto", *CONFIDENCES), knob=np.bool_, knob_as="sampled_confidence")
    steps_per_block: int | None = setting(None, "refinement steps per block, at most block_length; instead of "
                                                "steps (default: block_length, one token a step)", int, optional=True,
                                          minimum=1, knob=np.int32, request="diffusion.steps")
    presence_penalty: float = setting(0.0, "subtract this from the logit of every token already in the response "
                                           "(OpenAI's presence penalty; 0: off)", float, minimum=-2.0, maximum=2.0,
                                      knob=np.float32, request="presence_penalty")
    frequency_penalty: float = setting(0.0, "subtract this times its count in the response from each token's logit "
                                            "(OpenAI's frequency penalty; 0: off)", float, minimum=-2.0, maximum=2.0,
                                       knob=np.float32, request="frequency_penalty")
    repetition_penalty: float = setting(1.0, "divide the positive logits and multiply the negative ones of the "
                                             "tokens already in the response by this (transformers' repetition "
                                             "penalty, over the response only; 1: off)", float, minimum=0.0,
                                        exclusive=True, maximum=10.0, knob=np.float32, request="repetition_penalty")
    self_speculative: bool = setting(False, "let the block diffusion draft and the causal model accept: exactly the "
                                            "causal model's greedy text, in fewer passes when the drafts agree "
                                            "(Clover as its ports run it; temperature 0, one sequence a program)",
                                     bool, compiled=True, request="diffusion.self_speculative")
    causal: bool = setting(False, "decode as an autoregressive model would: one token a pass, the causal model's "
                                  "greedy choice over its cache (a causal-prefix model's clean path; the text "
                                  "self-speculative decoding writes; temperature 0, one sequence a program)",
                           bool, compiled=True, request="diffusion.causal")

    @property
    def n_blocks(self) -> int:
        """Semi-autoregressive blocks: gen_length / block_length."""
        return self.gen_length // self.block_length

    @property
    def total_steps(self) -> int:
        """Refinement steps over all blocks: `steps`, else steps_per_block x blocks, else gen_length."""
        if self.steps is not None:
            return self.steps
        return self.gen_length if self.steps_per_block is None else self.steps_per_block * self.n_blocks

    @property
    def block_steps(self) -> int:
        """Refinement steps per block: `steps_per_block`, else `total_steps` split evenly over the blocks."""
        return self.steps_per_block if self.steps_per_block is not None else max(self.total_steps // self.n_blocks, 1)

    def replace(self, **changes: Any) -> SamplerConfig:
        """A copy with `changes` (a frozen dataclass: the original is never mutated)."""
        return dataclasses.replace(self, **changes)


# ---- the table -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One row of the table: a `SamplerConfig` field and its rules.

    kind: int, float, bool or str (a choice among `choices`); optional: None is allowed (see `help`); minimum /
    maximum: its range (`exclusive`: the minimum itself is not allowed); off: a value outside the range that
    turns it off; compiled: part of the compiled program's static key, else traced; knob: the dtype of its traced
    value (None: not a knob of its own), `knob_as` the knob's name when it is not the setting's; request: its
    name in a `clover serve` request body (None: the server's to set, not per request); eval_arg: its name in
    lm-eval's model_args when that is not its own (every setting is a model argument)."""

    name: str
    default: Any
    help: str
    kind: type
    optional: bool
    minimum: float | None
    exclusive: bool
    maximum: float | None
    off: float | None
    choices: tuple[str, ...]
    compiled: bool
    knob: Any
    knob_as: str | None
    request: str | None
    eval_arg: str | None

    @property
    def flag(self) -> str:
        """Its command-line flag."""
        return "--" + self.name.replace("_", "-")

    @property
    def model_arg(self) -> str:
        """Its lm-eval model_args name."""
        return self.eval_arg or self.name

    def rule(self, maximum: float | None = None) -> str:
        """What a value must be, in words ("an integer >= 1", "a number in (0, 1] (or 0 = off)", ...); `maximum`
        replaces the table's upper bound (steps_per_block: the block length)."""
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        elif self.kind is bool:
            text = "true or false"
        else:
            text = KIND_WORDS[self.kind]
            lo, hi = self.minimum, self.maximum if maximum is None else maximum
            if lo is not None and hi is not None:
                text += f" in {'(' if self.exclusive else '['}{_num(lo)}, {_num(hi)}]"
            elif lo is not None:
                text += f" {'>' if self.exclusive else '>='} {_num(lo)}"
            if self.off is not None:
                text += f" (or {_num(self.off)} = off)"
        return text

    def accepts(self, value: Any, maximum: float | None = None) -> bool:
        """Whether `value` satisfies the rule (`maximum` as for `rule`; None passes for an optional setting)."""
        if value is None:
            return self.optional
        if self.kind is bool:
            return isinstance(value, bool | np.bool_)
        if self.choices:
            return isinstance(value, str) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            return False
        if self.kind is int and not isinstance(value, int | np.integer):
            return False
        if not math.isfinite(value):
            return False
        if self.off is not None and value == self.off:
            return True
        if self.minimum is not None and (value < self.minimum or (self.exclusive and value == self.minimum)):
            return False
        hi = self.maximum if maximum is None else maximum
        return hi is None or value <= hi

    def check(self, value: Any, spelt: str | None = None, maximum: float | None = None) -> None:
        """SamplerError "<spelt> must be <rule>, got <value>" unless `value` satisfies the rule."""
        if not self.accepts(value, maximum):
            hint = did_you_mean(value, self.choices) if self.choices and isinstance(value, str) else ""
            raise SamplerError(f"{spelt or self.name} must be {self.rule(maximum)}, got {value!r}{hint}",
                               setting=self.name, param=spelt or self.name)

    def parse(self, text: Any) -> Any:
        """The value of `text` (a string from lm-eval's model_args, or already a value); ValueError if it does
        not parse. The rule is not checked here (`check`)."""
        if not isinstance(text, str):
            return text
        if self.optional and text.lower() in ("", "none"):
            return None
        if self.kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"expected true or false, got {text!r}")
            return text.lower() in ("true", "1", "yes")
        return self.kind(text)

    def value_of(self, given: Any) -> Any:
        """A value as a program hands it over (lm-eval's model_args: strings, or ints for flags): parsed from text,
        0 / 1 as false / true for a flag. The rule is not checked here (`check`)."""
        if self.kind is bool and isinstance(given, int | np.integer) and not isinstance(given, bool) \
                and given in (0, 1):
            return bool(given)
        return self.parse(given)

    def json_schema(self, maximum: float | None = None) -> dict[str, Any]:
        """Its JSON schema (a request field's, `null` included); `maximum` replaces the table's upper bound."""
        if self.choices:
            schema: dict[str, Any] = {"type": "string", "enum": list(self.choices)}
        elif self.kind is bool:
            schema = {"type": "boolean"}
        else:
            schema = {"type": "integer" if self.kind is int else "number"}
            if self.minimum is not None:  # an `off` value at the minimum makes it inclusive (threshold: 0 or (0, 1])
                exclusive = self.exclusive and self.off != self.minimum
                schema["exclusiveMinimum" if exclusive else "minimum"] = self.minimum
            hi = self.maximum if maximum is None else maximum
            if hi is not None:
                schema["maximum"] = hi
        return {"anyOf": [schema, {"type": "null"}]}


KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else str(x)


SETTINGS: dict[str, Setting] = {f.name: Setting(name=f.name, **f.metadata["setting"])
                                for f in dataclasses.fields(SamplerConfig)}
FLAGS: dict[str, str] = {s.name: s.flag for s in SETTINGS.values()}  # spellings on the command line
REQUEST_NAMES: dict[str, str] = {s.name: s.request for s in SETTINGS.values() if s.request}  # in a request body
MODEL_ARGS: dict[str, str] = {s.model_arg: s.name for s in SETTINGS.values()}  # lm-eval's name -> field
# What the serving engine fixes for all its rows: the compiled settings (a request's length is its max_tokens, the
# block length and the cache mode are the server's) and guidance, which would need twice the rows.
SERVER_FIXED = (*(k for k, s in SETTINGS.items() if s.compiled), "cfg_scale")
# The modes that decode the causal model greedily (one of them at a time): no temperature, no guidance.
GREEDY_MODES = ("self_speculative", "causal")


def check_settings(sc: SamplerConfig, spell: Mapping[str, str] | None = None) -> None:
    """SamplerError naming the first setting of `sc` that breaks a rule, spelt as `spell` has it (default: the
    field names). Runs before anything is traced."""
    name = (lambda n: (spell or {}).get(n, n))
    for s in SETTINGS.values():
        s.check(getattr(sc, s.name), name(s.name), sc.block_length if s.name == "steps_per_block" else None)
    gen, bl, steps = name("gen_length"), name("block_length"), name("steps")
    if sc.gen_length % sc.block_length:
        raise SamplerError(f"{gen} ({sc.gen_length}) must be a multiple of {bl} ({sc.block_length})",
                           setting="gen_length", param=gen)
    if sc.steps is not None and sc.steps_per_block is not None:
        raise SamplerError(f"give {steps} or {name('steps_per_block')}, not both", setting="steps", param=steps)
    if sc.steps is not None and sc.steps < sc.n_blocks:
        raise SamplerError(f"{steps} ({sc.steps}) must be at least the number of blocks ({gen} / {bl} = "
                           f"{sc.n_blocks})", setting="steps", param=steps)
    if all(getattr(sc, mode) for mode in GREEDY_MODES):
        spec = name("self_speculative")
        raise SamplerError(f"give {spec} or {name('causal')}, not both", setting="self_speculative", param=spec)
    for mode in GREEDY_MODES:
        if getattr(sc, mode) and (sc.temperature > 0 or sc.cfg_scale > 0):
            spec = name(mode)
            raise SamplerError(f"{spec} decodes greedily: it takes temperature 0 and no guidance (got temperature "
                               f"{sc.temperature}, {name('cfg_scale')} {sc.cfg_scale})", setting=mode, param=spec)


# ---- what `auto` means --------------------------------------------------------------------------------------


def resolve_cache(cfg: ModelConfig, cache: str) -> str:
    """`auto` -> the fastest exact mode: prefix for block-causal models, none for bidirectional ones.
    Block-causal `dual` is the `prefix` program (later blocks are invisible anyway)."""
    if cache == "auto":
        return "prefix" if cfg.is_block_causal else "none"
    return "prefix" if (cache == "dual" and cfg.is_block_causal) else cache


def resolve_rule(cfg: ModelConfig, name: str, value: str) -> str:
    """`auto` -> the family's rule for `name`: block_grid by `masks.resolve_block_grid` (the rule training
    shares), confidence by `FAMILY_DEFAULTS` (else logits); anything else is returned as given."""
    if name == "block_grid":
        return masks.resolve_block_grid(cfg, value)
    if value != "auto":
        return value
    return FAMILY_DEFAULTS.get(cfg.family, {}).get(name, CONFIDENCES[0])


# ---- the traced values ------------------------------------------------------------------------------------

Knobs = NamedTuple("Knobs", [(s.knob_as or s.name, jax.Array) for s in SETTINGS.values() if s.knob is not None])
Knobs.__doc__ = """The traced settings of a compiled program: changing any of them never recompiles. Scalars in the
sampler (one value per batch), [B] in the serving engine (one per row). One field per setting of `SamplerConfig`
with a `knob`: `steps_per_block` the steps of a block (from `steps` or `steps_per_block`), `remasking` the
strategy's index in `scoring.REMASKING`, `sampled_confidence` the `confidence` rule resolved for the family."""


def knobs(sc: SamplerConfig, cfg: ModelConfig) -> Knobs:
    """The host values of `sc`'s traced settings for model `cfg`, with fixed dtypes (so every call hits the same
    compiled signature)."""
    special = {"steps_per_block": np.int32(sc.block_steps),
               "sampled_confidence": np.bool_(resolve_rule(cfg, "confidence", sc.confidence) == "sampling"),
               "remasking": np.int32(remasking_index(sc.remasking)),
               "seed": np.uint32(sc.seed % 2**32)}
    return Knobs(*(special[k] if k in special else SETTINGS[k].knob(getattr(sc, k)) for k in Knobs._fields))


# ---- the command line and stored defaults -----------------------------------------------------------------


def add_flags(parser: Any) -> None:
    """One flag per setting (default None: "not given"; a choice lists its values), `--no-eos-stop` for the setting
    that defaults to on."""
    for s in SETTINGS.values():
        if s.kind is bool and s.default:
            parser.add_argument(f"--no-{s.name.replace('_', '-')}", dest=s.name, action="store_const", const=False,
                                default=None, help=f"do not {s.help}")
            continue
        if s.kind is bool:
            parser.add_argument(s.flag, dest=s.name, action="store_const", const=True, default=None, help=s.help)
            continue
        shown = [", ".join(s.choices)] if s.choices else []  # checked by `check_settings`: one line, not usage
        shown += [] if s.default is None else [f"default {s.default}"]
        parser.add_argument(s.flag, dest=s.name, type=s.kind, default=None, metavar="NAME" if s.choices else "N",
                            help=s.help + (f" ({'; '.join(shown)})" if shown else ""))


_ONE_OF = ("steps", "steps_per_block")  # two spellings of one thing: a flag for either replaces both defaults


def merge_defaults(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The settings `given` (by flags or a request's fields) over `defaults` (a checkpoint's), leaving out a default
    that would contradict what was given: steps or steps_per_block when the other is given, and the temperature
    when a mode that decodes greedily (`GREEDY_MODES`) is asked for (a checkpoint's temperature is for sampling
    the diffusion), and guidance (`cfg_scale`) then too."""
    skip = set(_ONE_OF) if given.keys() & set(_ONE_OF) else set()
    if any(given.get(mode) for mode in GREEDY_MODES):
        skip |= {"temperature", "cfg_scale"}
    return {k: v for k, v in defaults.items() if k not in skip} | dict(given)


def from_flags(args: Any, defaults: Mapping[str, Any] | None = None) -> SamplerConfig:
    """Flags first, then `defaults` (a checkpoint's, `read_defaults`; `merge_defaults`), then the table's."""
    given = {k: getattr(args, k) for k in SETTINGS if getattr(args, k, None) is not None}
    return SamplerConfig(**merge_defaults(given, defaults or {}))


HF_NAMES = {"max_new_tokens": "gen_length"}  # HuggingFace generation_config.json spellings


def read_defaults(path: str, error: type[CloverError]) -> dict[str, Any]:
    """The sampler defaults a checkpoint stores in `path` (its generation_config.json; {} when there is none):
    keys of the table (or HuggingFace's `max_new_tokens`), each value type-checked (`error(message)` is raised
    naming the file and key); unknown keys are ignored, as HuggingFace's own are."""
    if not os.path.isfile(path):
        return {}
    doc = read_object(path, error)
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = HF_NAMES.get(key, key)
        s = SETTINGS.get(name)
        if s is None:
            continue
        if value is None and s.optional:
            out[name] = None
            continue
        kinds = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}[s.kind]
        if isinstance(value, bool) != (s.kind is bool) or not isinstance(value, kinds):
            raise error(f"{path}: {key} must be {KIND_WORDS[s.kind]}, got {json.dumps(value)}")
        out[name] = float(value) if s.kind is float else value
    return out


def parse_value(name: str, text: Any) -> Any:
    """Setting `name`'s value from text (lm-eval's model_args); SamplerError naming it when it does not parse or
    breaks its rule."""
    s = SETTINGS[name]
    try:
        value = s.value_of(text)
    except (TypeError, ValueError):
        raise SamplerError(f"{s.model_arg or name} must be {s.rule()}, got {text!r}", setting=name,
                           param=s.model_arg or name) from None
    s.check(value, s.model_arg or name)
    return value
