"""Tokenizers: SentencePiece, HuggingFace tokenizer.json and byte-level (`tokenizers`), and training a
SentencePiece tokenizer with the Clover special ids (`train`)."""

from clover_jax.errors import TokenizerError, TokenizerTrainError
from clover_jax.tokenizer.tokenizers import (
    TOKENIZER_FILES,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)
from clover_jax.tokenizer.train import read_training_text, train_sentencepiece

__all__ = ["TOKENIZER_FILES", "ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer",
           "TokenizerError", "TokenizerTrainError", "load_tokenizer", "read_training_text", "train_sentencepiece"]
