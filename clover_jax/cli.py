"""`clover` command line: each module in clover_jax/commands adds one subcommand.

Subcommand modules define `register(subparsers)`; they import heavy dependencies (JAX, torch)
inside their run functions so that `clover --help` and argument errors stay instant.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from clover_jax import __version__, commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clover", description="Clover-JAX: masked-diffusion MoE language models in JAX.")
    parser.add_argument("--version", action="version", version=f"clover-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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
    except UserError as e:
        print(f"clover {args.command}: error: {e}", file=sys.stderr)
        return 2


class UserError(Exception):
    """Bad input from the command line: printed as one line, exit code 2, no traceback."""


if __name__ == "__main__":
    sys.exit(main())
