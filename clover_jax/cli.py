"""`clover` command line: one module in clover_jax/commands per subcommand, listed in COMMANDS.

Each command module defines `register(subparsers)` and a `run(args)`. Any `CloverError` (the base of
every error a user can cause) is printed as one line with exit code 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from clover_jax.commands import convert, generate, info, plan, tokenizer, train
from clover_jax.errors import CloverError
from clover_jax.version import __version__

COMMANDS = (convert, generate, info, plan, tokenizer, train)


def build_parser() -> argparse.ArgumentParser:
    """The `clover` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="clover", description="Clover-JAX: masked-diffusion MoE language models in JAX.")
    parser.add_argument("--version", action="version", version=f"clover-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `clover ARGV`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except CloverError as e:
        print(f"clover {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
