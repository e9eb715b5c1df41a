"""The mistakes a newcomer makes on the first commands: each is one line on stderr (`clover COMMAND: error: ...`),
exit code 2, no traceback, naming the flag, command or file as the user typed it, with the closest spelling of a
mistyped one. All are refused before any model is compiled."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest

from clover_jax.cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "published" / "clover_moe_vl_tiny"


def _mistakes(tmp: Path, port: int) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, what the one line must say)."""
    return {
        "a mistyped command": (["generat", "hi"], r"invalid choice: 'generat' .* \(did you mean generate\?\)"),
        "a mistyped flag": (["generate", "--gen-lenght", "64", "hi"],
                            r"unknown flag --gen-lenght \(did you mean --gen-length\?\)"),
        "a mistyped choice": (["generate", "--remasking", "low_confidance", "hi"],
                              r"--remasking must be one of .* got 'low_confidance' \(did you mean low_confidence\?\)"),
        "a model that is not there": (["generate", "--model", str(tmp / "no-such-model"), "hi"],
                                      r"--model '.*no-such-model' is neither a checkpoint directory nor a preset"),
        "a threshold out of range": (["generate", "--threshold", "2", "hi"],
                                     r"--threshold must be a number in \(0, 1\] \(or 0 = off\), got 2"),
        "a length that is not whole blocks": (["generate", "--gen-length", "30", "--block-length", "32", "hi"],
                                              r"--gen-length \(30\) must be a multiple of --block-length \(32\)"),
        "settings that contradict": (["generate", "--self-speculative", "--temperature", "0.7", "hi"],
                                     r"--self-speculative decodes greedily"),
        "a prompt too long": (["generate", "--model", "test-clover", "--gen-length", "32", "word " * 2000],
                              r"the prompt has 10000 tokens; with --gen-length 32 that is \d+ > the model's "
                              r"max_seq_len"),
        "a busy port": (["serve", "--model", "test-clover", "--port", str(port)],
                        rf"cannot listen on 127\.0\.0\.1:{port}: Address already in use"),
        "a conversion onto an existing directory": (["convert", str(tmp / "src"), str(tmp / "taken")],
                                                    r"taken already exists \(pass --force to replace it"),
        "a batch job's missing input": (["generate", "--input", str(tmp / "prompts.jsonl"), "--output",
                                         str(tmp / "out.jsonl")], r"cannot read --input '.*prompts\.jsonl'"),
        "training data that is not there": (["train", "--data", str(tmp / "corpus.txt"), "--out", str(tmp / "run")],
                                            r"--data '.*corpus\.txt' does not exist"),
    }


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory):
    """A scratch directory (a HuggingFace source to convert, a directory in the way) and a port something holds."""
    tmp = tmp_path_factory.mktemp("newcomer")
    shutil.copytree(FIXTURE, tmp / "src")
    (tmp / "taken").mkdir()
    (tmp / "taken" / "mine.txt").write_text("a user's file")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield tmp, holder.getsockname()[1]
    holder.close()


@pytest.mark.parametrize("mistake", list(_mistakes(Path("."), 0)))
def test_a_mistake_is_one_line_naming_what_was_typed(setting, capsys, mistake):
    tmp, port = setting
    argv, says = _mistakes(tmp, port)[mistake]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals exit from inside parse_args
        code = e.code
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2, captured
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    errors = [line for line in err if ": error: " in line]
    assert len(errors) == 1 and errors[0] == err[-1], err  # warnings and notes may come first; the error is one line
    assert re.match(r"clover( \w+)?: error: ", errors[0]), errors[0]
    assert re.search(says, errors[0]), errors[0]
    assert (tmp / "taken" / "mine.txt").read_text() == "a user's file"  # nothing a user owns is touched
