"""`clover` command line: one module in clover_jax/commands per subcommand, listed in COMMANDS.

Each command module defines `register(subparsers)` and a `run(args)`. Any `CloverError` (the base of
every error a user can cause) and any OSError on a file the user named (a read-only filesystem, a
directory where a file should be) is printed as one line with exit code 2; `--debug` or
`CLOVER_DEBUG=1` shows the traceback as well. Anything else is a bug and keeps its traceback.
Compiled programs are cached on disk across runs (`compile_cache`; `--compile-cache DIR|off` or
`$CLOVER_COMPILE_CACHE`). A run starts only the JAX backends this host has (`platforms`: no TPU runtime, and none
of its start-up warnings, on a host without a TPU chip); `--verbose` says which backend it runs on.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

from clover_jax import compile_cache, platforms
from clover_jax.commands import convert, generate, info, plan, serve, tokenizer, train
from clover_jax.commands import eval as eval_command
from clover_jax.errors import CloverError, did_you_mean
from clover_jax.version import __version__

COMMANDS = (convert, eval_command, generate, info, plan, serve, tokenizer, train)


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (`clover generate: error: ...`, exit code 2) with the
    closest spelling of a mistyped command, flag or choice, instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {_with_suggestion(message)} (see {self.prog} --help)\n")

    def unknown_flags(self, extras: list[str]) -> None:
        """Refuse the arguments `parse_known_args` left over, suggesting the closest flag of this parser."""
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for arg in extras:
            if arg.startswith("-"):
                name = arg.split("=", 1)[0]
                self.exit(2, f"{self.prog}: error: unknown flag {name}{did_you_mean(name, flags)} "
                             f"(see {self.prog} --help)\n")
        self.error(f"unexpected arguments: {' '.join(extras)}")


def _with_suggestion(message: str) -> str:
    """argparse's "invalid choice: 'x' (choose from ...)" with the closest choice named."""
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m:
        choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
        return message + did_you_mean(m.group(1), choices)
    return message


_GLOBAL_SWITCHES = {"--verbose", "--debug"}  # `clover`'s own switches, also taken after the command


def build_parser() -> Parser:
    """The `clover` parser with every subcommand."""
    parser = Parser(prog="clover", description="Clover-JAX: masked-diffusion MoE language models in JAX.")
    parser.add_argument("--version", action="version", version=f"clover-jax {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error too (or set CLOVER_DEBUG=1)")
    parser.add_argument("--compile-cache", metavar="DIR|off", default=None,
                        help=f"where compiled programs are kept across runs (default ${compile_cache.ENV}, else "
                             f"{compile_cache.default_dir()}); off: compile from scratch every time")
    parser.add_argument("--verbose", action="store_true", help="say which backend and devices the run uses")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `clover ARGV`; returns the exit code."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    for flag in _GLOBAL_SWITCHES.intersection(extras):  # `clover generate --verbose ...` means `clover --verbose ...`
        setattr(args, flag.removeprefix("--"), True)
        extras = [x for x in extras if x != flag]
    if extras:
        sub = _subparser(parser, getattr(args, "command", None))
        (sub or parser).unknown_flags(extras)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("CLOVER_DEBUG", "") not in ("", "0")
    platforms.choose()
    if args.verbose:
        print(f"clover {args.command}: {platforms.describe()}", file=sys.stderr)
    compile_cache.configure(args.compile_cache)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (CloverError, OSError) as e:
        if debug:
            traceback.print_exc()
        print(f"clover {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _subparser(parser: Parser, command: str | None) -> Parser | None:
    """The parser of `clover COMMAND`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


def _one_line(e: BaseException) -> str:
    """The message of `e`; an OSError as 'PATH: reason'."""
    if isinstance(e, OSError) and not isinstance(e, CloverError) and e.strerror:
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f)
        return f"{where}: {e.strerror}" if where else e.strerror
    return str(e) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
