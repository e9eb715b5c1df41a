"""`clover tokenizer train`: a SentencePiece tokenizer with the clover special ids (pad 0, bos 1, eos 2, mask 3)."""

from __future__ import annotations

import argparse

from clover_jax.tokenizer import load_tokenizer, read_training_text, train_sentencepiece
from clover_jax.tokenizer.train import check_output


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `tokenizer` subcommand and its `train` action to `sub`; `train` dispatches to `run`,
    no action prints the help and returns 2."""
    p = sub.add_parser("tokenizer", help="train a SentencePiece tokenizer")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    t = tsub.add_parser("train", help="train tokenizer.model from a text file")
    t.add_argument("--input", required=True, help="UTF-8 text file")
    t.add_argument("--vocab-size", type=int, required=True, help="pieces in all, including 262 reserved")
    t.add_argument("--output", required=True, help="directory to write tokenizer.model into")
    t.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    t.add_argument("--force", action="store_true", help="replace an existing tokenizer.model in --output")
    t.add_argument("--holdout", type=float, default=0.0,
                   help="leave out the last fraction of the file (keep eval text unseen), e.g. 0.05")
    t.set_defaults(func=run)
    p.set_defaults(func=lambda a: p.print_help() or 2)


def run(args: argparse.Namespace) -> int:
    """Train tokenizer.model from the text file and print its size and compression."""
    check_output(args.output, args.force)  # before reading or training anything
    text = read_training_text(args.input, args.holdout)
    path = train_sentencepiece(text, args.vocab_size, args.output, args.model_type, force=args.force)
    tok = load_tokenizer(args.output)
    n = len(tok.encode(text[:100_000]))
    print(f"wrote {path}: {tok.vocab_size} pieces, {min(len(text), 100_000) / max(n, 1):.2f} characters per token")
    return 0
