"""Tokenizers behind one small interface: SentencePiece (the shipped models), HuggingFace `tokenizer.json`
(converted checkpoints; read with the `tokenizers` package, a base dependency) and a byte-level fallback for
randomly initialised models, which have no trained vocabulary.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import sentencepiece as spm

from clover_jax.errors import TokenizerError
from clover_jax.tokenizer.chat_template import render_chat_template, template_syntax_error

# Files a checkpoint directory may carry; conversion copies whichever exist.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


class Tokenizer(Protocol):
    """What the sampler and the commands need of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; ids outside the vocabulary are skipped."""
        ...

    def apply_chat_template(self, prompt: str, **template_vars: Any) -> str | None:
        """`prompt` as one user turn of the chat template (`template_vars`: further variables of the template, e.g.
        `enable_thinking`), or None when there is no template."""
        ...


@dataclass
class ByteTokenizer:
    """UTF-8 bytes shifted past `n_special` reserved ids (pad=0, bos=1, eos=2, mask=3 by default)."""

    n_special: int = 4
    vocab_size: int = 260

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, each shifted by `n_special`."""
        return [b + self.n_special for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """The text of the byte ids; special and out-of-range ids are skipped, bad UTF-8 replaced."""
        data = bytes(i - self.n_special for i in ids if self.n_special <= i < self.n_special + 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, prompt: str, **template_vars: Any) -> str | None:
        """None: a byte-level vocabulary has no chat template."""
        return None


@dataclass
class SentencePieceTokenizer:
    """A SentencePiece `tokenizer.model` (the shipped models); no chat template."""

    path: str
    _sp: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{self.path}: not a SentencePiece model ({_first_line(e)})") from e
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """SentencePiece ids of `text` (no BOS/EOS added)."""
        return list(self._sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; ids outside the vocabulary are skipped."""
        return self._sp.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

    def apply_chat_template(self, prompt: str, **template_vars: Any) -> str | None:
        """None: a SentencePiece model carries no chat template."""
        return None


@dataclass
class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` package, plus the chat template if present
    (`chat_template`: its jinja source, which `clover_jax.serving.chat` renders whole conversations with)."""

    directory: str
    _tok: object = field(init=False, repr=False)
    chat_template: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        from tokenizers import Tokenizer as _Tok  # a base dependency, imported only when a tokenizer.json is read

        path = os.path.join(self.directory, "tokenizer.json")
        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # the tokenizers package raises a bare Exception for a file it cannot read
            raise TokenizerError(f"{path}: not a tokenizer.json the tokenizers package can read "
                                 f"({_first_line(e)})") from e
        self.vocab_size = self._tok.get_vocab_size()
        self.chat_template = _read_chat_template(self.directory)

    def encode(self, text: str) -> list[int]:
        """tokenizer.json ids of `text`, without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, as the `tokenizers` package decodes them."""
        return self._tok.decode([int(i) for i in ids])

    def apply_chat_template(self, prompt: str, **template_vars: Any) -> str | None:
        """`prompt` as one user turn of the checkpoint's jinja chat template (with the generation
        prompt; `template_vars` such as `enable_thinking` passed to it), or None when the checkpoint has none."""
        if not self.chat_template:
            return None
        return render_chat_template(self.chat_template, [{"role": "user", "content": prompt}], **template_vars)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_chat_template(directory: str) -> str | None:
    """The checkpoint's chat template (chat_template.jinja, else tokenizer_config.json's "chat_template"), checked
    to parse; None when there is none. TokenizerError naming the file and field for one that cannot be read."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                tpl, where = f.read(), jinja
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja}: cannot be read as UTF-8 text ({_first_line(e)})") from e
    else:
        cfg = os.path.join(directory, "tokenizer_config.json")
        if not os.path.exists(cfg):
            return None
        try:
            with open(cfg, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(f"{cfg}: not valid JSON ({_first_line(e)})") from e
        if not isinstance(data, dict):
            raise TokenizerError(f"{cfg}: expected a JSON object, got {type(data).__name__}")
        tpl, where = data.get("chat_template"), f"{cfg}: chat_template"
        if tpl is None:
            return None
        if isinstance(tpl, list):  # named templates ({"name", "template"}): transformers renders "default"
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
            if tpl is None:
                return None
        if not isinstance(tpl, str):
            raise TokenizerError(f"{where}: expected a string (one jinja template), got {type(tpl).__name__}")
    problem = template_syntax_error(tpl)
    if problem:
        raise TokenizerError(f"{where}: the chat template does not parse ({problem})")
    return tpl


def load_tokenizer(directory: str | None) -> Tokenizer:
    """The tokenizer stored in a checkpoint directory; byte-level when there is none. TokenizerError, naming the
    file, for a tokenizer or chat template that cannot be read (conversion calls this to refuse a damaged
    download before writing anything)."""
    if directory:
        if os.path.exists(os.path.join(directory, "tokenizer.model")):
            return SentencePieceTokenizer(os.path.join(directory, "tokenizer.model"))
        if os.path.exists(os.path.join(directory, "tokenizer.json")):
            return HFTokenizer(directory)
    return ByteTokenizer()
