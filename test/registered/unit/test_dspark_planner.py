"""Confidence-scheduled verify lengths: Algorithm 1, async top-K budget/allocation, relay."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest
import torch
from sgl_dspark.srt.speculative.dspark.planner import (
    ConfidenceRelay,
    align_budget_to_graph_tier,
    allocate_verify_lengths,
    budget_from_relay,
    compute_verify_budget,
    full_verify_lengths,
    order_candidates,
    plan_algorithm1,
)
from sgl_dspark.srt.speculative.dspark.policy import PolicyArgs, create_verify_policy
from sgl_dspark.srt.speculative.dspark.sps import AdditiveSpsTable, DiagonalSpsTable

EPS = 1e-6
APP_A_TABLE = DiagonalSpsTable((1, 2, 3), (1.0, 0.5, 0.45), 3)


# ---- independent references ------------------------------------------------------------------
def _key(survival, r, j):
    """Candidate order key: survival descending, then position, then request."""
    return (-survival[r][j - 1], j, r)


def _survival(conf):
    return [list(itertools.accumulate(row, lambda x, y: x * y)) for row in conf]


def _sps(table, num_requests, num_tokens):
    """Steps/s written out by hand (floor probe / additive T)."""
    if isinstance(table, AdditiveSpsTable):
        alpha = np.interp(num_requests, table.bs_probes, table.alpha_seconds)
        theta = np.interp(num_tokens, table.m_probes, table.theta_seconds)
        return 1.0 / (table.bias_seconds + alpha + theta)
    value = table.sample_steps_per_sec[0]
    for probe, v in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
        if probe <= num_tokens:
            value = v
    return value


def _theta(table, survival, lens):
    num_requests = len(lens)
    tau = num_requests + sum(survival[r][j] for r, ell in enumerate(lens) for j in range(ell))
    return tau * _sps(table, num_requests, num_requests + sum(lens))


def _on_path(survival, lens):
    """True iff the drafts selected by `lens` are exactly the first m valid candidates."""
    selected, unselected = [], []
    for r, row in enumerate(survival):
        for j in range(1, len(row) + 1):
            (selected if j <= lens[r] else unselected).append((r, j))
    if any(survival[r][j - 1] < EPS for r, j in selected):
        return False
    rest = [(r, j) for r, j in unselected if survival[r][j - 1] >= EPS]
    return all(_key(survival, *s) < _key(survival, *u) for s in selected for u in rest)


def _brute_force_algorithm1(table, conf):
    survival = _survival(conf)
    gamma = len(conf[0])
    path = {}
    for lens in itertools.product(range(gamma + 1), repeat=len(conf)):
        if _on_path(survival, lens):
            path[sum(lens)] = lens
    assert sorted(path) == list(range(len(path)))  # one plan per size m
    best = path[0]
    for m in range(1, len(path)):
        if _theta(table, survival, path[m]) > _theta(table, survival, best):
            best = path[m]
        else:
            break
    return [1 + ell for ell in best]


def _random_conf(rng, num_requests, gamma):
    levels = [0.0, 0.3, 0.5, 0.9, 1.0]
    rows = []
    for _ in range(num_requests):
        if rng.random() < 0.5:  # quantised values produce survival ties
            rows.append([rng.choice(levels) for _ in range(gamma)])
        else:
            rows.append([rng.random() for _ in range(gamma)])
    return rows


def _random_table(rng, max_tokens):
    if rng.random() < 0.3:
        bs = sorted(rng.sample(range(1, 8), 3))
        ms = sorted(rng.sample(range(1, max_tokens + 3), 3))
        return AdditiveSpsTable(
            rng.uniform(0.5, 1.0),
            tuple(bs),
            tuple(rng.uniform(0, 0.3) for _ in bs),
            tuple(ms),
            tuple(rng.uniform(-0.2, 0.5) for _ in ms),
        )
    probes = sorted(rng.sample(range(1, max_tokens + 3), rng.randint(1, min(5, max_tokens + 2))))
    values = sorted((rng.uniform(0.2, 1.0) for _ in probes), reverse=rng.random() < 0.8)
    return DiagonalSpsTable(tuple(probes), tuple(values), probes[-1])


# ---- Algorithm 1 --------------------------------------------------------------------------------
@pytest.mark.parametrize("c2", [0.1, 0.6, 0.9, 1.0])
def test_algorithm1_app_a_example(c2):
    # a1 = 0.8: Theta(ell=1) = 1.8 * 0.5 = 0.9 < Theta(ell=0) = 1.0, so the walk stops before ever
    # looking at x_2's confidence, whatever it is.
    res = plan_algorithm1(torch.tensor([[0.8, c2]]), APP_A_TABLE)
    assert res.verify_lens == [1]
    assert res.theta == pytest.approx(1.0)
    # The anticipating global argmax would verify both drafts when c2 is high (App. A).
    survival = _survival([[0.8, c2]])
    global_best = max(range(3), key=lambda ell: _theta(APP_A_TABLE, survival, [ell]))
    # Theta(ell=2) = (1.8 + 0.8 c2) * 0.45 > 1 iff c2 > 0.528.
    assert global_best == (2 if c2 > 0.528 else 0)


def test_algorithm1_matches_brute_force():
    rng = random.Random(1234)
    for _ in range(400):
        num_requests, gamma = rng.randint(1, 3), rng.randint(1, 3)
        conf = _random_conf(rng, num_requests, gamma)
        table = _random_table(rng, num_requests * (gamma + 1))
        res = plan_algorithm1(conf, table)
        want = _brute_force_algorithm1(table, conf)
        assert res.verify_lens == want, (conf, table)
        assert res.num_tokens == sum(want)
        assert res.theta == pytest.approx(_theta(table, _survival(conf), [ell - 1 for ell in want]))


def test_algorithm1_is_global_optimum_for_log_concave_sps():
    # SPS(B) = exp(-alpha B) makes Theta unimodal along the path, so early stop loses nothing.
    rng = random.Random(7)
    for _ in range(60):
        num_requests, gamma = rng.randint(1, 3), rng.randint(1, 4)
        conf = [[rng.uniform(0.05, 1.0) for _ in range(gamma)] for _ in range(num_requests)]
        alpha = rng.uniform(0.02, 0.6)
        probes = tuple(range(1, num_requests * (gamma + 1) + 1))
        table = DiagonalSpsTable(probes, tuple(math.exp(-alpha * b) for b in probes), probes[-1])
        survival = _survival(conf)
        best = max(
            _theta(table, survival, lens)
            for lens in itertools.product(range(gamma + 1), repeat=num_requests)
        )
        assert plan_algorithm1(conf, table).theta == pytest.approx(best, rel=1e-9)


def test_algorithm1_uninitialised_table_verifies_all_valid():
    conf = torch.tensor([[0.9, 0.5, 0.0], [1.0, 1.0, 0.7]])
    assert plan_algorithm1(conf, DiagonalSpsTable.uninitialised()).verify_lens == [3, 4]


def test_order_candidates_gives_prefixes():
    rng = random.Random(3)
    for _ in range(100):
        conf = _random_conf(rng, rng.randint(1, 5), rng.randint(1, 6))
        survival = _survival(conf)
        order = order_candidates(survival)
        keys = [_key(survival, r, j) for r, j in order]
        assert keys == sorted(keys)
        seen = {}
        for r, j in order:
            assert seen.get(r, 0) == j - 1  # (r, j) always follows (r, j-1)
            seen[r] = j
        assert len(order) == sum(a >= EPS for row in survival for a in row)


# ---- async top-K ----------------------------------------------------------------------------
def _budget_ref(table, survival_rows):
    values = sorted((a for row in survival_rows for a in row if a >= EPS), reverse=True)
    num_requests = len(survival_rows)
    thetas = [
        (num_requests + sum(values[:k])) * _sps(table, num_requests, num_requests + k)
        for k in range(len(values) + 1)
    ]
    return thetas.index(max(thetas)), max(thetas)


def test_budget_matches_reference():
    rng = random.Random(5)
    for _ in range(200):
        num_requests, gamma = rng.randint(1, 6), rng.randint(1, 6)
        survival = _survival(_random_conf(rng, num_requests, gamma))
        table = _random_table(rng, num_requests * (gamma + 1))
        res = compute_verify_budget(torch.tensor(survival, dtype=torch.float64), table)
        want_k, want_theta = _budget_ref(table, survival)
        assert res.budget == want_k
        assert res.theta == pytest.approx(want_theta)


def test_budget_global_search_without_early_stop():
    # Theta dips at k=1 and recovers at k=2: the lagged budget may look past the dip.
    table = DiagonalSpsTable((1, 2, 3), (1.0, 0.5, 0.45), 3)
    assert (
        compute_verify_budget(torch.tensor([[1.0, 0.95]], dtype=torch.float64), table).budget == 2
    )
    assert compute_verify_budget(torch.tensor([[0.8, 0.1]]), table).budget == 0
    assert (
        compute_verify_budget(
            torch.tensor([[0.9, 0.0, 0.0]]), DiagonalSpsTable.uninitialised()
        ).budget
        == 1
    )


def _allocation_ref(conf, budget, row_valid):
    survival = _survival(conf)
    cands = [
        (r, j)
        for r, row in enumerate(survival)
        for j in range(1, len(row) + 1)
        if row[j - 1] >= EPS and row_valid[r]
    ]
    cands.sort(key=lambda rj: _key(survival, *rj))
    lens = [1 if v else 0 for v in row_valid]
    for r, _ in cands[:budget]:
        lens[r] += 1
    return lens


def test_allocation_selects_first_k_candidates():
    rng = random.Random(11)
    for _ in range(300):
        batch, gamma = rng.randint(1, 8), rng.randint(1, 6)
        conf = _random_conf(rng, batch, gamma)
        row_valid = [rng.random() < 0.85 for _ in range(batch)]
        budget = rng.randint(0, batch * gamma + 2)
        as_tensor = rng.random() < 0.5
        got = allocate_verify_lengths(
            torch.tensor(conf, dtype=torch.float32),
            torch.tensor(budget) if as_tensor else budget,
            row_valid=torch.tensor(row_valid),
        )
        conf32 = torch.tensor(conf, dtype=torch.float32).tolist()  # compare in the same precision
        assert got.dtype == torch.int64
        assert got.tolist() == _allocation_ref(conf32, budget, row_valid)
        drafts = sum(max(ell - 1, 0) for ell in got.tolist())
        assert drafts <= budget


def test_allocation_without_mask_and_full_lengths():
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.9, 0.9]])
    # survival: r0 = .9 .81 .729, r1 = .2 .18 .162 -> K = 4 takes r0 x3 and r1 x1.
    assert allocate_verify_lengths(conf, 4).tolist() == [4, 2]
    assert allocate_verify_lengths(conf, 0).tolist() == [1, 1]
    assert allocate_verify_lengths(conf, 100).tolist() == [4, 4]
    assert full_verify_lengths(3, 5).tolist() == [6, 6, 6]
    # No lagged budget (relay not ready): verify all, padding rows still 0.
    assert allocate_verify_lengths(conf, None).tolist() == [4, 4]
    assert allocate_verify_lengths(conf, None, row_valid=torch.tensor([True, False])).tolist() == [
        4,
        0,
    ]


def test_align_budget_to_graph_tier():
    # R = 4, gamma = 5: need 4 + 3 = 7 tokens -> tier 8 -> K = 4.
    assert align_budget_to_graph_tier(3, 4, 5, [4, 8, 16, 32]) == 4
    # The tier is capped by R * (gamma + 1) = 24.
    assert align_budget_to_graph_tier(10, 4, 5, [8, 32]) == 20
    assert align_budget_to_graph_tier(30, 4, 5, [8, 16]) == 30


# ---- confidence relay -----------------------------------------------------------------------
def test_relay_lag_and_generations():
    relay = ConfidenceRelay(num_slots=4, gamma=2, lag=2)
    assert relay.lagged_survival([0], [1]) is None
    history = []
    for step in range(5):
        conf = torch.tensor([[0.1 * step + 0.05, 0.5], [0.9, 0.2 + 0.1 * step]])
        slots = torch.tensor([0, 1]) if step != 3 else torch.tensor([0, 2])
        gens = torch.tensor([1, 1]) if step != 3 else torch.tensor([1, 3])
        relay.publish(slots, gens, conf)
        history.append((slots.tolist(), gens.tolist(), conf.tolist()))
        if step == 0:
            assert relay.lagged_survival([0], [1]) is None  # only one publish so far
    # 5 publishes: the planner of step 5 sees step 3's snapshot.
    got = relay.lagged_survival([0, 2, 1, 3], [1, 3, 1, 1])
    c0, c2 = history[3][2]
    c1_old = history[2][2][1]  # slot 1 was last written at step 2
    want = [
        [c0[0], c0[0] * c0[1]],
        [c2[0], c2[0] * c2[1]],
        [c1_old[0], c1_old[0] * c1_old[1]],
        [1.0, 1.0],  # slot 3 never written (generation 0)
    ]
    np.testing.assert_allclose(got.numpy(), np.array(want), rtol=1e-6)
    # Generation mismatch (slot reused) -> no lagged data -> ones.
    assert relay.lagged_survival([2], [4]).tolist() == [[1.0, 1.0]]
    with pytest.raises(ValueError, match="lag"):
        ConfidenceRelay(2, 2, lag=0)


def test_relay_waits_for_a_snapshot_in_flight():
    """A lagged snapshot whose copy has not landed is waited for, never skipped: the budget is a
    function of the step count, the same on every rank and in every run."""

    class CopyInFlight:
        def __init__(self) -> None:
            self.waited = False

        def query(self) -> bool:
            return self.waited

        def synchronize(self) -> None:
            self.waited = True

    relay = ConfidenceRelay(num_slots=2, gamma=2, lag=2)
    conf = torch.tensor([[0.5, 0.25]])
    for _ in range(2):
        relay.publish(torch.tensor([1]), torch.tensor([1]), conf)
    event = CopyInFlight()
    relay._ring_event[0] = event  # the lagged entry's copy, still in flight
    got = relay.lagged_survival([1], [1])
    assert event.waited and got is not None
    assert got.tolist() == [[0.5, 0.125]]


def test_allocation_has_no_host_sync():
    # Meta tensors carry no data: a .item() or a branch on a device value would raise.
    conf = torch.empty((6, 5), device="meta")
    budget = torch.empty((), dtype=torch.int64, device="meta")
    lens = allocate_verify_lengths(
        conf, budget, row_valid=torch.empty(6, dtype=torch.bool, device="meta")
    )
    assert lens.shape == (6,) and lens.device.type == "meta"


def test_budget_from_relay():
    table = DiagonalSpsTable((1, 2, 4, 8), (10.0, 9.0, 6.0, 3.0), 8)
    relay = ConfidenceRelay(num_slots=3, gamma=3, lag=2)
    conf = torch.tensor([[0.9, 0.8, 0.3], [0.6, 0.5, 0.9]])
    relay.publish(torch.tensor([0, 1]), torch.tensor([1, 1]), conf)
    assert budget_from_relay(relay, [0, 1], [1, 1], table) is None  # verify all
    relay.publish(torch.tensor([0, 1]), torch.tensor([1, 1]), torch.rand(2, 3))
    got = budget_from_relay(relay, [0, 1], [1, 1], table)
    survival = _survival(conf.tolist())
    assert got is not None and got.budget == _budget_ref(table, survival)[0]


def test_async_policy_keeps_the_confidences_it_planned_with(tmp_path):
    """The async policy copies a step's confidences into its relay when it plans the step: a
    draft graph's confidences are its outputs, which a later replay (the verify forward's graph,
    captured earlier into the shared pool) may overwrite before the step ends."""
    sps = tmp_path / "sps.json"
    tokens = [1, 2, 4, 8, 16]
    sps.write_text(
        json.dumps(
            {
                "sample_batch_tokens": tokens,
                "sample_steps_per_sec": [1000.0 / (10.0 + 0.4 * t) for t in tokens],
                "max_batch_tokens": 16,
            }
        )
    )
    args = PolicyArgs(policy="confidence", sps_table_path=str(sps), confidence_mode="async")
    policy = create_verify_policy(3, args, torch.device("cpu"), num_slots=4)
    planned = torch.tensor([[0.9, 0.8, 0.3], [0.6, 0.5, 0.9]])
    draft_output = planned.clone()
    for _ in range(policy.relay.lag):
        lens = policy.verify_lens(draft_output, [1, 2], [1, 1])
        assert lens.tolist() == [4, 4]  # no lagged budget yet: verify every draft
        draft_output.fill_(float("nan"))  # the memory reused by the next replay
        policy.observe(lens, torch.tensor([1, 0]), [1, 2], [1, 1])
        draft_output.copy_(planned)
    got = policy.relay.lagged_survival([1, 2], [1, 1])
    assert got is not None
    assert torch.equal(got, torch.cumprod(planned.double(), dim=1))
