"""The vocabulary-parallel head's greedy path on spawned gloo ranks (one world of 2 for the
module): the shard-pair argmax equals `torch.argmax` of whole rows across shard borders (ties,
NaN, +-inf, signed zeros; even and uneven shards; torch and the `kernels/sampling` kernels)
with logprobs within fp32 rounding of `log_softmax`; the DSpark draft's greedy Markov loop over
vocabulary shards drafts what the whole-row loop drafts (ties across the border, NaN, +-inf)
and gathers only (max, index) pairs; TP 2 greedy output equals one rank with and without
DSpark, eagerly and from graphs; an all-greedy step all-gathers only the small per-row records,
never a logits row of the target or of the draft; a batch of greedy requests and requests
that read whole rows (sampled, penalised, asking for top-N or prompt logprobs; plain decode
and DSpark, eager and from graphs, ragged and capped verifies, simulated acceptance) gives
every request one rank's tokens while only the latter's rows (the draft's too) are gathered,
and both ranks split every step alike; a DSpark step that splits replays no sampled graph, as
those gather every row whole, while one rank's mixed batches replay them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from rank_engines import (
    MARKOV_GAMMA,
    MAX_NEW,
    PROMPTS,
    greedy_params,
    markov_edge_cases,
    run_counted,
    run_shard_greedy,
    run_shard_markov,
    sps_table,
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


def mixed_adjust_params() -> list[dict]:
    """`mixed_params` whose last greedy request adjusts its logits (penalties): it reads its
    rows whole with the sampled one, the first greedy request through the picks."""
    params = mixed_params()
    params[2] = {**params[2], "repetition_penalty": 1.3, "frequency_penalty": 0.5}
    return params


def greedy_adjust_params() -> list[dict]:
    """Greedy requests only, the last with penalties: it reads its rows whole, the others
    through the picks (the draft stays on the pairs: no row samples)."""
    params = greedy_params()
    params[2] = {**params[2], "repetition_penalty": 1.3, "frequency_penalty": 0.5}
    return params


# Top-N and prompt logprobs for the sampled request only: its rows are read whole (its
# prompt's scored positions included), the greedy requests' through the picks.
EXTRAS = [{}, {"top_logprobs_num": 3, "logprob_start_len": 3}, {}]


def simulated(out_dir: Path) -> dict:
    return {"speculative_dspark_simulate_accept_len": 3.0}


def confidence(out_dir: Path) -> dict:
    """The async confidence policy: full windows with acceptance capped on the device."""
    return {
        "speculative_dspark_verify_policy": "confidence",
        "speculative_dspark_confidence_mode": "async",
        "speculative_dspark_width_table_path": None,
        "speculative_dspark_sps_table_path": sps_table(out_dir / f"sps{os.getpid()}.json"),
    }


# Runs of a batch that mixes greedy requests with requests that read whole rows, on both
# layouts: (name, DSpark, parameters, graphs, engine options of the world's folder,
# per-request options).
MIXED_RUNS = [
    ("mixed", False, mixed_params, False, None, None),
    ("spec_mixed", True, mixed_params, False, None, None),
    ("mixed_graphs", False, mixed_params, True, None, None),
    ("spec_mixed_graphs", True, mixed_params, True, None, None),
    ("mixed_adjust", False, mixed_adjust_params, False, None, None),
    ("spec_mixed_adjust", True, mixed_adjust_params, False, None, None),
    ("greedy_adjust", False, greedy_adjust_params, False, None, None),
    ("spec_greedy_adjust", True, greedy_adjust_params, False, None, None),
    ("mixed_extras", False, mixed_params, False, None, EXTRAS),
    ("spec_mixed_extras", True, mixed_params, False, None, EXTRAS),
    ("spec_mixed_simulated", True, mixed_params, False, simulated, None),
    ("spec_mixed_confidence", True, mixed_params, False, confidence, None),
]
MIXED_NAMES = [run[0] for run in MIXED_RUNS]


def _world(rank: int, out_dir: Path) -> None:
    run_shard_greedy(rank, out_dir)
    run_shard_markov(rank, out_dir)
    greedy = greedy_params()
    for name, layout in (("tp1", TP1), ("tp2", TP2)):
        run_counted(rank, out_dir, f"{name}_plain", layout, False, greedy)
        run_counted(rank, out_dir, f"{name}_spec", layout, True, greedy)
        for tag, spec, params, graphs, options, per_req in MIXED_RUNS:
            run_counted(
                rank,
                out_dir,
                f"{name}_{tag}",
                layout,
                spec,
                params(),
                graphs,
                engine_options=options(out_dir) if options else None,
                req_options=per_req,
                return_logprob=True,
            )
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


# ---- batches of greedy and sampled requests ------------------------------------------------------


@pytest.mark.parametrize("name", MIXED_NAMES)
def test_mixed_batch_tokens_equal_one_rank(results, name):
    """Every request of a batch of greedy and seeded sampled (or logits-adjusting) requests
    gets exactly the tokens of one rank, the greedy ones through the picks and the others
    from their whole rows; the committed tokens' logprobs (and the top-N and prompt
    logprobs asked for) agree within fp32 rounding."""
    ref, got = results[f"tp1_{name}"], results[f"tp2_{name}"]
    assert got["output_ids"] == ref["output_ids"]
    assert [len(o) for o in got["output_ids"]] == MAX_NEW
    close = {"rtol": 1e-4, "atol": 1e-4}
    for a, b in zip(ref["logprobs"], got["logprobs"]):
        assert len(a) == len(b) > 0
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), **close)
    for a, b in zip(ref["top_logprobs"], got["top_logprobs"]):
        assert [[t for t, _ in row] for row in a] == [[t for t, _ in row] for row in b]
        want, have = ([[v for _, v in row] for row in x] for x in (a, b))
        torch.testing.assert_close(torch.tensor(have), torch.tensor(want), **close)
    for a, b in zip(ref["prompt_logprobs"], got["prompt_logprobs"]):
        assert [v is None for v in a] == [v is None for v in b]
        want, have = ([v for v in x if v is not None] for x in (a, b))
        torch.testing.assert_close(torch.tensor(have), torch.tensor(want), **close)


def test_mixed_batches_mix(results):
    """The runs mix what they claim: the sampled request samples, the plain greedy requests
    give the greedy output, penalties change the output of the request that has them, and
    the extras are there for the request that asks."""
    greedy = results["tp1_plain"]["output_ids"]
    for name in MIXED_NAMES:
        out = results[f"tp1_{name}"]["output_ids"]
        if "simulated" in name:  # forced drafts: not the greedy output
            continue
        assert out[0] == greedy[0], name
        assert (out[1] == greedy[1]) == ("greedy_adjust" in name), name
        assert (out[2] == greedy[2]) == ("adjust" not in name), name
    extras = results["tp2_mixed_extras"]
    assert [len(rows) for rows in extras["top_logprobs"]] == [0, MAX_NEW[1], 0]
    assert all(len(row) == 3 for row in extras["top_logprobs"][1])
    prompt = extras["prompt_logprobs"]
    assert not prompt[0] and not prompt[2] and len(prompt[1]) == len(PROMPTS[1]) - 3


@pytest.mark.parametrize("name", ["mixed", "mixed_graphs"])
def test_mixed_decode_gathers_only_the_sampled_rows(results, name):
    """Plain decoding: the sampled request's rows are the only logits rows gathered, one row
    per token it samples (its first from the prefill step; the overlap schedule may launch
    one more step before its end is read); every other request's token comes from the
    greedy records, with or without the decode graphs' own picks."""
    run = results[f"tp2_{name}"]
    wide = _logits_gathers(run)
    assert MAX_NEW[1] <= len(wide) <= MAX_NEW[1] + 1
    assert wide == [(1, run["shard_width"])] * len(wide)
    records = [s for s in run["gathered"] if s not in _logits_gathers(run)]
    assert records and all(len(s) == 3 and s[2] == RECORD_COLUMNS for s in records)
    if "graphs" not in name:  # the greedy requests' rows alone (a graph picks all of its rows)
        assert {s[1] for s in records} == {1, 2}


def test_mixed_decode_gathers_the_adjusting_request_with_the_sampled(results):
    """A greedy request with penalties reads its rows whole with the sampled one; the plain
    greedy request's rows are never gathered: no step gathers three rows."""
    run = results["tp2_mixed_adjust"]
    rows = [s[0] for s in _logits_gathers(run)]
    assert rows and max(rows) == 2 and all(len(s) == 2 for s in _logits_gathers(run))
    assert [s for s in run["gathered"] if len(s) == 3 and s[2] == RECORD_COLUMNS]


@pytest.mark.parametrize("name", ["spec_mixed", "spec_mixed_graphs", "spec_mixed_adjust"])
def test_mixed_dspark_steps_gather_only_the_rows_read_whole(results, name):
    """DSpark: in every step the sampled request shares with a greedy one, the draft gathers
    only the sampled row's logits (`[1, block size, V / tp]`; the greedy rows draft from the
    pairs and the draft never reads every row whole through `compute_logits`), and the
    verify gathers only its rows (`[1, W, V / tp]`, or its ragged rows flat: at most
    block + 1); the greedy rows' acceptance reads the records. A greedy request with
    penalties reads its rows whole with the sampled one (the draft's too): two requests,
    never the third."""
    run = results[f"tp2_{name}"]
    wide = _logits_gathers(run)
    draft = [s for s in wide if len(s) == 3 and s[1] == BLOCK_SIZE]
    whole = 2 if "adjust" in name else 1  # requests read whole
    assert draft and max(s[0] for s in draft) == whole
    assert all(s[0] <= whole for s in wide if len(s) == 3)
    assert all(s[0] <= whole * (BLOCK_SIZE + 1) for s in wide if len(s) == 2)
    if "adjust" not in name:
        assert run["draft_logits"] == 0
    assert _draft_pairs(run)
    records = [s for s in run["gathered"] if len(s) == 3 and s[2] == RECORD_COLUMNS]
    assert records
    if "graphs" in name:  # captured widths: every verify is uniform, so no flat gather
        assert all(len(s) == 3 or s == (1, run["shard_width"]) for s in wide)
        assert all(s[0] == 1 for s in wide)


def test_split_dspark_steps_replay_no_sampled_graph(results):
    """The sampled DSpark graphs gather every row of their bucket whole, so a step that splits
    its rows runs the draft and acceptance of its rows read whole eagerly: under TP 2 the
    sampled request shares every step with a greedy one, and no sampled graph replays, while
    the greedy rows' acceptance still replays its graph. One rank never splits: its mixed
    batches replay the sampled draft and acceptance graphs."""
    one = results["tp1_spec_mixed_graphs"]["replays"]
    two = results["tp2_spec_mixed_graphs"]["replays"]
    sampled = ("DSpark sampled draft", "DSpark bs1 sampled draft", "DSpark sampled acceptance")
    assert one["DSpark sampled draft"] > 0, one
    assert any(n > 0 for f, n in one.items() if f.startswith("DSpark sampled acceptance")), one
    assert not [f for f, n in two.items() if f.startswith(sampled) and n > 0], two
    assert any(n > 0 for f, n in two.items() if f.startswith("DSpark acceptance width")), two


@pytest.mark.parametrize("name", MIXED_NAMES)
def test_every_rank_splits_the_same_rows(results, name):
    """Both ranks split every mixed step's rows the same way, from host flags only, and so
    make the same collectives; one rank never splits."""
    first, second = results[f"tp2_{name}"], results[f"tp2_{name}_rank1"]
    assert first["splits"] and first["splits"] == second["splits"]
    assert first["gathered"] == second["gathered"]
    assert all(not set(greedy) & set(whole) for greedy, whole in first["splits"])
    assert any(greedy and whole for greedy, whole in first["splits"])
    assert results[f"tp1_{name}"]["splits"] == [] and results[f"tp1_{name}"]["gathered"] == []


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
