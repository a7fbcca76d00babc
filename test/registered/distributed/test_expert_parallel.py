"""Expert parallelism on spawned gloo ranks (one world of 4 for the module): the `exact`
combine gives logits bit-identical to one rank for prefill, chunked prefill, decode and DSpark
verify steps of widths 8, 5 and 3 with rollback, hence the same greedy output; `fast` stays
within float rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_engines import MAX_NEW, greedy_params, run_layout
from sgl_dspark.srt.distributed import ParallelLayout
from worlds import run_world

LAYOUTS = {
    "ep1": (ParallelLayout(1, 1), "exact"),
    "ep2": (ParallelLayout(1, 2), "exact"),
    "ep4": (ParallelLayout(1, 4), "exact"),
    "ep4_fast": (ParallelLayout(1, 4), "fast"),
}


def _world(rank: int, out_dir: Path) -> None:
    for name, (layout, combine) in LAYOUTS.items():
        for spec in (False, True):
            if name == "ep4_fast" and spec:
                continue
            tag = f"{name}_{'spec' if spec else 'plain'}"
            run_layout(rank, out_dir, tag, layout, combine, spec, greedy_params())
    for name in ("ep1", "ep4"):
        layout, combine = LAYOUTS[name]
        run_layout(rank, out_dir, f"{name}_graphs", layout, combine, True, greedy_params(), True)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("ep_world")
    run_world(4, _world, out)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


@pytest.mark.parametrize("name", ["ep2", "ep4"])
@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_exact_combine_is_bit_identical_to_one_rank(results, name, mode):
    ref, got = results[f"ep1_{mode}"], results[f"{name}_{mode}"]
    assert len(got["logits"]) == len(ref["logits"]) > 3
    for i, (a, b) in enumerate(zip(ref["logits"], got["logits"])):
        assert torch.equal(a, b), f"forward {i}: max diff {(a - b).abs().max()}"
    assert got["output_ids"] == ref["output_ids"]


def test_the_runs_cover_decode_and_wide_and_narrow_verify_steps(results):
    """One logits row per verified position: more than 15 rows only when three requests
    verify with width 8 (3 x 5 = 15 otherwise); 3 rows when one request verifies width 3."""
    rows = [t.shape[0] for t in results["ep1_spec"]["logits"]]
    assert max(rows) > 15 and 3 in rows, rows
    plain = results["ep1_plain"]["logits"]
    assert len(plain) >= max(MAX_NEW), [t.shape for t in plain]  # one forward per decode step


def test_captured_steps_are_bit_identical_to_one_rank(results):
    """Graphs (decode, verify widths, prefill, DSpark draft, acceptance and fused steps)
    captured on every rank with the expert all-reduces inside."""
    ref, got = results["ep1_graphs"], results["ep4_graphs"]
    assert len(got["logits"]) == len(ref["logits"]) > 3
    for i, (a, b) in enumerate(zip(ref["logits"], got["logits"])):
        assert torch.equal(a, b), f"forward {i}: max diff {(a - b).abs().max()}"
    assert got["output_ids"] == ref["output_ids"] == results["ep1_plain"]["output_ids"]


def test_dspark_greedy_output_equals_plain_under_expert_parallelism(results):
    for name in ("ep1", "ep2", "ep4"):
        assert results[f"{name}_spec"]["output_ids"] == results[f"{name}_plain"]["output_ids"]


def test_fast_combine_is_within_rounding(results):
    ref, got = results["ep1_plain"], results["ep4_fast_plain"]
    for a, b in zip(ref["logits"], got["logits"]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * a.abs().max().item())
    assert got["output_ids"] == ref["output_ids"]
