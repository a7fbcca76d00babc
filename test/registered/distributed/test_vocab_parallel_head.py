"""The vocabulary-parallel head's greedy path on spawned gloo ranks (one world of 2 for the
module): the shard-pair argmax equals `torch.argmax` of whole rows across shard borders (ties,
NaN, +-inf, signed zeros; even and uneven shards; torch and the `kernels/sampling` kernels)
with logprobs within fp32 rounding of `log_softmax`; the DSpark draft's greedy Markov loop over
vocabulary shards drafts what the whole-row loop drafts (ties across the border, NaN, +-inf)
and gathers only (max, index) pairs; TP 2 greedy output equals one rank with and without
DSpark, eagerly and from graphs; an all-greedy step all-gathers only the small per-row records,
never a logits row of the target or of the draft; steps with sampled rows gather whole rows
(the draft's too) and sample the same tokens as one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_engines import (
    MARKOV_GAMMA,
    MAX_NEW,
    greedy_params,
    markov_edge_cases,
    run_counted,
    run_shard_greedy,
    run_shard_markov,
)
from sgl_dspark.kernels.spec.reference import markov_greedy_ref
from sgl_dspark.srt.distributed import ParallelLayout
from worlds import run_world

TP1, TP2 = ParallelLayout(1, 1), ParallelLayout(2, 1)
# Columns of a rank's greedy record (max, index, shifted sum of exponentials).
RECORD_COLUMNS = 3
# Columns of the draft's per-step record (max, index).
PAIR_COLUMNS = 2
BLOCK_SIZE = 7  # the engines' DSpark block size (`rank_engines.engine_args`)


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
    run_shard_markov(rank, out_dir)
    greedy = greedy_params()
    for name, layout in (("tp1", TP1), ("tp2", TP2)):
        run_counted(rank, out_dir, f"{name}_plain", layout, False, greedy)
        run_counted(rank, out_dir, f"{name}_spec", layout, True, greedy)
        run_counted(rank, out_dir, f"{name}_mixed", layout, False, mixed_params())
        run_counted(rank, out_dir, f"{name}_spec_mixed", layout, True, mixed_params())
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


# ---- the draft's greedy Markov loop over shards ----------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("split", ["even", "uneven"])
def test_shard_markov_drafts_equal_the_whole_row_loop(results, split, impl):
    runs = [results[f"markov_{split}_{impl}_r{rank}"] for rank in range(2)]
    # The inputs' corrections are exact (`markov_inputs`): the whole-row loop on one process
    # computes the same step logits, so its drafts are the expected ones bit for bit.
    first = runs[0]
    want = markov_greedy_ref(first["base"], first["w1"], first["w2"], first["anchors"])
    for r in runs:
        drafts, step_logits, embeds = r["out"]
        assert torch.equal(drafts, want.drafts), (drafts, want.drafts)
        assert torch.equal(embeds, want.embeds)
        cols = want.step_logits[..., r["start"] : r["start"] + step_logits.shape[-1]]
        torch.testing.assert_close(step_logits, cols, rtol=0, atol=0, equal_nan=True)
    # Every draft is the argmax of the gathered rows of the loop's own step logits.
    whole = torch.cat([r["out"][1] for r in runs], dim=-1)
    assert torch.equal(drafts, torch.argmax(whole, dim=-1))
    # The hand-built rows, independently of torch.argmax.
    b = 32 if split == "even" else 37
    cases = markov_edge_cases(b)
    assert {key: drafts[key].item() for key in cases} == cases
    assert drafts[5, 0] >= b and drafts[5, 1] < b


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("split", ["even", "uneven"])
def test_shard_markov_gathers_one_pair_per_rank_row_and_step(results, split, impl):
    for rank in range(2):
        r = results[f"markov_{split}_{impl}_r{rank}"]
        rows = r["base"].shape[0]
        assert r["gathered"] == [(1, rows, PAIR_COLUMNS)] * MARKOV_GAMMA


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


def _draft_pairs(run: dict) -> list[tuple[int, ...]]:
    """The draft's per-step (max, index) records, [1, B, 2]."""
    return [s for s in run["gathered"] if len(s) == 3 and s[0] == 1 and s[2] == PAIR_COLUMNS]


@pytest.mark.parametrize("name", ["tp2_spec", "tp2_spec_graphs", "tp2_spec_logprob"])
def test_all_greedy_dspark_steps_gather_no_logits_row(results, name):
    """The target's verify rows and acceptance go through the records, the draft's greedy
    proposals through its per-step pairs: no gather is as wide as a logits shard, and the
    draft never asks for whole rows (`compute_logits`)."""
    run = results[name]
    assert _logits_gathers(run) == []
    assert run["draft_logits"] == 0
    pairs = _draft_pairs(run)
    # A proposal gathers one [1, B, 2] pair per Markov step (up to the block size).
    assert len(pairs) >= BLOCK_SIZE
    records = [s for s in run["gathered"] if s not in pairs]
    assert records and all(s[0] == 1 and s[2] == RECORD_COLUMNS for s in records)
    if name == "tp2_spec_graphs":
        assert run["replays"]["DSpark fused step"] > 0


def test_one_rank_dspark_keeps_the_unsharded_draft_path(results):
    """One rank: the draft reads its rows through `compute_logits` (the identity reader) and
    the family's Markov loop, and nothing crosses a communicator."""
    run = results["tp1_spec"]
    assert run["draft_logits"] > 0 and run["gathered"] == []


def test_sampled_dspark_rows_gather_the_draft_logits_and_equal_one_rank(results):
    """A step with a sampled row draws drafts from the whole distribution: the draft's logits
    are gathered whole ([B, block size, V / tp]) for it; the greedy steps after the sampled
    request ends take the pairs."""
    ref, got = results["tp1_spec_mixed"], results["tp2_spec_mixed"]
    assert got["output_ids"] == ref["output_ids"]
    assert ref["output_ids"][1] != results["tp1_plain"]["output_ids"][1]  # it did sample
    assert ref["output_ids"][0] == results["tp1_plain"]["output_ids"][0]
    draft_wide = [s for s in _logits_gathers(got) if len(s) == 3 and s[1] == BLOCK_SIZE]
    assert got["draft_logits"] > 0 and len(draft_wide) == got["draft_logits"]
    assert _draft_pairs(got)


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
        assert _logits_gathers(got) == [] and got["draft_logits"] == 0
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
