"""A newcomer's first hour, scripted: the wheel built from a copy of the source, installed with its base
dependencies only (no extras: no torch, no transformers, no libtpu) into a fresh virtual environment, and the
first commands run with that environment's `clover` from a scratch directory, in a newcomer's environment (no
JAX_PLATFORMS, no XLA_FLAGS, an empty compile cache): the README's first command, `clover info --list`, a
conversion of a published-layout checkpoint and a generation from it, and `clover convert --check`. Then the
first mistakes: each is exit status 2 and one line on stderr, no traceback.

Last, in the development environment (which has libtpu, from the `tpu` extra): with JAX_PLATFORMS unset the CLI
itself keeps libtpu's start-up warnings out of stderr on a host without a TPU (clover_jax/platforms.py).

The fixture needs a package index (pip fetches jax, flax, ... into the new environment; with pip's cache warm,
as after scripts/test.sh, it takes about a minute); without one the tests fail, they do not skip."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_wheel import REPO, _source_copy

# One worker builds the environment once; the install and the compiles take a few minutes together.
pytestmark = [pytest.mark.xdist_group("first_hour"), pytest.mark.timeout(1800)]

FIXTURE = REPO / "tests" / "fixtures" / "published" / "clover_moe_vl_tiny"
# What a newcomer's shell does not have: the test run's own settings (tests/conftest.py, scripts/test.sh), and
# what importing JAX in this process put in its environment (with libtpu installed, TPU_LIBRARY_PATH names this
# venv's libtpu.so: inherited, a fresh venv's JAX would start it too) and TF_CPP_MIN_LOG_LEVEL.
_NOT_A_NEWCOMERS = ("JAX_PLATFORMS", "XLA_FLAGS", "CLOVER_COMPILE_CACHE", "CLOVER_DEBUG", "PYTHONPATH",
                    "PYTHONHOME", "VIRTUAL_ENV", "TF_CPP_MIN_LOG_LEVEL")

# What libtpu writes to stderr when its runtime starts on a host without a TPU chip.
_LIBTPU_NOISE = ("E0000", "libtpu", "TPU", "host bounds", "metadata", "unexpected worker hostname")


def _shell_env() -> dict[str, str]:
    """This process's environment less the settings above and every TPU_* variable."""
    return {k: v for k, v in os.environ.items()
            if k not in _NOT_A_NEWCOMERS and not k.startswith(("TPU_", "PYTEST_"))}


def readme_first_command() -> list[str]:
    """The `clover` command that ends the README's first code block (`python3 -m venv .venv && ... && clover ...`)."""
    block = re.search(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md has no bash block"
    command = shlex.split(block.group(1).split("&&")[-1])
    assert command[0] == "clover", block.group(1)
    return command


@dataclass
class Fresh:
    """The fresh virtual environment, a scratch directory to work in and the environment variables to run with."""

    venv: Path
    scratch: Path
    env: dict[str, str]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def clover(self, *args: str, cache: Path | None = None, **extra: str) -> subprocess.CompletedProcess:
        env = {**self.env, **extra} if cache is None else {**self.env, "XDG_CACHE_HOME": str(cache), **extra}
        return subprocess.run([str(self.venv / "bin" / "clover"), *args], cwd=self.scratch, env=env,
                              capture_output=True, text=True, timeout=900)


def _newcomer_env(venv: Path, cache: Path) -> dict[str, str]:
    env = _shell_env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["XDG_CACHE_HOME"] = str(cache)  # the compile cache starts empty, as on a new machine
    return env


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Fresh:
    """The wheel (pip wheel --no-deps from a copy of the source) installed with its base dependencies into a new
    virtual environment without the system's site packages."""
    work = tmp_path_factory.mktemp("first_hour")
    source = _source_copy(work / "source")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"),
                            str(source)], cwd=work, capture_output=True, text=True)
    if built.returncode != 0:  # its isolated build fetches setuptools from the index
        pytest.fail(f"pip wheel could not build the project (exit {built.returncode}); its build needs a reachable "
                    f"package index (CI always has one)\n{_tail(built.stderr)}")
    (wheel,) = (work / "dist").glob("clover_jax-*.whl")
    assert "clover_jax/_shipped/clover-tiny/config.json" in zipfile.ZipFile(wheel).namelist()

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    try:
        installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
                                   cwd=work, env=_shell_env(), capture_output=True, text=True, timeout=1500)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"pip install of the wheel into a fresh venv did not finish in {e.timeout} s: is the package "
                    f"index reachable? (CI always has it)\n{_tail(str(e.stderr or ''))}")
    if installed.returncode != 0:
        pytest.fail(f"pip could not install the wheel with its base dependencies into a fresh venv (exit "
                    f"{installed.returncode}): a package index must be reachable (CI always has one)\n"
                    f"{_tail(installed.stderr)}")
    scratch = work / "scratch"
    scratch.mkdir()
    return Fresh(venv, scratch, _newcomer_env(venv, work / "cache"))


def _ok(res: subprocess.CompletedProcess, command: str) -> None:
    """Exit 0, output on stdout, no traceback, none of libtpu's start-up lines."""
    shown = f"`{command}`: exit {res.returncode}\nstdout:\n{_tail(res.stdout)}\nstderr:\n{_tail(res.stderr)}"
    assert res.returncode == 0, shown
    assert res.stdout.strip(), shown
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, shown
    noise = [line for line in res.stderr.splitlines() if any(s in line for s in _LIBTPU_NOISE)]
    assert not noise, f"libtpu wrote to stderr: {shown}"


def test_the_fresh_venv_has_the_base_install_only(fresh):
    torch = subprocess.run([str(fresh.python), "-c", "import torch"], capture_output=True, text=True,
                           env=fresh.env, cwd=fresh.scratch)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr, torch
    code = ("import importlib.util as u, clover_jax; print(clover_jax.__file__); "
            "print(*[m for m in ('transformers', 'libtpu') if u.find_spec(m)])")
    res = subprocess.run([str(fresh.python), "-c", code], capture_output=True, text=True, check=True,
                         env=fresh.env, cwd=fresh.scratch)
    module, extras = res.stdout.splitlines()
    assert module.startswith(str(fresh.venv)), module  # the wheel's copy, not the checkout's
    assert extras == "", f"the base install brought {extras}"


def test_the_first_commands(fresh):
    readme = readme_first_command()
    converted = fresh.scratch.parent / "converted"
    started = time.perf_counter()
    res = fresh.clover(*readme[1:])
    first_run = time.perf_counter() - started
    print(f"\nfirst run, `{shlex.join(readme)}` in the fresh venv (empty compile cache): {first_run:.1f} s")
    _ok(res, shlex.join(readme))
    assert "RANDOM weights" not in res.stderr and "forward passes" in res.stderr, res.stderr  # the shipped model

    res = fresh.clover("info", "--list")
    _ok(res, "clover info --list")
    assert "clover-tiny" in res.stdout.split(), res.stdout

    res = fresh.clover("convert", str(FIXTURE), str(converted))
    _ok(res, "clover convert")
    assert (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file()

    res = fresh.clover("generate", "--model", str(converted), "hello", "--gen-length", "32")
    _ok(res, "clover generate --model <converted>")
    assert "forward passes" in res.stderr and "RANDOM weights" not in res.stderr, res.stderr

    res = fresh.clover("convert", "--check", str(FIXTURE))
    _ok(res, "clover convert --check")
    assert re.search(r"^OK ", res.stdout, re.M), res.stdout


def test_the_first_run_time(fresh, record_property):
    """What a newcomer waits for the documented first command (docs/generating.md): a new process, an empty
    compile cache. Reported, not asserted (tests never assert on wall time)."""
    started = time.perf_counter()
    res = fresh.clover("generate", "ROMEO:", "--gen-length", "32", cache=fresh.scratch.parent / "timing-cache")
    seconds = time.perf_counter() - started
    _ok(res, 'clover generate "ROMEO:" --gen-length 32')
    record_property("first_run_seconds", round(seconds, 1))
    print(f'\n`clover generate "ROMEO:" --gen-length 32`, fresh venv, empty compile cache: {seconds:.1f} s '
          f"({res.stderr.strip().splitlines()[-1]})")


@pytest.fixture(scope="module")
def untokenized(fresh) -> Path:
    """A converted model whose tokenizer files were deleted."""
    out = fresh.scratch.parent / "untokenized"
    res = fresh.clover("convert", str(FIXTURE), str(out))
    assert res.returncode == 0, res.stderr
    gone = list(out.glob("tokenizer*"))
    assert gone, sorted(p.name for p in out.iterdir())
    for f in gone:
        f.unlink()
    return out


# name -> (the arguments after `clover`, what the one line must say after `clover generate: error: `);
# the messages are those tests/test_newcomer.py checks in process.
MISTAKES = {
    "a mistyped flag": (["generate", "--gen-lenght", "64", "ROMEO:"],
                        r"unknown flag --gen-lenght \(did you mean --gen-length\?\)"),
    "a model that is not there": (["generate", "--model", "{scratch}/no-such-model", "ROMEO:"],
                                  r"--model '.*no-such-model' is neither a checkpoint directory nor a preset"),
    "a threshold out of range": (["generate", "--threshold", "2", "ROMEO:"],
                                 r"--threshold must be a number in \(0, 1\] \(or 0 = off\), got 2"),
    "a prompt too long": (["generate", "word " * 2000],
                          r"the prompt has \d+ tokens; with --gen-length \d+ that is \d+ > the model's max_seq_len"),
    "a model without its tokenizer": (["generate", "--model", "{untokenized}", "hello", "--gen-length", "32"],
                                      r".*untokenized has no tokenizer \(tokenizer.json or tokenizer.model\), though "
                                      r"it was converted from a HuggingFace checkpoint"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_first_mistake_is_one_error_line(fresh, request, mistake):
    args, says = MISTAKES[mistake]
    places = {"scratch": str(fresh.scratch)}
    if any("{untokenized}" in a for a in args):
        places["untokenized"] = str(request.getfixturevalue("untokenized"))
    args = [a.format(**places) if "{" in a else a for a in args]
    res = fresh.clover(*args)
    shown = (f"`clover {shlex.join(args)[:200]}`: exit {res.returncode}\nstdout:\n{_tail(res.stdout, 1000)}\n"
             f"stderr:\n{_tail(res.stderr)}")
    assert res.returncode == 2, shown
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, shown
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    # the error is the last line, and the only one; what comes before it is the command's own notes of what it
    # was doing (where its defaults came from, "loading ..."), never more than those
    assert lines and all(line.startswith("clover generate: ") for line in lines), shown
    assert [line for line in lines if ": error: " in line] == lines[-1:], shown
    assert re.match(r"clover generate: error: " + says, lines[-1]), shown
    assert len(lines) <= 3, shown


def test_the_cli_keeps_libtpu_quiet_on_a_cpu_host(tmp_path):
    """In the development environment (libtpu installed, no TPU chip here) with JAX_PLATFORMS unset, as a user's
    shell has it: only the command's own lines on stderr, and `--verbose` names the CPU backend."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.fail("libtpu is not installed in this environment: the `tpu` extra is missing "
                    "(pip install -e '.[tpu]'; scripts/test.sh installs it)")
    env = _shell_env()
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    runs = (["generate", "ROMEO:", "--gen-length", "32"], ["info", "--list"],
            ["--verbose", "info", "--list"], ["--verbose", "generate", "ROMEO:", "--gen-length", "32"])
    for args in runs:
        res = subprocess.run([sys.executable, "-m", "clover_jax", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        command = f"python -m clover_jax {shlex.join(args)}"
        _ok(res, command)  # JAX_PLATFORMS unset: no line of libtpu's
        named = [line for line in res.stderr.splitlines() if "backend" in line]
        if "--verbose" in args:
            assert len(named) == 1, f"`{command}`:\n{res.stderr}"
            assert re.fullmatch(rf"clover {args[1]}: backend cpu: \d+ devices? \(cpu\)", named[0]), named
        else:
            assert not named, f"`{command}`:\n{res.stderr}"


def test_a_libtpu_named_by_tpu_library_path_stays_quiet(fresh):
    """A shell that names a libtpu with TPU_LIBRARY_PATH (no `libtpu` package installed, as in the fresh venv) gets
    the same quiet CPU run: JAX would load that library and print its start-up lines."""
    spec = importlib.util.find_spec("libtpu")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("libtpu is not installed in this environment: the `tpu` extra is missing")
    (library,) = Path(next(iter(spec.submodule_search_locations))).glob("libtpu*.so")
    res = fresh.clover("--verbose", "info", "--list", TPU_LIBRARY_PATH=str(library))
    _ok(res, "TPU_LIBRARY_PATH=... clover --verbose info --list")
    assert re.search(r"clover info: backend cpu: \d+ devices? \(cpu\)", res.stderr), res.stderr
    late = fresh.clover("info", "--list", "--verbose")  # the switch after the command is the same switch
    _ok(late, "clover info --list --verbose")
    assert re.search(r"clover info: backend cpu", late.stderr), late.stderr
