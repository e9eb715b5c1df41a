"""The lm-evaluation-harness model `clover`: a clover_jax checkpoint behind lm-eval's `LM` interface.

The only module of clover_jax that imports lm_eval (the `eval` extra). lm-eval 0.4 finds models in its own
registry only (no entry points), so nothing is registered on import: `register()` adds `clover` explicitly;
`clover eval` and `python -m clover_jax.evaluation` (lm-eval's own command line with `clover` registered) call it.

    register()
    lm_eval.simple_evaluate(model="clover", model_args="pretrained=checkpoints/clover-tiny,mc_num=32", tasks=[...])

Requests:
  loglikelihood          the masked-diffusion Monte-Carlo estimator (`likelihood.estimate`), `mc_num` draws in
                         passes of `batch_size` rows; each estimate's standard error is kept in `estimates`. A
                         causal-prefix model (Clover as its ports run it) is the causal model on clean text: its
                         likelihood is exact (`likelihood.exact`, one pass, standard error 0), is_greedy too.
                         is_greedy: with `check_greedy=true`, whether one pass over the fully masked answer
                         predicts every answer token (its argmax); otherwise False: a masked-diffusion model has no
                         single greedy continuation, and the step-by-step check costs one pass per token.
  loglikelihood_rolling  lm-eval's disjoint rolling windows of `max_length` tokens, the estimator on each window
                         (its context clean), summed.
  generate_until         the compiled sampler (`clover_jax.sampler.generate`), requests sorted by length in batches
                         of `batch_size` rows (the last padded with filler rows), prompts in block_length x 2^k
                         buckets, so a few programs serve every request; the text is cut at the first stop string.

model_args (all optional): pretrained (a checkpoint directory; default the shipped clover-tiny), mc_num (128),
batch_size (16), check_greedy (false), max_length (the model's max_seq_len), apply_chat_template (false: the
checkpoint's template on every generate_until prompt; lm-eval's --apply_chat_template formats the whole
conversation instead), dispatch; and every sampler setting by its name (`sampler.settings`: steps, threshold,
remasking, temperature, top_p, ...; their defaults are the sampler's), with `cfg` for cfg_scale (the guidance
scale of the estimator and the sampler) and `seed` seeding the estimator too. gen_length defaults to the request's
max_gen_toks rounded up to whole blocks, block_length (the sampler's) to at most gen_length.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from clover_jax import shipped
from clover_jax.checkpoint import load_model
from clover_jax.errors import EvaluationError, SamplerError
from clover_jax.evaluation.likelihood import Estimate, estimate, exact
from clover_jax.sampler import SamplerConfig, batch_bucket, check_model, check_settings, generate
from clover_jax.sampler.settings import MODEL_ARGS, parse_value
from clover_jax.tokenizer import load_tokenizer

NAME = "clover"


def register() -> None:
    """Add `clover` to lm-eval's model registry (idempotent), after lm-eval's own models (lm-eval lists its own
    only while the registry is empty)."""
    import lm_eval.models  # noqa: F401  (fills the registry with lm-eval's models)

    if NAME not in model_registry or model_registry.get(NAME) is not CloverLM:
        register_model(NAME)(CloverLM)


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise EvaluationError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    return bool(value)


def _opt_int(value: Any) -> int | None:
    return None if value in (None, "", "None", "none") else int(value)


@dataclass(frozen=True)
class EvalSettings:
    """The model_args of `CloverLM`, typed (see the module docstring): the harness's own, and `sampling`, the
    sampler settings given (by `SamplerConfig` field; lm-eval names them as `settings.MODEL_ARGS` does)."""

    mc_num: int = 128
    batch_size: int = 16
    check_greedy: bool = False
    max_length: int | None = None
    apply_chat_template: bool = False
    dispatch: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def cfg_scale(self) -> float:
        """The guidance scale of the estimator and the sampler (model_args `cfg`)."""
        return self.sampling.get("cfg_scale", SamplerConfig.cfg_scale)

    @property
    def seed(self) -> int:
        """The seed of the estimator's draws and the sampler."""
        return self.sampling.get("seed", SamplerConfig.seed)


_OWN = {"mc_num": int, "batch_size": int, "check_greedy": _flag, "max_length": _opt_int,
        "apply_chat_template": _flag, "dispatch": lambda v: None if v in (None, "None") else str(v)}


def settings_from(kwargs: dict[str, Any]) -> EvalSettings:
    """EvalSettings from model_args (strings or values); EvaluationError names an unknown or bad one."""
    own, sampling = {}, {}
    for key, value in kwargs.items():
        if key in _OWN:
            try:
                own[key] = _OWN[key](value)
            except (TypeError, ValueError) as e:
                raise EvaluationError(f"model argument {key}={value!r}: {e}") from None
        elif key in MODEL_ARGS:
            if value is None or value in ("", "None"):  # how lm-eval writes an unset argument: the sampler's default
                continue
            try:
                sampling[MODEL_ARGS[key]] = parse_value(MODEL_ARGS[key], value)
            except SamplerError as e:
                raise EvaluationError(f"model_args: {e}") from None
        else:
            raise EvaluationError(f"unknown model argument {key!r} (known: pretrained, "
                                  f"{', '.join([*_OWN, *MODEL_ARGS])})")
    s = EvalSettings(**own, sampling=sampling)
    if s.batch_size < 1 or s.mc_num < s.batch_size or s.mc_num % s.batch_size:
        raise EvaluationError(f"mc_num ({s.mc_num}) must be a positive multiple of batch_size ({s.batch_size})")
    return s


class CloverLM(LM):
    """A clover_jax checkpoint as an lm-eval model (module docstring: the requests and the model_args)."""

    def __init__(self, pretrained: str | None = None, batch_size: Any = None, device: Any = None,
                 max_batch_size: Any = None, **kwargs: Any) -> None:
        super().__init__()
        if batch_size not in (None, "auto") and not str(batch_size).startswith("auto"):
            kwargs["batch_size"] = batch_size
        self.settings = settings_from(kwargs)
        path = str(pretrained) if pretrained else str(shipped.MODEL_DIR)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise EvaluationError(f"pretrained={path!r} is not a checkpoint directory (no config.json)")
        self.path = path
        self.cfg, self.weights = load_model(path)
        check_model(self.cfg)
        self.tok = load_tokenizer(path)
        self.max_length = min(self.settings.max_length or self.cfg.max_seq_len, self.cfg.max_seq_len)
        self.estimates: list[tuple[str, Estimate]] = []  # (request kind, estimate) of every likelihood computed

    # ---- lm-eval's hooks ----------------------------------------------------------------------------------

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
                            ) -> CloverLM:
        """The model from model_args plus lm-eval's own settings (batch_size, device, ...); a model argument
        wins over lm-eval's setting of the same name (its command line always passes a batch_size)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> CloverLM:
        """`create_from_arg_obj` of the parsed `k=v,...` string."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tokenizer_name(self) -> str:
        """The checkpoint's path, which fingerprints lm-eval's request caches."""
        return self.path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The checkpoint's jinja chat template, if it has one."""
        return getattr(self.tok, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation through the checkpoint's chat template; without one, the messages joined by blank
        lines."""
        template = getattr(self.tok, "chat_template", None)
        if not template:
            return "\n\n".join(m["content"] for m in chat_history)
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=chat_history, add_generation_prompt=add_generation_prompt)

    # ---- likelihoods --------------------------------------------------------------------------------------

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) split from the encoding of the whole text (lm-eval's rule: trailing
        spaces of the context move to the continuation), so the pair tokenises as the text does."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context) if context else []
        return whole[:len(ctx)], whole[len(ctx):]

    def score(self, prompt: Sequence[int], answer: Sequence[int], kind: str = "loglikelihood") -> Estimate:
        """The estimator on one (prompt, answer) pair, the prompt cut from the left to fit `max_length`; the seed
        of its draws depends only on `seed` and the ids, so a request scores the same in any order."""
        s = self.settings
        if len(answer) > self.max_length:
            raise EvaluationError(f"an answer of {len(answer)} tokens exceeds max_length ({self.max_length})")
        if self.cfg.causal_prefix:  # clean text is the causal model: its likelihood is exact
            # the answer's last token is never an input: prompt + answer may be max_length + 1 (lm-eval's rolling
            # windows, whose context is the token before an answer of max_length)
            prompt = list(prompt)[max(0, len(prompt) + len(answer) - 1 - self.max_length):]
            est = exact(self.weights, self.cfg, prompt, answer, dispatch=s.dispatch)
            self.estimates.append((kind, est))
            return est
        prompt = list(prompt)[max(0, len(prompt) + len(answer) - self.max_length):]
        key = zlib.crc32(np.asarray([*prompt, -1, *answer], np.int64).tobytes())
        est = estimate(self.weights, self.cfg, prompt, answer, mc_num=s.mc_num, batch_size=s.batch_size,
                       cfg_scale=s.cfg_scale, seed=int(np.random.SeedSequence([s.seed, key]).generate_state(1)[0]),
                       check_greedy=s.check_greedy and kind == "loglikelihood", dispatch=s.dispatch)
        self.estimates.append((kind, est))
        return est

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(estimated log p(continuation | context), is_greedy) per request."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="clover loglikelihood"):
            context, continuation = req.args
            prompt, answer = self._encode_pair(context, continuation)
            if not answer:
                raise EvaluationError(f"the continuation {continuation!r} encodes to no tokens")
            est = self.score(prompt, answer)
            out.append((est.mean, est.greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Estimated log p(text) per request: the sum over lm-eval's disjoint rolling windows of `max_length`
        tokens (the first conditioned on EOS); its standard error is the root sum of squares of theirs."""
        out = []
        prefix = self.cfg.eos_token_id if self.cfg.eos_token_id is not None else self.cfg.pad_token_id
        for req in tqdm(requests, disable=disable_tqdm, desc="clover loglikelihood_rolling"):
            ids = self.tok.encode(req.args[0])
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                ids, prefix_token=prefix, max_seq_len=self.max_length, context_len=1)]
            parts = [self.score(ctx, cont, "loglikelihood_rolling_window") for ctx, cont in windows]
            total = sum(p.mean for p in parts)
            se = math.sqrt(sum(p.stderr ** 2 for p in parts))
            self.estimates.append(("loglikelihood_rolling", Estimate(total, se, sum(p.samples for p in parts))))
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # ---- generation ---------------------------------------------------------------------------------------

    def sampler_config(self, gen_kwargs: dict[str, Any]) -> tuple[SamplerConfig, list[str]]:
        """(SamplerConfig, stop strings) for one request's gen_kwargs: the model_args' sampler settings; without a
        gen_length, max_gen_toks rounded up to whole blocks (the block no longer than it); a temperature given
        there wins over the model_args one."""
        given = dict(self.settings.sampling)
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        want = given.get("gen_length") or int(gen_kwargs.get("max_gen_toks", 256))
        block = min(given.get("block_length", SamplerConfig.block_length), want)
        given.update(gen_length=-(-want // block) * block, block_length=block)
        if "temperature" in gen_kwargs:
            given["temperature"] = float(gen_kwargs["temperature"])
        if not gen_kwargs.get("do_sample", True):
            given["temperature"] = 0.0
        sc = SamplerConfig(**given)
        try:
            check_settings(sc, {v: k for k, v in MODEL_ARGS.items()})
        except SamplerError as e:
            raise EvaluationError(f"model_args: {e}") from None
        return sc, until

    def _prompt_ids(self, context: str, gen_length: int) -> list[int]:
        if self.settings.apply_chat_template:
            context = self.tok.apply_chat_template(context) or context
        ids = self.tok.encode(context)
        return ids[max(0, len(ids) - (self.max_length - gen_length)):]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """The sampler's continuation of each context, cut at its first stop string."""
        groups: dict[tuple, list[int]] = {}
        configs = []
        for i, req in enumerate(requests):
            sc, until = self.sampler_config(dict(req.args[1]))
            configs.append((sc, until))
            groups.setdefault((sc, tuple(until)), []).append(i)
        out: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="clover generate_until")
        rows = batch_bucket(self.settings.batch_size)
        for (sc, until), idx in groups.items():
            prompts = {i: self._prompt_ids(requests[i].args[0], sc.gen_length) for i in idx}
            order = sorted(idx, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), rows):
                chunk = order[start:start + rows]
                res = generate(self.weights, self.cfg, [prompts[i] for i in chunk], sc, batch=rows,
                               dispatch=self.settings.dispatch)
                for i, toks in zip(chunk, res.tokens, strict=True):
                    out[i] = cut_at_stop(self.tok.decode(toks), until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
                bar.update(len(chunk))
        bar.close()
        return out


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """`text` up to the earliest occurrence of any stop string (all of it when none occurs)."""
    cut = min((j for j in (text.find(u) for u in until if u) if j >= 0), default=len(text))
    return text[:cut]
