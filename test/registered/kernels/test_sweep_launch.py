"""`benchmark/kernels/sweep_launch.py` without a GPU: every candidate of every sweep target is
accepted by its launcher (the overridden keys exist in the meta function, the kernel launches)
and gives the default's bits at M = 1 on the benchmark inputs; the exactness check itself
rejects a launcher that leaves its poisoned output unwritten. Timing needs a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # repo root, for `benchmark`
from benchmark.kernels import sweep_launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


@pytest.mark.parametrize("key", sorted(sweep_launch.TARGETS))
def test_every_candidate_launches_and_matches_the_default(key: str) -> None:
    target = sweep_launch.TARGETS[key]
    assert 1 <= len(target.candidates) <= 12
    results = sweep_launch.check_candidates((key,), DEVICE, (1,))
    assert len(results) == len(target.cases) * len(target.candidates)
    bad = {k: v for k, v in results.items() if v != "ok"}
    if target.bits_may_differ and DEVICE == "cuda":  # another thread layout, other bits
        bad = {k: v for k, v in bad.items() if v != "differs"}
    assert not bad, bad


def test_meta_functions_restored_and_overrides_resolved() -> None:
    target = sweep_launch.TARGETS["shard_argmax"]
    module = sweep_launch._kernel_module(target)
    default = module._chunk_meta
    with sweep_launch._Patched(target, {"per_row": sweep_launch._double("per_row")}) as patched:
        assert module._chunk_meta is patched
        assert module._chunk_meta(32320, 128)["per_row"] == 2 * default(32320, 128)["per_row"]
    assert module._chunk_meta is default


def test_check_rejects_unwritten_outputs_and_unknown_keys() -> None:
    target = sweep_launch.TARGETS["moe_reduce"]
    case = sweep_launch._case(target, target.cases[0])
    inputs = case["make_inputs"](1, DEVICE)
    want = case["launcher"](**inputs)
    lazy = dict(case, launcher=lambda out=None, **kwargs: out)  # writes nothing
    status, _ = sweep_launch._check_one(target, lazy, inputs, want, {})
    assert status == "differs"
    status, _ = sweep_launch._check_one(target, case, inputs, want, {"BLOCK_X": 64})
    assert status.startswith("error: AssertionError")
    status, meta = sweep_launch._check_one(target, case, inputs, want, {"BLOCK_H": 1024})
    assert status == "ok" and meta == {"BLOCK_H": 1024, "num_warps": 4}


def test_report_rows_with_a_fake_timer(monkeypatch) -> None:
    """The report logic without a GPU: a fake timer (us = 2 + 0.1 * the candidate's warps) makes
    the fewest-warps exact candidate the best at every M."""
    from benchmark.kernels import run_all

    target = sweep_launch.TARGETS["fp4_index_k_quant"]
    module = sweep_launch._kernel_module(target)

    def fake_time_graph(fn, calls: int, replays: int) -> tuple[float, bool]:
        return 2.0 + 0.1 * module._k_quant_meta(1, 128)["num_warps"], True

    monkeypatch.setattr(run_all, "time_graph", fake_time_graph)
    lines = sweep_launch._sweep_case(
        target, target.cases[0], (1, 8), 20, 30, False, lambda text: None, device=DEVICE
    )
    summary = lines[: lines.index("")]
    assert len(summary) == 2
    default = module._k_quant_meta(1, 128)
    default_us = f"{2.0 + 0.1 * default['num_warps']:.2f}"
    for line, m in zip(summary, (1, 8)):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:5] == [
            target.cases[0],
            str(m),
            "-",
            f"{default_us} / {default_us}",
            " ".join(f"{k}={v}" for k, v in default.items()),
        ]
        # (one-warp candidates tie under the fake timer: any of them is a best)
        assert cells[5].endswith("num_warps=1") and cells[6] == "2.10"
    matrix = lines[lines.index("") + 1 :]
    assert matrix[2].startswith(f"| default | {default_us} | {default_us} |")
    assert len([row for row in matrix if row.startswith("| BLOCK_ROWS=")]) == len(target.candidates)
