"""Tool calls written into the canvas: the call's frame and its schema's keys as fixed tokens, the model filling in
only the values, each value column restricted to tokens its JSON-schema type can hold.

A diffusion model refines every column of a block at once, so it can be given some columns already written
(`requests.Scaffold`). `CallForms.frame(spec, sizes)` lays one call of `spec` out in a response: its frame in the
model's own call form (`FORMS`: the JSON form of the plain prompt format and the Hermes / Qwen3 templates,
`<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`, or the XML form of the Qwen3.5 / Qwen3-Coder
templates), the schema's required keys in its `properties` order (optional keys are left out), a slot of `sizes[key]`
columns for each value and an end token after the closing tag. Each slot's columns are restricted by type:

  integer / number   digits (a sign or a space first only; a point and an exponent for a number)
  boolean            the tokens of `true` / `false`
  enum               the tokens of the enum's values (as JSON in the JSON form)
  string (JSON)      an opening quote first, a closing quote last, neither (nor a tag) between
  anything else      no tag (`<`)

A value's length is not known before it is written, and a slot must be filled whole (the model was never taught to
pad a value), so the slots are sized from the model's own draft of the call (`value_sizes`: the tokens each value
took there, its first call's), else from `DEFAULT_SIZE`. `read(layout, tokens)` reads the values back (a JSON-form
value as JSON, an XML-form one converted by type; digits as an integer, leading zeros and all) and checks them against
the schema: a `ParsedCall`, or None (malformed).

`TokenTexts` reads once per tokenizer what each token adds to a text; fixed text is tokenized in the context of the
text before it, as the model saw such text in training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clover_jax.serving.requests import Scaffold
from clover_jax.serving.tool_parse import CLOSE, OPEN, ParsedCall, convert_value
from clover_jax.serving.tools import ToolSpec, check_arguments, schema_types
from clover_jax.tokenizer import Tokenizer

FORMS = ("json", "xml")
# a value's columns when the draft gives none, by type
DEFAULT_SIZE = {"integer": 2, "number": 3, "boolean": 1, "string": 4, "any": 4}
MAX_SIZE = 64  # a slot's columns at most


def form_of(tokenizer: Tokenizer) -> str:
    """The call form a model writes: "xml" when its chat template writes `<function=` calls, else "json"."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "xml" if "<function=" in template else "json"


class TokenTexts:
    """What each token of a vocabulary adds to a text (decoded after a reference token, so a sentencepiece word
    boundary reads as a space)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        ref = tokenizer.encode("a")[-1:]
        base = tokenizer.decode(ref)
        self.texts = [tokenizer.decode([*ref, t])[len(base):] for t in range(vocab_size)]

    def where(self, ok: Callable[[str], bool]) -> tuple[int, ...]:
        """The tokens whose text is not empty and passes `ok`."""
        return tuple(i for i, t in enumerate(self.texts) if t and ok(t))


@dataclass(frozen=True)
class CallLayout:
    """One call laid out in a response: the `Scaffold` and where each value's slot lies."""

    spec: ToolSpec
    scaffold: Scaffold
    slots: tuple[tuple[str, int, int], ...]  # (key, first column, end column)
    end: int  # the column of the end token after the call


@dataclass
class CallForms:
    """A model's call form and token classes: `tokenizer`, `vocab_size`, its end token `eos_id`, `form` and the
    number of token classes a scaffold may define (the engine's `scaffold_classes`) and the engine's block length.
    The classes are built on first use and kept, so one instance serves every request."""

    tokenizer: Tokenizer
    vocab_size: int
    eos_id: int
    n_classes: int
    form: str = "json"
    block_length: int = 32  # the engine's: the end token fills the call's last block
    _texts: TokenTexts | None = field(default=None, init=False, repr=False)
    _classes: dict[Any, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"unknown call form {self.form!r}; choose one of {', '.join(FORMS)}")

    def prepare(self) -> None:
        """Read the vocabulary's token texts now (a start-up cost, off any request's path)."""
        if self._texts is None:
            self._texts = TokenTexts(self.tokenizer, self.vocab_size)

    def tokens(self, context: str, piece: str) -> list[int]:
        """`piece`'s tokens as they follow `context` (those of context + piece after context's own, where the
        tokenizer keeps context's tokens; else the piece's alone)."""
        enc = self.tokenizer.encode
        if context:
            before, both = enc(context), enc(context + piece)
            if both[:len(before)] == before:
                return both[len(before):]
        return enc(piece)

    def _class(self, key: Any, ok: Callable[[str], bool]) -> tuple[int, ...]:
        if len(self._classes) > 1024:  # (enums are the client's: keep the cache bounded)
            self._classes.clear()
        if key not in self._classes:
            if self._texts is None:
                self._texts = TokenTexts(self.tokenizer, self.vocab_size)
            self._classes[key] = self._texts.where(ok)
        return self._classes[key]

    def column_classes(self, schema: Mapping[str, Any], n: int) -> list[tuple[int, ...] | None]:
        """The tokens each of a value's `n` columns may take (None: any), by `schema`'s type."""
        js = self.form == "json"
        types = schema.get("type")
        kind = types if isinstance(types, str) else "any"
        enum = schema.get("enum")
        no_tag = self._class("no_tag", lambda t: "<" not in t)
        if isinstance(enum, list) and enum:
            words = tuple(json.dumps(v) if js or not isinstance(v, str) else v for v in enum)
            return [self._class(("enum", words), lambda t: any(t.strip() and t.strip() in w for w in words))] * n
        if kind == "integer":  # a sign (or a space) first only
            return [self._class("integer_first", lambda t: bool(re.fullmatch(r"\s?-?[0-9]+|\s?-", t)))] + \
                [self._class("integer", lambda t: bool(re.fullmatch(r"[0-9]+", t)))] * (n - 1)
        if kind == "number":
            return [self._class("number_first", lambda t: bool(re.fullmatch(r"\s?-?[0-9.]+|\s?-", t)))] + \
                [self._class("number", lambda t: bool(re.fullmatch(r"[-+0-9.eE]+", t)))] * (n - 1)
        if kind == "boolean":
            words = ("true", "false") if js else ("true", "false", "True", "False")
            return [self._class(("boolean", words), lambda t: any(t.strip() and t.strip() in w for w in words))] * n
        if kind == "string" and js:
            inner = self._class("string_inner", lambda t: not any(c in t for c in '"<\\\n'))
            if n == 1:
                return [self._class("string_whole", lambda t: bool(re.fullmatch(r'\s?"[^"<\\\n]*"', t)))]
            first = self._class("string_open", lambda t: bool(re.fullmatch(r'\s?"[^"<\\\n]*', t)))
            last = self._class("string_close", lambda t: bool(re.fullmatch(r'[^"<\\\n]*"', t)))
            return [first] + [inner] * (n - 2) + [last]
        return [no_tag] * n

    def frame(self, spec: ToolSpec, sizes: Mapping[str, int], before: Sequence[int] = (), lead: str = "",
              context: str = "") -> CallLayout | None:
        """`spec`'s call laid out after `before` (the answer's tokens before it, fixed as written: the model's own
        text up to and with its opening tag, when it opened the call, which the frame then goes on from) and `lead`
        (text before the opening tag the frame writes), each required key's value in a slot of `sizes[key]` columns
        (default by type), then the end token to the end of its block; `context`: the text before the call
        (tokenizing context). None when the token classes it needs are more than `n_classes`."""
        js = self.form == "json"
        props = spec.parameters.get("properties") or {}
        required = list(spec.parameters.get("required", []))
        keys = [k for k in props if k in required] + [k for k in required if k not in props]
        tokens: list[int] = list(before)
        columns: list[tuple[int, ...] | None] = [None] * len(tokens)
        slots = []
        text = context

        def add(piece: str) -> None:
            nonlocal text
            ids = self.tokens(text, piece)
            tokens.extend(ids)
            columns.extend([None] * len(ids))
            text = piece

        opened = self.tokenizer.decode(list(before)).rstrip().endswith(OPEN)
        head = ("" if opened else f"{lead}{OPEN}") + (f'{{"name": {json.dumps(spec.name)}, "arguments": {{' if js
                                  else f"\n<function={spec.name}>\n")
        for i, key in enumerate(keys):
            add(head + ((", " if i else "") + f"{json.dumps(key)}: " if js else f"<parameter={key}>\n"))
            schema = props.get(key) if isinstance(props.get(key), dict) else {}
            types = schema.get("type")
            n = max(2 if types == "string" and js else 1,  # (a JSON string's two quotes)
                    min(int(sizes.get(key) or DEFAULT_SIZE.get(types if isinstance(types, str) else "any", 4)),
                        MAX_SIZE))
            slots.append((key, len(tokens), len(tokens) + n))
            tokens.extend([-1] * n)
            columns.extend(self.column_classes(schema, n))
            text = "7" if types in ("integer", "number") else '"a"' if js else "a"
            head = "" if js else "\n</parameter>\n"
        add(head + ("}}" + CLOSE if js else "</function>\n" + CLOSE))
        end = len(tokens)
        pad = -(end + 1) % self.block_length + 1  # the end token, to the end of its block (nothing left to refine)
        tokens.extend([self.eos_id] * pad)
        columns.extend([None] * pad)
        groups = list(dict.fromkeys(c for c in columns if c is not None))
        if len(groups) > self.n_classes or not all(groups):  # (an empty class: this tokenizer cannot write it)
            return None
        classes = tuple(0 if c is None else groups.index(c) + 1 for c in columns)
        return CallLayout(spec, Scaffold(tuple(tokens), classes, tuple(groups)), tuple(slots), end)

    def read(self, layout: CallLayout, tokens: Sequence[int]) -> ParsedCall | None:
        """The call written into `layout` (`tokens`: the response from its first column), or None if a value does
        not parse as its type or the arguments do not fit the schema."""
        args: dict[str, Any] = {}
        for key, lo, hi in layout.slots:
            raw = self.tokenizer.decode(list(tokens[lo:hi])).strip()
            types = schema_types(layout.spec, key)
            if re.fullmatch(r"-?[0-9]+", raw) and ("integer" in types or "number" in types):
                args[key] = int(raw)  # (a slot filled whole may hold a leading zero, which JSON refuses)
            elif self.form == "json":
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    return None
            else:
                ok, args[key] = convert_value(raw, types)
                if not ok:
                    return None
        return ParsedCall(layout.spec.name, args) if check_arguments(layout.spec, args) else None

    def value_sizes(self, draft: str, spec: ToolSpec) -> dict[str, int]:
        """The tokens each of `spec`'s values took in `draft` (the model's own text of a call, parsed leniently:
        the first value after each key), for the keys found there."""
        out = {}
        draft = first_call(draft) or draft
        for key in (spec.parameters.get("properties") or {}):
            if self.form == "json":
                m = re.search(re.escape(json.dumps(key)) + r'\s*:\s*', draft)
                if m is None:
                    continue
                try:
                    _, end = json.JSONDecoder().raw_decode(draft, m.end())
                except ValueError:
                    continue
                value, context = draft[m.end():end], draft[:m.end()]
            else:
                m = re.search(f"<parameter={re.escape(key)}>\n(.*?)\n?</parameter>", draft, re.S)
                if m is None:
                    continue
                value, context = m.group(1), draft[:m.start(1)]
            out[key] = len(self.tokens(context, value))
        return out


def first_call(draft: str) -> str:
    """A draft's text from its first opening tag up to the next one (its first call, whole or not), or ""."""
    i = draft.find(OPEN)
    if i < 0:
        return ""
    j = draft.find(OPEN, i + len(OPEN))
    return draft[i:j if j >= 0 else len(draft)]


def drafted_tool(draft: str, tools: Sequence[ToolSpec]) -> ToolSpec | None:
    """The tool a draft's first call names (the longest name it names), or None."""
    call = first_call(draft)
    named = [t for t in tools if json.dumps(t.name) in call or f"<function={t.name}>" in call]
    return max(named, key=lambda t: len(t.name), default=None)


def opening(tokens: Sequence[int], decode: Callable[[list[int]], str], start: int = 0) -> int | None:
    """The tokens of a draft up to the end of its first opening tag at or after character `start` of its text (how
    many), or None when it opens no call there."""
    at = decode(list(tokens)).find(OPEN, start)
    if at < 0:
        return None
    lo, hi = 0, len(tokens)  # the fewest tokens whose text holds that tag (the text only grows with the tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(list(tokens[:mid]))) >= at + len(OPEN):
            hi = mid
        else:
            lo = mid + 1
    return lo
