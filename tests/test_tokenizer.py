"""Tokenizer: SentencePiece training with the clover special ids, loading, HuggingFace tokenizer.json."""

from __future__ import annotations

import os

import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerTrainError,
    load_tokenizer,
    read_training_text,
    train_sentencepiece,
)

WORDS = ["thou", "art", "the", "king", "of", "all", "the", "realm", "and", "I", "thy", "humble", "servant", "shall",
         "obey", "thee", "though", "night", "falls", "upon", "the", "castle", "walls", "where", "fortune", "smiles",
         "on", "none", "but", "fools"]


def corpus(n_lines: int = 400, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_lines):
        name = ("ROMEO", "JULIET", "KING HENRY")[i % 3]
        lines.append(f"{name}:\n" + " ".join(rng.choice(WORDS, size=rng.integers(4, 12))) + ",\n  and so on.\n")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tok") / "tokenizer")
    train_sentencepiece(corpus(), 320, out)
    return out


def test_train_load_round_trip_keeps_newlines_and_spaces(trained) -> None:
    tok = load_tokenizer(trained)
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 320
    text = "ROMEO:\nthou art  the king,\n\n  and so on.\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "\u00e9" in tok.decode(tok.encode("caf\u00e9"))  # byte fallback: unseen characters survive


def test_special_ids_match_clover_tiny(trained) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(trained, "tokenizer.model"))
    cfg = get_config("clover-tiny")
    assert sp.pad_id() == cfg.pad_token_id == 0
    assert sp.eos_id() == cfg.eos_token_id == 2
    assert sp.piece_to_id("[MASK]") == cfg.mask_token_id == 3
    assert sp.bos_id() == 1
    tok = load_tokenizer(trained)
    ids = tok.encode("[MASK] king")
    assert 3 not in ids  # a control symbol: text can never produce the mask id
    assert tok.decode([5, 3, 0]) == tok.decode([5])  # specials decode to nothing


def test_bad_input_is_rejected(tmp_path) -> None:
    with pytest.raises(TokenizerTrainError, match="must exceed the 262 reserved"):
        train_sentencepiece(corpus(), 200, str(tmp_path / "t"))
    with pytest.raises(TokenizerTrainError, match="does not exist"):
        read_training_text(str(tmp_path / "missing.txt"))
    assert not (tmp_path / "t").exists()


def test_holdout_leaves_out_the_tail(tmp_path) -> None:
    p = tmp_path / "c.txt"
    p.write_text("a" * 90 + "b" * 10)
    assert read_training_text(str(p), 0.1) == "a" * 90


def test_cli_train(tmp_path, capsys) -> None:
    from clover_jax.cli import main

    p = tmp_path / "c.txt"
    p.write_text(corpus())
    assert main(["tokenizer", "train", "--input", str(p), "--vocab-size", "340", "--output",
                 str(tmp_path / "tok")]) == 0
    assert "340 pieces" in capsys.readouterr().out
    assert load_tokenizer(str(tmp_path / "tok")).vocab_size == 340
    assert main(["tokenizer", "train", "--input", str(p), "--vocab-size", "100", "--output", str(tmp_path / "x")]) == 2


def test_hf_tokenizer_json(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = __import__("tokenizers.decoders", fromlist=["ByteLevel"]).ByteLevel()
    tk.train_from_iterator(corpus().splitlines(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<mask>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"}')
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == tk.get_vocab_size()
    text = "KING HENRY:\nthou art the king"
    assert tok.encode(text) == tk.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template("hi") == "<|user|>hi<|assistant|>"
