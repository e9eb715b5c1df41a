"""The documentation cannot drift from the code: the site builds with `mkdocs build --strict` (offline), every flag
of every `clover` command is on its page and every flag the pages and the README use exists, the shell blocks
marked runnable run, and the user-facing text says nothing about how the project is made.

Markers in the markdown (HTML comments, invisible on GitHub and on the site):

- `<!-- flags: clover generate -->` before the table that documents that command's flags;
- `<!-- runnable -->` before a ```bash block whose commands a test runs (quick ones only); each line is one command;
- `<!-- runnable: python -->` before a ```python block a test runs whole (in a scratch directory);
- `<!-- run by tests/NAME.py -->` before a block another test runs as written;
- `<!-- not run: REASON -->` before any other ```bash or ```python block: why no test can run it (a TPU, a download).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(Path(p) for p in glob.glob(str(DOCS / "**" / "*.md"), recursive=True))
TEXTS = [README, *PAGES]
FLAGS_MARK = re.compile(r"^<!-- flags: (clover(?: [a-z]+)*) -->$")
RUNNABLE_MARK = "<!-- runnable -->"
RUNNABLE_PYTHON = "<!-- runnable: python -->"
RUN_BY = re.compile(r"^<!-- run by (tests/\w+\.py) -->$")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*\S) -->$")
FLAG = re.compile(r"--[A-Za-z0-9][\w-]*")
# What must not reach a reader: issue numbers and talk about how the project is developed.
DEV_TALK = re.compile(r"(?<![\w/&#])#\d+\b|\b(?:issues?|sessions?|the lead|this task)\b", re.I)


# ---- the parser ------------------------------------------------------------------------------------------------


def _commands() -> dict[str, argparse.ArgumentParser]:
    """'clover', 'clover generate', 'clover tokenizer train', ... -> its parser (built without running anything)."""
    from clover_jax.cli import build_parser

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, sp in action.choices.items():
                    walk(f"{name} {sub}", sp)

    walk("clover", build_parser())
    return found


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, ...]]:
    """The long option strings of each optional action (aliases together), without --help."""
    return [tuple(o for o in a.option_strings if o.startswith("--")) for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


COMMANDS = _commands()


# ---- markdown helpers ------------------------------------------------------------------------------------------


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _flag_tables() -> dict[str, list[tuple[Path, list[str]]]]:
    """command -> [(page, the flags named in the first column of the table after its marker)]."""
    tables: dict[str, list[tuple[Path, list[str]]]] = {}
    for page in TEXTS:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = FLAGS_MARK.match(line.strip())
            if not m:
                continue
            rows = []
            for row in lines[i + 1:]:
                if not row.strip():
                    if rows:
                        break
                    continue
                if not row.startswith("|"):
                    break
                rows.append(row)
            assert len(rows) > 2, f"{_rel(page)}:{i + 1}: a flags marker must be followed by a table"
            flags = []
            for row in rows[2:]:  # after the header and the |---| line
                first = row.split("|")[1]
                flags += FLAG.findall(" ".join(re.findall(r"`([^`]*)`", first)))
            tables.setdefault(m.group(1), []).append((page, flags))
    return tables


def _fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line index of the opening fence, info string, body) of every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)(.*)$", lines[i])
        if m:
            fence, start = m.group(2), i
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i])
                i += 1
            blocks.append((start, m.group(3).strip(), "\n".join(body)))
        i += 1
    return blocks


def _prose(text: str) -> str:
    """`text` without its fenced code blocks."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.S | re.M)


def _command_lines(text: str) -> list[str]:
    """Shell lines of the code blocks (continuations joined, prompts stripped) and inline code spans."""
    out = []
    for _, _, body in _fenced_blocks(text):
        for line in body.replace("\\\n", " ").splitlines():
            out.append(line.strip().removeprefix("$ "))
    out += re.findall(r"`([^`\n]+)`", _prose(text))
    return out


def _runnable() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command in a block marked runnable, each distinct command once."""
    seen: dict[tuple[str, ...], str] = {}
    for page in TEXTS:
        text = page.read_text(encoding="utf-8")
        lines = text.splitlines()
        blocks = {start: (info, body) for start, info, body in _fenced_blocks(text)}
        for i, line in enumerate(lines):
            if line.strip() != RUNNABLE_MARK:
                continue
            nxt = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), None)
            assert nxt in blocks and blocks[nxt][0].split()[:1] == ["bash"], \
                f"{_rel(page)}:{i + 1}: {RUNNABLE_MARK} must stand right before a ```bash block"
            for cmd in blocks[nxt][1].replace("\\\n", " ").splitlines():
                argv = shlex.split(cmd, comments=True)
                if argv:
                    seen.setdefault(tuple(argv), f"{_rel(page)}:{nxt + 1}")
    return [(where, list(argv)) for argv, where in seen.items()]


def _benchmark_flags() -> dict[str, set[str]]:
    """benchmarks/NAME.py -> the option strings its argparse parser declares (read from the source)."""
    flags = {}
    for path in glob.glob(str(ROOT / "benchmarks" / "*.py")):
        src = Path(path).read_text(encoding="utf-8")
        flags[f"benchmarks/{Path(path).name}"] = set(re.findall(r"""["'](--[A-Za-z0-9][\w-]*)["']""", src))
    return flags


# ---- the site builds -------------------------------------------------------------------------------------------


def _missing_docs_packages() -> list[str]:
    """The `docs` extra's modules that are not installed."""
    missing = []
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is missing
            found = False
        if not found:
            missing.append(module)
    return missing


def test_mkdocs_build_strict(tmp_path: Path):
    missing = _missing_docs_packages()
    if missing:
        pytest.skip(f"the `docs` extra is not installed ({', '.join(missing)} missing): pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               # Offline: any attempt to fetch something at build time fails (and fails the strict build).
               HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9",
               http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", NO_PROXY="", no_proxy="")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert "WARNING" not in r.stderr, r.stderr
    for page in ("index.html", "generating/index.html", "benchmarks/index.html", "api/index.html",
                 "api/sampler/index.html"):
        assert (site / page).exists(), f"{page} was not built"
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("forward", "load_model", "save_model", "SamplerConfig", "ModelConfig", "get_config", "generate"):
        assert re.search(rf'id="clover_jax\.[\w.]*\b{name}"', api), f"the API page lacks {name}"
    # no web font or other remote asset in the pages
    html = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis" not in html and "fonts.gstatic" not in html


# ---- flags -----------------------------------------------------------------------------------------------------

FLAG_TABLES = _flag_tables()


@pytest.mark.parametrize("command", [c for c in COMMANDS if _options(COMMANDS[c])])
def test_every_flag_is_on_its_page(command: str):
    tables = FLAG_TABLES.get(command, [])
    assert len(tables) == 1, \
        f"`{command}` needs exactly one flags table (<!-- flags: {command} -->); found {len(tables)}"
    page, documented = tables[0]
    options = _options(COMMANDS[command])
    known = {o for opts in options for o in opts}
    text = page.read_text(encoding="utf-8")
    undocumented = [opts[0] for opts in options if not set(opts) & set(documented)]
    assert not undocumented, f"{_rel(page)}: the flags table of `{command}` lacks {undocumented}"
    unknown = sorted(set(documented) - known)
    assert not unknown, f"{_rel(page)}: the flags table of `{command}` documents flags it does not have: {unknown}"
    absent = [o for opts in options for o in opts if o not in text]
    assert not absent, f"{_rel(page)}: aliases of `{command}` not named on the page: {absent}"


def _check_clover_line(argv: list[str]) -> str | None:
    """A problem with the `clover ...` command line argv (flags that do not exist), or None."""
    parser, name, i = COMMANDS["clover"], "clover", 1
    while i < len(argv):
        tok = argv[i]
        subs = _subparsers(parser)
        if tok.startswith("-"):
            break
        if not subs:
            break
        if tok not in subs:
            # placeholders and text that merely starts with `clover` (`clover COMMAND: error`, `clover plan: ...`)
            return None if (tok.isupper() or tok.endswith(":") or tok in ("...", "")) else \
                f"`{name} {tok}`: no such command"
        parser, name = subs[tok], f"{name} {tok}"
        i += 1
    known = {o for opts in _options(parser) for o in opts} | {"--help", "-h"}
    if name != "clover":
        known |= {o for opts in _options(COMMANDS["clover"]) for o in opts}
    stop = {"|", "||", "&&", ";", ">", ">>", "2>", "&"}
    bad = []
    for tok in argv[1:]:
        if tok in stop:
            break
        flag = tok.split("=", 1)[0]
        if FLAG.fullmatch(flag) and flag not in known:
            bad.append(flag)
    return f"`{name}` has no {bad}" if bad else None


def _split_shell(line: str) -> list[str] | None:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose
        return None


@pytest.mark.parametrize("path", TEXTS, ids=_rel)
def test_command_lines_use_existing_flags(path: Path):
    """Every `clover ...` and `python benchmarks/X.py ...` line of the page (code blocks and inline code) names
    commands and flags that exist; a flag quoted alone in the prose is one of clover's or a benchmark's."""
    text = path.read_text(encoding="utf-8")
    bench = _benchmark_flags()
    problems = []
    for line in _command_lines(text):
        argv = _split_shell(line)
        if not argv:
            continue
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):  # VAR=value prefixes
            argv = argv[1:]
        if argv[:1] == ["clover"]:
            problem = _check_clover_line(argv)
            if problem:
                problems.append(f"{line!r}: {problem}")
        elif argv[:1] == ["python"] and len(argv) > 1 and argv[1] in bench:
            flags = [t.split("=", 1)[0] for t in argv[2:]]
            bad = [f for f in flags if FLAG.fullmatch(f) and f not in bench[argv[1]]]
            if bad:
                problems.append(f"{line!r}: {argv[1]} has no {bad}")
    every = {o for p in COMMANDS.values() for opts in _options(p) for o in opts} | set().union(*bench.values())
    for span in re.findall(r"`([^`\n]+)`", _prose(text)):
        m = re.match(r"^(--[A-Za-z0-9][\w-]*)", span)
        if m and m.group(1) not in every and not m.group(1).startswith("--xla_"):
            problems.append(f"`{span}`: no clover command or benchmark has {m.group(1)}")
    assert not problems, f"{_rel(path)}:\n" + "\n".join(problems)


# ---- runnable blocks -------------------------------------------------------------------------------------------

RUNNABLE = _runnable()


def test_runnable_blocks_are_there():
    commands = [" ".join(argv) for _, argv in RUNNABLE]
    assert any(c.startswith("clover info") for c in commands)
    assert any(c.startswith("clover generate") for c in commands)
    assert any(c.startswith("clover convert --check tests/fixtures/") for c in commands)
    assert any("clover generate" in c and "--mesh" in c for c in commands)  # compared with one device there


@pytest.mark.parametrize(("where", "argv"), RUNNABLE, ids=[" ".join(a) for _, a in RUNNABLE])
def test_runnable_block(where: str, argv: list[str]):
    env = dict(os.environ)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, _, value = argv[0].partition("=")
        env[key] = value
        argv = argv[1:]
    assert argv[:1] == ["clover"], f"{where}: runnable blocks run `clover` commands; got {argv}"
    r = subprocess.run([sys.executable, "-m", "clover_jax", *argv[1:]], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{where}: {' '.join(argv)} exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert r.stdout.strip(), f"{where}: {' '.join(argv)} printed nothing"
    if argv[:2] == ["clover", "generate"] and "--mesh" in argv:
        # A sharded generation (greedy: no --temperature) gives the text the same command gives on one device
        # (the same environment, so the same XLA flags: only --mesh differs).
        i = argv.index("--mesh")
        assert "--temperature" not in argv
        one = subprocess.run([sys.executable, "-m", "clover_jax", *argv[1:i], *argv[i + 2:]], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert one.returncode == 0, one.stderr[-4000:]
        assert r.stdout == one.stdout, f"{where}: --mesh gave {r.stdout!r}, one device {one.stdout!r}"


def _marked_blocks() -> list[tuple[str, str, str, str]]:
    """(where, language, the marker line before it, body) of every ```bash and ```python block."""
    out = []
    for page in TEXTS:
        text = page.read_text(encoding="utf-8")
        lines = text.splitlines()
        for start, info, body in _fenced_blocks(text):
            lang = info.split()[0] if info.split() else ""
            if lang in ("bash", "python"):
                before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
                out.append((f"{_rel(page)}:{start + 1}", lang, before, body))
    return out


BLOCKS = _marked_blocks()
PYTHON_RUNNABLE = [(where, body) for where, lang, mark, body in BLOCKS if mark == RUNNABLE_PYTHON]


def test_every_code_block_runs_or_says_why_not():
    """Each ```bash / ```python block of the README and the pages is run by a test as written, or says why not."""
    problems = []
    for where, lang, mark, _ in BLOCKS:
        by = RUN_BY.match(mark)
        if by:
            test = ROOT / by.group(1)
            if not test.is_file() or where.split(":")[0] not in test.read_text(encoding="utf-8"):
                problems.append(f"{where}: {by.group(1)} does not run a block of {where.split(':')[0]}")
        elif not (NOT_RUN.match(mark) or (mark == RUNNABLE_MARK and lang == "bash")
                  or (mark == RUNNABLE_PYTHON and lang == "python")):
            problems.append(f"{where}: a ```{lang} block with neither a runnable marker nor '<!-- not run: REASON -->'")
    assert not problems, "\n".join(problems)
    assert len(PYTHON_RUNNABLE) >= 2  # the README's and Getting started's


@pytest.mark.parametrize(("where", "code"), PYTHON_RUNNABLE, ids=[w for w, _ in PYTHON_RUNNABLE])
def test_runnable_python_block(where: str, code: str, tmp_path: Path):
    """The block runs whole, as written, in a scratch directory (what it saves lands there)."""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, f"{where}: exited {r.returncode}\n{r.stderr[-4000:]}"
    assert "Traceback" not in r.stderr


# ---- the pages themselves --------------------------------------------------------------------------------------


def test_readme_is_short_and_keeps_the_quick_start():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    bash = [body.strip() for _, info, body in _fenced_blocks(text) if info.split()[:1] == ["bash"]]
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && clover generate \"ROMEO:\"" in bash
    assert "bash scripts/test.sh" in bash  # CI runs the README's test command


def test_links_between_readme_and_docs_resolve():
    """The README's relative links (GitHub's view; the site checks its own in the strict build)."""
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_images_exist_are_small_and_used():
    used = set()
    for page in TEXTS:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()
            assert path.exists(), f"{_rel(page)} shows {target}, which does not exist"
            used.add(path)
    images = {p.resolve() for p in (DOCS / "images").glob("*.png")}
    assert images, "docs/images/ holds the site's pictures (python scripts/docs_images.py)"
    for img in images:
        assert img.stat().st_size < 150_000, f"{img.name} is {img.stat().st_size} bytes; keep images under 150 KB"
    assert images <= used, f"pictures no page shows: {sorted(p.name for p in images - used)}"


def test_pages_are_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in PAGES:
        assert str(page.relative_to(DOCS)) in nav, f"{_rel(page)} is not in mkdocs.yml's nav"


def _help_texts() -> list[tuple[str, str]]:
    out = []
    for name, parser in COMMANDS.items():
        out += [(name, t) for t in (parser.description, parser.epilog) if t]
        out += [(name, a.help) for a in parser._actions if isinstance(a.help, str)]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += [(name, a.help) for a in action._choices_actions if a.help]
    return out


def _notebook_markdown() -> list[tuple[str, str]]:
    out = []
    for nb in sorted(glob.glob(str(ROOT / "notebooks" / "*.ipynb"))):
        for i, cell in enumerate(json.loads(Path(nb).read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] == "markdown":
                out.append((f"{Path(nb).name} cell {i}", "".join(cell["source"])))
    return out


def test_no_issue_numbers_or_development_talk():
    found = []
    for page in TEXTS:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if not line.lstrip().startswith("<!--") and DEV_TALK.search(line):
                found.append(f"{_rel(page)}:{n}: {line.strip()}")
    for where, text in _notebook_markdown() + [(f"`{c} --help`", t) for c, t in _help_texts()]:
        for line in text.splitlines():
            if DEV_TALK.search(line):
                found.append(f"{where}: {line.strip()}")
    assert not found, "user-facing text about issues or how the project is made:\n" + "\n".join(found)
