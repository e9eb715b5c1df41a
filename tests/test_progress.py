"""Progress off a terminal is whole lines (one per tenth of the work, or a minute), never carriage-return frames;
on a terminal it is tqdm's bar."""

import io

from clover_jax.progress import LineProgress, progress_bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_off_a_terminal():
    out = io.StringIO()
    with progress_bar(2_000_000, "import", "clover convert", stream=out) as bar:
        assert isinstance(bar, LineProgress)
        for _ in range(40):
            bar.update(50_000)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10, lines  # one per tenth, however many updates
    assert lines[0].startswith("clover convert: import: 10% (200.0 kB of 2.0 MB, ")
    assert lines[-1].startswith("clover convert: import: 100% (2.0 MB of 2.0 MB, ")


def test_a_slow_tenth_still_says_something():
    out = io.StringIO()
    bar = LineProgress(100, "train", "clover train", unit="step", every_s=0.0, stream=out)
    bar.update(1)
    bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("clover train: train: ") for line in lines), lines
    assert "2% (2 of 100" in lines[1]


def test_a_bar_on_a_terminal_and_nothing_when_disabled():
    tty = _Tty()
    with progress_bar(10, "import", "clover convert", stream=tty, unit="step") as bar:
        assert not isinstance(bar, LineProgress)
        bar.update(10)
    assert "\r" in tty.getvalue() and "10/10" in tty.getvalue()
    quiet = io.StringIO()
    with progress_bar(10, "import", "clover convert", stream=quiet, enabled=False) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""
