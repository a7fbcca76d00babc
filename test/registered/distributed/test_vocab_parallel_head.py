"""The vocabulary-parallel head's greedy path on spawned gloo ranks (one world of 2 for the
module): the shard-pair argmax equals `torch.argmax` of whole rows across shard borders (ties,
NaN, +-inf, signed zeros; even and uneven shards; torch and the `kernels/sampling` kernels)
with logprobs within fp32 rounding of `log_softmax`; TP 2 greedy output equals one rank with
and without DSpark, eagerly and from graphs; an all-greedy step all-gathers only the small
per-row records, never a logits row of the target; steps with sampled rows gather whole rows
and sample the same tokens as one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_engines import MAX_NEW, greedy_params, run_counted, run_shard_greedy
from sgl_dspark.srt.distributed import ParallelLayout
from worlds import run_world

TP1, TP2 = ParallelLayout(1, 1), ParallelLayout(2, 1)
# Columns of a rank's greedy record (max, index, shifted sum of exponentials).
RECORD_COLUMNS = 3


def mixed_params() -> list[dict]:
    """A greedy, a seeded sampled and a greedy request in one batch."""
    params = greedy_params()
    params[1] = {
        "max_new_tokens": MAX_NEW[1],
        "temperature": 2.0,
        "top_k": 40,
        "seed": 7,
        "ignore_eos": True,
    }
    return params


def _world(rank: int, out_dir: Path) -> None:
    run_shard_greedy(rank, out_dir)
    greedy = greedy_params()
    for name, layout in (("tp1", TP1), ("tp2", TP2)):
        run_counted(rank, out_dir, f"{name}_plain", layout, False, greedy)
        run_counted(rank, out_dir, f"{name}_spec", layout, True, greedy)
        run_counted(rank, out_dir, f"{name}_mixed", layout, False, mixed_params())
        run_counted(rank, out_dir, f"{name}_logprob", layout, False, greedy, return_logprob=True)
        run_counted(
            rank, out_dir, f"{name}_spec_logprob", layout, True, greedy, return_logprob=True
        )
    run_counted(rank, out_dir, "tp2_graphs", TP2, False, greedy, graphs=True)
    run_counted(rank, out_dir, "tp2_spec_graphs", TP2, True, greedy, graphs=True)
    triton = {"kernel_backend_overrides": "sampling=triton"}
    run_counted(rank, out_dir, "tp2_triton", TP2, False, greedy, engine_options=triton)
    # Simulated acceptance commits drafts the target does not pick: their logprobs are probed.
    simulated = {"speculative_dspark_simulate_accept_len": 3.0}
    for name, layout in (("tp1", TP1), ("tp2", TP2)):
        run_counted(
            rank,
            out_dir,
            f"{name}_simulated",
            layout,
            True,
            greedy,
            engine_options=simulated,
            return_logprob=True,
        )
    # Top-N logprobs read whole rows: the same run's logprobs through log_softmax.
    run_counted(
        rank,
        out_dir,
        "tp2_logprob_whole",
        TP2,
        False,
        greedy,
        return_logprob=True,
        top_logprobs_num=2,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("vocab_head_world")
    run_world(2, _world, out)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


# ---- the shard-pair greedy record ---------------------------------------------------------------


def _expected_rows(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.argmax(full, dim=-1), torch.log_softmax(full, dim=-1)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("split", ["even", "uneven"])
def test_shard_pair_argmax_equals_argmax_of_whole_rows(results, split, impl):
    for rank in range(2):
        r = results[f"greedy_{split}_{impl}_r{rank}"]
        ids, _, _ = r["pick"]
        expected, _ = _expected_rows(r["full"])
        assert torch.equal(ids, expected), (rank, ids, expected)
    b = 32 if split == "even" else 37
    # The hand-built rows (`edge_rows`), independently of torch.argmax.
    hand = {0: b - 5, 1: b - 1, 2: b + 3, 3: 2, 4: 0, 6: b, 7: b - 1, 8: 0, 9: 3, 10: b - 1}
    assert {i: ids[i].item() for i in hand} == hand
    assert ids[5] >= b and ids[11] == b and ids[13] == b + 4 and ids[14] < b


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("split", ["even", "uneven"])
def test_shard_logprobs_within_rounding_of_log_softmax(results, split, impl):
    for rank in range(2):
        r = results[f"greedy_{split}_{impl}_r{rank}"]
        full, probes = r["full"], r["probes"]
        ids, logprobs, probed = r["pick"]
        _, table = _expected_rows(full)
        want = table.gather(1, ids[:, None]).squeeze(1)
        want_probe = table.gather(1, probes[:, None]).squeeze(1)
        # NaN exactly where log_softmax has NaN (NaN rows, all -inf, a +inf maximum).
        assert torch.equal(logprobs.isnan(), want.isnan())
        assert want.isnan()[[2, 3, 4, 9, 11, 13]].all()
        torch.testing.assert_close(logprobs, want, rtol=1e-6, atol=2e-6, equal_nan=True)
        torch.testing.assert_close(probed, want_probe, rtol=1e-6, atol=2e-6, equal_nan=True)
        assert not want[12].isnan() and want[12].abs() < 1e3  # the large row stays exact-ish


# ---- engines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["tp2_plain", "tp2_spec", "tp2_graphs", "tp2_spec_graphs", "tp2_triton"]
)
def test_tp2_greedy_output_equals_one_rank(results, name):
    ref = results["tp1_plain"]["output_ids"]
    assert results["tp1_spec"]["output_ids"] == ref  # DSpark is lossless on one rank
    assert results[name]["output_ids"] == ref
    assert [len(o) for o in ref] == MAX_NEW


def _logits_gathers(run: dict) -> list[tuple[int, ...]]:
    """Gathered tensors as wide as a logits shard (any other gather is a per-row record)."""
    return [s for s in run["gathered"] if s[-1] == run["shard_width"]]


@pytest.mark.parametrize("name", ["tp2_plain", "tp2_graphs", "tp2_triton", "tp2_logprob"])
def test_all_greedy_steps_gather_no_logits_row(results, name):
    run = results[name]
    assert _logits_gathers(run) == []
    # The greedy records did cross ranks: [1, rows, 3] per step.
    records = [s for s in run["gathered"] if len(s) == 3 and s[0] == 1]
    assert len(records) >= max(MAX_NEW) and records == run["gathered"]
    assert all(s[2] == RECORD_COLUMNS for s in records)


@pytest.mark.parametrize("name", ["tp2_spec", "tp2_spec_graphs", "tp2_spec_logprob"])
def test_all_greedy_dspark_steps_gather_only_the_draft_logits(results, name):
    """The target's verify rows and acceptance go through the records; the only logits-wide
    gathers are the draft's own proposal logits (`compute_logits`, [B, gamma, V / tp])."""
    run = results[name]
    wide = _logits_gathers(run)
    assert len(wide) == run["draft_logits"]
    assert all(len(s) == 3 and s[1] == 7 for s in wide)  # [B, block size 7, V / tp]
    records = [s for s in run["gathered"] if s not in wide]
    assert records and all(s[0] == 1 and s[2] == RECORD_COLUMNS for s in records)
    if name == "tp2_spec_graphs":
        assert run["replays"]["DSpark fused step"] > 0


def test_sampled_rows_gather_and_equal_one_rank(results):
    ref, got = results["tp1_mixed"], results["tp2_mixed"]
    assert got["output_ids"] == ref["output_ids"]
    assert ref["output_ids"][1] != results["tp1_plain"]["output_ids"][1]  # it did sample
    assert ref["output_ids"][0] == results["tp1_plain"]["output_ids"][0]
    assert _logits_gathers(got)  # a step with a sampled row reads whole rows


@pytest.mark.parametrize("mode", ["logprob", "spec_logprob", "simulated"])
def test_greedy_logprobs_match_one_rank(results, mode):
    ref, got = results[f"tp1_{mode}"], results[f"tp2_{mode}"]
    assert got["output_ids"] == ref["output_ids"]
    if mode == "simulated":  # forced drafts: not the greedy output, and not all the argmax
        assert ref["output_ids"] != results["tp1_plain"]["output_ids"]
        assert len(_logits_gathers(got)) == got["draft_logits"]  # the draft's only
    else:
        assert ref["output_ids"] == results["tp1_plain"]["output_ids"]
    for a, b in zip(ref["logprobs"], got["logprobs"]):
        assert len(a) == len(b) > 0
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=1e-4)


def test_record_logprobs_match_log_softmax_of_gathered_rows(results):
    """One TP 2 run through the records, one through whole rows (top-N logprobs ask for
    them): the same logits, logprobs within fp32 rounding."""
    shard, whole = results["tp2_logprob"], results["tp2_logprob_whole"]
    assert _logits_gathers(whole) and not _logits_gathers(shard)
    assert shard["output_ids"] == whole["output_ids"]
    for a, b in zip(whole["logprobs"], shard["logprobs"]):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=2e-6)
