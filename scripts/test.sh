#!/usr/bin/env bash
# Set up from nothing and run the test suite: a virtual environment in .venv, the package with the
# extras the tests need (torch for transformers parity, tpu for `clover plan`, notebooks, dev), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch first (on these machines it lies on disk); the `torch` extra's range admits it,
# so the extra installs nothing bigger.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[torch,tpu,notebooks,serve,docs,eval,dev]"

export JAX_PLATFORMS=cpu  # libtpu is installed for `clover plan`; tests run on (fake) CPU devices
ruff check .
# One pytest worker per core (pytest-xdist): most tests are single-threaded XLA compiles, so two
# workers on the 2-core CI machine take ~7.5 min instead of ~10.5. `--dist loadgroup` keeps the tests of
# one `xdist_group` (a module whose fixture compiles for a minute) on one worker. Extra arguments go to pytest.
# --timeout: a test that hangs (waiting on a thread, a socket, a subprocess) fails by name after 15 minutes, with
# every thread's stack printed, and the rest of the run goes on (the signal method leaves the worker alive).
python -m pytest -q -ra -n auto --dist loadgroup --durations=10 --timeout=900 "$@"
