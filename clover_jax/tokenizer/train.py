"""Train a SentencePiece tokenizer whose special ids match the clover presets.

Reserved ids: pad=0, bos=1, eos=2, [MASK]=3 (a control symbol: never produced by `encode`), unk=4.
Newlines are a user-defined piece and the normaliser is the identity, so `decode(encode(text)) == text`
for verse and code alike (the default NFKC rules would fold newlines and runs of spaces away).
Byte fallback keeps unseen characters encodable.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Iterator

import sentencepiece as spm

from clover_jax.errors import TokenizerTrainError
from clover_jax.paths import unwritable_reason

PAD_ID, BOS_ID, EOS_ID, MASK_ID, UNK_ID = 0, 1, 2, 3, 4
MASK_PIECE = "[MASK]"
N_RESERVED = 6 + 256  # 5 special pieces, the newline piece, 256 byte-fallback pieces
MAX_CHUNK_CHARS = 4096



def _chunks(text: str) -> Iterator[str]:
    """Paragraphs with their newlines, split further at line ends when long (SentencePiece is line-based)."""
    for para in text.split("\n\n"):
        para = para + "\n\n"
        while len(para) > MAX_CHUNK_CHARS:
            cut = para.rfind("\n", 0, MAX_CHUNK_CHARS)
            cut = MAX_CHUNK_CHARS if cut <= 0 else cut + 1
            yield para[:cut]
            para = para[cut:]
        if para:
            yield para


def read_training_text(path: str, holdout: float = 0.0) -> str:
    """The text of `path` without its last `holdout` fraction (kept for evaluation)."""
    if not os.path.isfile(path):
        raise TokenizerTrainError(f"input file {path!r} does not exist")
    if not 0.0 <= holdout < 1.0:
        raise TokenizerTrainError(f"holdout must be in [0, 1), got {holdout}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise TokenizerTrainError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    return text[: len(text) - int(len(text) * holdout)]


def check_output(output_dir: str, force: bool) -> None:
    """TokenizerTrainError when `output_dir` already holds a tokenizer.model and not `force`, or is a file."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise TokenizerTrainError(f"--output {output_dir} is not a directory")
    reason = unwritable_reason(os.path.join(output_dir, "tokenizer.model"))
    if reason:
        raise TokenizerTrainError(f"--output {output_dir}: {reason}")
    if os.path.lexists(os.path.join(output_dir, "tokenizer.model")) and not force:
        raise TokenizerTrainError(f"{os.path.join(output_dir, 'tokenizer.model')} already exists (pass --force to "
                                  "replace it)")


def train_sentencepiece(text: str, vocab_size: int, output_dir: str, model_type: str = "bpe",
                        seed_sentences: int = 1_000_000, force: bool = False) -> str:
    """Train on `text`; write `output_dir/tokenizer.model` (atomically; an existing one only with `force`).
    Returns its path."""
    check_output(output_dir, force)
    if vocab_size <= N_RESERVED:
        raise TokenizerTrainError(f"vocab_size {vocab_size} must exceed the {N_RESERVED} reserved pieces "
                                  "(specials, newline, 256 bytes)")
    if model_type not in ("bpe", "unigram"):
        raise TokenizerTrainError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if len(text) < 1000:
        raise TokenizerTrainError(f"{len(text)} characters are too few to train a tokenizer")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_chunks(text), model_writer=buf, vocab_size=vocab_size, model_type=model_type,
            pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, control_symbols=[MASK_PIECE],
            user_defined_symbols=["\n"], normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, byte_fallback=True, split_digits=True, character_coverage=1.0,
            max_sentence_length=MAX_CHUNK_CHARS * 4, input_sentence_size=seed_sentences,
            shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as e:  # e.g. "Vocabulary size is too high"
        raise TokenizerTrainError(f"sentencepiece: {e}") from e
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    assert sp.piece_to_id(MASK_PIECE) == MASK_ID and sp.pad_id() == PAD_ID and sp.eos_id() == EOS_ID

    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer.tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
            f.write(buf.getvalue())
        os.makedirs(output_dir, exist_ok=True)
        os.replace(os.path.join(tmp, "tokenizer.model"), os.path.join(output_dir, "tokenizer.model"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(output_dir, "tokenizer.model")
