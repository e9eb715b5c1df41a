"""The sampler's and the serving engine's tokens on a fixed set of requests, against those recorded in
tests/fixtures/golden/tokens.json (its recipe, `record.py`, lists the cases: every cache mode of both programs,
every remasking rule, threshold and entropy-bound commits, temperature with top-k / top-p, guidance, both block
grids and confidence rules, padded batches, serving rows with their own settings joining at different blocks).

A change to how a block is refined, committed or cached that moves one token fails here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
_spec = importlib.util.spec_from_file_location("golden_record", GOLDEN / "record.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)
EXPECTED = json.loads((GOLDEN / "tokens.json").read_text())
pytestmark = pytest.mark.xdist_group("golden")  # one worker converts and loads the models once


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    return record.load_models(str(tmp_path_factory.mktemp("golden")))


def test_every_case_is_recorded():
    assert sorted(EXPECTED["sampler"]) == sorted(c[0] for c in record.SAMPLER_CASES)
    assert sorted(EXPECTED["engine"]) == sorted(c[0] for c in record.ENGINE_CASES)


@pytest.mark.parametrize("case", record.SAMPLER_CASES, ids=[c[0] for c in record.SAMPLER_CASES])
def test_sampler_tokens(models, case):
    name, model, fields, kw = case
    assert record.run_sampler_case(models, model, fields, kw) == EXPECTED["sampler"][name]


@pytest.mark.parametrize("case", record.ENGINE_CASES, ids=[c[0] for c in record.ENGINE_CASES])
def test_engine_tokens(models, case):
    name, model, engine_kw, requests = case
    got = record.run_engine_case(models, model, engine_kw, requests, record.make_request)
    assert got == EXPECTED["engine"][name]
