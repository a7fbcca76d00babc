"""The short variants of the load and fault scripts (`benchmark/reliability/`): sustained mixed
load in two rounds (zero errors, every KV page back, RSS not growing), an abort storm, a huge
batch whose client hangs up while a stream runs, a connection flood past the open-file limit, SIGTERM under load, SIGSTOP/SIGCONT, and a scheduler
thread that dies or hangs. The documented full runs use the same code at full scale."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # repo root, for `benchmark`

from benchmark.reliability import faults  # noqa: E402
from benchmark.reliability.load import run_load  # noqa: E402


def test_mixed_load_in_two_rounds(tmp_path):
    report = run_load(tmp_path, streams=24, seconds=15.0, rounds=2)
    assert not report.problems, report.problems
    assert len(report.rounds) == 2
    for r in report.rounds:
        assert sum(r.requests.values()) >= 24 and not r.errors and r.pool_full


@pytest.mark.parametrize("name", list(faults.SCENARIOS))
def test_fault_scenario(tmp_path, name):
    outcome = faults.SCENARIOS[name](tmp_path, faults.SCALES["ci"])
    assert not outcome.problems, (outcome.problems, outcome.seen)
