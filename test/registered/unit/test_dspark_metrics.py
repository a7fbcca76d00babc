"""DSpark metrics: lazy reduction equals a direct host computation."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.srt.speculative.dspark.metrics import DSparkMetrics


def _random_steps(gamma: int, num_steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(num_steps):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        verify = torch.randint(1, gamma + 2, (batch,), generator=gen)
        accept = (torch.rand(batch, generator=gen) * verify).long().clamp(max=verify - 1)
        mask = torch.rand(batch, generator=gen) < 0.85
        verify = torch.where(mask, verify, torch.zeros_like(verify))  # padding rows verify 0
        ids = [f"req{int(i)}" for i in torch.randint(0, 5, (batch,), generator=gen)]
        steps.append((verify, accept, mask, ids, {"draft": 1.0 + s, "verify": 2.0 * s}))
    return steps


def test_summary_matches_direct_computation():
    gamma = 5
    steps = _random_steps(gamma, 40, seed=0)
    metrics = DSparkMetrics(gamma)
    for verify, accept, mask, ids, timing in steps:
        metrics.record_step(
            verify,
            accept,
            mask,
            request_ids=ids,
            padded_verify_tokens=8 * 6,
            timing=timing,
            extras={"budget": 3.0},
        )
    rows = [
        (int(v) - 1, int(n), rid)
        for verify, accept, mask, ids, _ in steps
        for v, n, m, rid in zip(verify.tolist(), accept.tolist(), mask.tolist(), ids)
        if m
    ]
    summary = metrics.summary()
    assert summary.num_steps == 40
    assert summary.request_steps == len(rows)
    assert summary.verified_drafts == sum(ell for ell, _, _ in rows)
    assert summary.correct_drafts == sum(n for _, n, _ in rows)
    assert summary.committed_tokens == sum(n + 1 for _, n, _ in rows)
    assert summary.accept_length == pytest.approx(sum(n + 1 for _, n, _ in rows) / len(rows))
    assert summary.accept_rate == pytest.approx(
        sum(n for _, n, _ in rows) / sum(ell for ell, _, _ in rows)
    )
    assert summary.mean_verify_len == pytest.approx(sum(ell + 1 for ell, _, _ in rows) / len(rows))
    for k in range(1, gamma + 1):
        num = sum(1 for ell, n, _ in rows if ell >= k and n >= k)
        den = sum(1 for ell, n, _ in rows if ell >= k and n >= k - 1)
        reached = sum(1 for ell, _, _ in rows if ell >= k)
        assert summary.conditional_acceptance[k - 1] == (pytest.approx(num / den) if den else None)
        assert summary.prefix_survival[k - 1] == (
            pytest.approx(sum(1 for ell, n, _ in rows if n >= k) / reached) if reached else None
        )
    assert summary.mean_extras == {"budget": 3.0}
    assert summary.block_accept_length == summary.accept_length  # no cap-accept trimming
    assert summary.mean_timing_ms["draft"] == pytest.approx(sum(1.0 + s for s in range(40)) / 40)
    per_request = metrics.request_metrics()
    for rid in {r for _, _, r in rows}:
        mine = [(ell, n) for ell, n, r in rows if r == rid]
        got = per_request[rid]
        assert (got.steps, got.verified_drafts, got.correct_drafts, got.committed_tokens) == (
            len(mine),
            sum(ell for ell, _ in mine),
            sum(n for _, n in mine),
            sum(n + 1 for _, n in mine),
        )
    records = metrics.step_records()
    assert len(records) == 40
    first_verify, first_accept, first_mask, _, _ = steps[0]
    assert records[0].committed_tokens == int(((first_accept + 1) * first_mask).sum())
    assert records[0].padded_verify_tokens == 48 and records[0].extras == {"budget": 3.0}
    assert records[3].timing_ms == {"draft": 4.0, "verify": 6.0}
    metrics.reset()
    assert metrics.summary().request_steps == 0 and metrics.step_records() == []


def test_default_mask_and_record_limit():
    metrics = DSparkMetrics(gamma=3, max_records=2)
    for _ in range(3):
        metrics.record_step(torch.tensor([4, 0, 2]), torch.tensor([3, 0, 1]))
    summary = metrics.summary()
    assert summary.request_steps == 6  # the verify-0 row is padding
    assert summary.committed_tokens == 3 * (4 + 2)
    assert summary.conditional_acceptance == (1.0, 1.0, 1.0)
    assert len(metrics.step_records()) == 2
    with pytest.raises(ValueError, match="request_ids"):
        metrics.record_step(torch.tensor([1]), torch.tensor([0]), request_ids=["a", "b"])


def test_record_step_has_no_host_sync():
    metrics = DSparkMetrics(gamma=4, device="meta")
    metrics.record_step(
        torch.empty(5, dtype=torch.int64, device="meta"),
        torch.empty(5, dtype=torch.int64, device="meta"),
        torch.empty(5, dtype=torch.bool, device="meta"),
        request_ids=list("abcde"),
    )
    assert metrics._totals.device.type == "meta"


def test_cap_trim_gives_block_accept_length():
    metrics = DSparkMetrics(gamma=4)
    metrics.record_step(
        torch.tensor([5, 5, 0]), torch.tensor([1, 2, 0]), cap_trim=torch.tensor([2, 0, 3])
    )
    summary = metrics.summary()
    assert summary.accept_length == pytest.approx((2 + 3) / 2)
    assert summary.block_accept_length == pytest.approx((4 + 3) / 2)  # padding row ignored
