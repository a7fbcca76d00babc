"""Tensor parallelism (attention heads, vocabulary) and TP x EP on spawned gloo ranks (one
world of 2 for the module): logits within 1e-5 of one rank in fp32 and the same greedy output
with and without DSpark; seeded sampled tokens equal to one rank, also from DSpark's sampled
draft and acceptance graphs; an abort mid-decode leaves
every rank's KV pool empty; every rank schedules the same steps. (The vocabulary-parallel
head's greedy path: `test_vocab_parallel_head.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_engines import (
    MAX_NEW,
    greedy_params,
    run_abort_and_trace,
    run_layout,
)
from sgl_dspark.srt.distributed import ParallelLayout
from worlds import run_world

LAYOUTS = {
    "tp1": ParallelLayout(1, 1),
    "tp2": ParallelLayout(2, 1),
    "tp2ep2": ParallelLayout(2, 2),
}


def sampled_params() -> list[dict]:
    return [
        {"max_new_tokens": n, "temperature": 0.9, "top_p": 0.95, "seed": 11 + i, "ignore_eos": True}
        for i, n in enumerate(MAX_NEW)
    ]


def _world(rank: int, out_dir: Path) -> None:
    for name, layout in LAYOUTS.items():
        for spec in (False, True):
            tag = f"{name}_{'spec' if spec else 'plain'}"
            run_layout(rank, out_dir, tag, layout, "exact", spec, greedy_params())
        run_layout(rank, out_dir, f"{name}_sampled", layout, "exact", False, sampled_params())
    for name in ("tp1", "tp2ep2"):
        run_layout(
            rank, out_dir, f"{name}_graphs", LAYOUTS[name], "exact", True, greedy_params(), True
        )
        tag = f"{name}_spec_sampled_graphs"
        run_layout(rank, out_dir, tag, LAYOUTS[name], "exact", True, sampled_params(), True)
    run_abort_and_trace(rank, out_dir, ParallelLayout(2, 2), spec=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("tp_world")
    run_world(2, _world, out)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


@pytest.mark.parametrize("name", ["tp2", "tp2ep2"])
@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_logits_within_fp32_rounding_and_same_greedy_output(results, name, mode):
    ref, got = results[f"tp1_{mode}"], results[f"{name}_{mode}"]
    assert got["output_ids"] == ref["output_ids"]
    assert len(got["logits"]) == len(ref["logits"]) > 3
    for a, b in zip(ref["logits"], got["logits"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * max(1.0, a.abs().max().item()))


def test_captured_steps_match_one_rank(results):
    """Graphs (EagerGraph stand-ins) captured on every rank with the collectives inside,
    DSpark fused steps included."""
    ref, got = results["tp1_graphs"], results["tp2ep2_graphs"]
    assert got["output_ids"] == ref["output_ids"] == results["tp1_plain"]["output_ids"]
    assert len(got["logits"]) == len(ref["logits"]) > 3
    for a, b in zip(ref["logits"], got["logits"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * max(1.0, a.abs().max().item()))


@pytest.mark.parametrize("name", ["tp1", "tp2", "tp2ep2"])
def test_dspark_greedy_output_equals_plain(results, name):
    assert results[f"{name}_spec"]["output_ids"] == results[f"{name}_plain"]["output_ids"]


@pytest.mark.parametrize("name", ["tp2", "tp2ep2"])
def test_seeded_sampled_tokens_equal_one_rank(results, name):
    ref = results["tp1_sampled"]["output_ids"]
    assert results[f"{name}_sampled"]["output_ids"] == ref
    assert ref != results["tp1_plain"]["output_ids"]  # sampling did not collapse to greedy


def test_sampled_dspark_graphs_match_one_rank(results):
    """Seeded sampled DSpark steps replay the sampled draft graphs (the draft's logits rows
    gathered inside them) and the acceptance graphs on whole rows, on every rank: the tokens
    of one rank."""
    ref, got = results["tp1_spec_sampled_graphs"], results["tp2ep2_spec_sampled_graphs"]
    assert got["output_ids"] == ref["output_ids"]
    assert ref["output_ids"] != results["tp1_spec"]["output_ids"]  # not collapsed to greedy
    for r in (ref, got):
        assert r["replays"]["DSpark sampled draft"] > 0, r["replays"]
        accepts = [f for f in r["replays"] if f.startswith("DSpark sampled acceptance")]
        assert accepts and all(f.endswith("top-k/top-p/min-p") for f in accepts)  # top_p 0.95


def test_abort_mid_decode_leaves_every_rank_kv_pool_empty(results):
    for rank in range(2):
        s = results[f"abort_rank{rank}"]
        assert s["free_pages"] == s["usable_pages"], s
        assert s["free_slots"] == s["initial_free_slots"] and s["running"] == 0, s


def test_every_rank_schedules_the_same_steps(results):
    traces = [results[f"abort_rank{rank}"]["trace"] for rank in range(2)]
    assert len(traces[0]) > 5
    assert traces[0] == traces[1]
    # the aborted request stops taking part in steps
    last_with_2 = max(i for i, (p, d) in enumerate(traces[0]) if any(r == "2" for r, _ in d))
    assert last_with_2 < len(traces[0]) - 1
