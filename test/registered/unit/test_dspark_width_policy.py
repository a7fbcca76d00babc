"""Static per-step verify width policy, incl. the behavioural checks of the reference policy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sgl_dspark.srt.speculative.dspark.sps import AdditiveSpsTable, DiagonalSpsTable
from sgl_dspark.srt.speculative.dspark.width_policy import (
    VerifyWidthPolicy,
    device_table_key,
    packaged_sps_table_path,
    parse_verify_widths,
    resolve_width_sps_table,
)

FULL = 6
TOKENS = (
    6,
    12,
    24,
    48,
    96,
    144,
    192,
    240,
    288,
    336,
    384,
    480,
    576,
    672,
    768,
    960,
    1152,
    1344,
    1536,
)


def synthetic_table() -> DiagonalSpsTable:
    """A synthetic profile: step time 10 ms + 0.05 ms per verify token."""
    return DiagonalSpsTable(TOKENS, tuple(1000.0 / (10.0 + 0.05 * t) for t in TOKENS), TOKENS[-1])


def geometric_hazard(mean_accept: float) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(60):  # solve sum_{i<=5} h^i = mean_accept by bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(FULL)) < mean_accept else (lo, mid)
    return lo


def full_width_counts(h: float, widths: tuple[int, ...], total: int = 100_000) -> list[list[int]]:
    counts = [[0] * FULL for _ in widths]
    row = counts[widths.index(FULL)]
    for k in range(FULL - 1):
        row[k] = round(total * h**k * (1 - h))
    row[FULL - 1] = round(total * h ** (FULL - 1))
    return counts


def expected_ref(hazards: list[float], w: int) -> float:
    return 1 + sum(float(np.prod(hazards[: j + 1])) for j in range(w - 1))


def trained_policy(**kw) -> VerifyWidthPolicy:
    policy = VerifyWidthPolicy([3, 4], FULL, synthetic_table(), **kw)
    policy.update_hazards(full_width_counts(geometric_hazard(3.25), policy.widths))
    return policy


def test_parse_widths():
    assert parse_verify_widths("3,4", FULL) == (3, 4, 6)
    assert parse_verify_widths(" 2 , 3,3", FULL) == (2, 3, 6)
    assert parse_verify_widths([], FULL) == (6,)
    assert parse_verify_widths("", FULL) == (6,)
    for bad in ("1", "6", "7", "3,6", [1, 3], [7]):
        with pytest.raises(ValueError, match="2 <= w < 6"):
            parse_verify_widths(bad, FULL)
    with pytest.raises(ValueError, match="comma list"):
        parse_verify_widths("3,x", FULL)


def test_behaviour_full_width_small_batch_narrow_at_large_batch():
    policy = trained_policy()
    hazards = policy.hazards
    assert all(h is not None for h in hazards)
    assert expected_ref(hazards, FULL) == pytest.approx(3.25, rel=1e-3)
    assert policy.choose(1) == FULL
    assert policy.choose(8) == FULL
    assert policy.choose(256) in (3, 4)
    # The narrow choice is the argmax of B * E(w) * interp-SPS(B * w), computed independently.
    preds = {
        w: 256
        * expected_ref(hazards, w)
        * np.interp(256 * w, TOKENS, [1000 / (10 + 0.05 * t) for t in TOKENS])
        for w in (3, 4, 6)
    }
    assert policy.current == max(preds, key=preds.get)


def test_margin_pins_current_width():
    policy = trained_policy(switch_margin=10.0)
    assert [policy.choose(b) for b in (1, 8, 256, 256)] == [FULL] * 4


def test_undefined_hazards_and_exploration():
    policy = VerifyWidthPolicy([3, 4], FULL, synthetic_table())
    assert policy.hazards == [None] * (FULL - 1)
    assert policy.choose(256) == FULL  # no statistics yet
    policy = trained_policy()
    picks = [policy.choose(256) for _ in range(130)]
    explore = [i + 1 for i, w in enumerate(picks) if w == FULL]
    assert explore == [64, 128]


def test_width3_update_is_censored():
    policy = trained_policy()
    before = policy.hazards
    reached, correct = list(policy._reached), list(policy._correct)
    counts = [[0] * FULL for _ in policy.widths]
    counts[policy.widths.index(3)][:3] = [100, 5000, 100]  # width 3 verifies 2 drafts
    policy.update_hazards(counts)
    after = policy.hazards
    assert after[0] > before[0]
    assert after[1] < before[1]
    assert after[2:] == before[2:]
    # Hand-derived decayed update: reached_0 = 5200, correct_0 = 5100; reached_1 = 5100, correct_1 = 100.
    assert after[0] == pytest.approx((0.9 * correct[0] + 5100) / (0.9 * reached[0] + 5200))
    assert after[1] == pytest.approx((0.9 * correct[1] + 100) / (0.9 * reached[1] + 5100))


def test_forced_width():
    policy = VerifyWidthPolicy([3, 4], FULL, synthetic_table(), forced_width=4)
    assert policy.choose(1) == 4 and policy.choose(512) == 4
    with pytest.raises(ValueError, match="forced verify width"):
        VerifyWidthPolicy([3, 4], FULL, synthetic_table(), forced_width=5)
    assert trained_policy().choose(256, force_full=True) == FULL


def test_device_histogram_with_interval_lag():
    policy = VerifyWidthPolicy([3], FULL, synthetic_table(), update_interval=2)
    gen = torch.Generator().manual_seed(0)
    intervals = []
    for interval in range(3):
        hist = np.zeros((2, FULL), dtype=np.int64)
        for _ in range(2):
            width = 3 if interval == 1 else FULL
            lens = torch.randint(0, width, (9,), generator=gen)
            mask = torch.rand(9, generator=gen) < 0.8
            policy.record_step(width, lens, mask)
            for n, m in zip(lens.tolist(), mask.tolist()):
                hist[policy.widths.index(width), n] += m
        intervals.append(hist)
        if interval == 0:
            assert policy.hazards == [None] * (FULL - 1)  # first snapshot not consumed yet
    ref = VerifyWidthPolicy([3], FULL, synthetic_table())
    for hist in intervals[:2]:  # the third interval is still pending (one-interval lag)
        ref.update_hazards(hist.tolist())
    assert policy.hazards == pytest.approx(ref.hazards)


def test_table_resolution(tmp_path):
    assert device_table_key("NVIDIA H200") == "nvidia_h200"
    assert device_table_key("AMD Instinct MI355X") == "amd_instinct_mi355x"
    table = synthetic_table()
    (tmp_path / "dspark_sps_nvidia_h200.json").write_text(json.dumps(table.to_json_dict()))
    assert packaged_sps_table_path("NVIDIA H200", tmp_path) is not None
    assert resolve_width_sps_table("NVIDIA H200", tables_dir=tmp_path) == table
    # A table profiled on one device is never used for another.
    assert resolve_width_sps_table("AMD Instinct MI355X", tables_dir=tmp_path) is None
    # No default ships: an unknown device gets no table from the package.
    assert resolve_width_sps_table("Unknown Accelerator 9000") is None
    user = tmp_path / "user.json"
    user.write_text(json.dumps(DiagonalSpsTable((1, 2), (5.0, 4.0), 2).to_json_dict()))
    assert resolve_width_sps_table("AMD Instinct MI355X", user, tmp_path).sample_batch_tokens == (
        1,
        2,
    )


def test_rejects_non_diagonal_table():
    additive = AdditiveSpsTable(0.01, (1,), (0.0,), (1,), (0.0,))
    with pytest.raises(ValueError, match="diagonal"):
        VerifyWidthPolicy([3], FULL, additive)  # type: ignore[arg-type]


def test_static_width_table_width_one_means_plain_decode(tmp_path):
    """Width 1 in the static table turns speculation off at that batch size (and above, up to
    the next key); widths outside [1, gamma + 1] are rejected with the field named."""
    from sgl_dspark.srt.speculative.dspark.policy import (
        PolicyArgs,
        StaticWidthPolicy,
        load_width_table,
    )

    path = tmp_path / "w.json"
    path.write_text(json.dumps({"widths_by_batch_size": {"1": "full", "4": 3, "16": 1}}))
    assert load_width_table(path, 8) == {1: 8, 4: 3, 16: 1}
    policy = StaticWidthPolicy(7, PolicyArgs(width_table_path=str(path)), torch.device("cpu"))
    assert [policy.plain_decode(b) for b in (1, 3, 4, 15, 16, 64)] == [False] * 4 + [True] * 2
    assert 1 in policy.graph_widths()
    for bad in (0, 9):
        path.write_text(json.dumps({"widths_by_batch_size": {"1": bad}}))
        with pytest.raises(ValueError, match="widths_by_batch_size|width"):
            load_width_table(path, 8)
    assert load_width_table(path, 8, clamp=True) == {1: 8}  # 9 > full: clamped, not rejected


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_packaged_h200_table_serves_every_block_size(gamma):
    """Without --speculative-dspark-width-table-path the static policy on an H200 reads the
    packaged table; its widths are clamped to the model's full width, so small blocks load it."""
    from sgl_dspark.srt.speculative.dspark.policy import PolicyArgs, StaticWidthPolicy

    policy = StaticWidthPolicy(gamma, PolicyArgs(device_name="NVIDIA H200"), torch.device("cpu"))
    widths = [policy.width(b) for b in (1, 2, 8, 16, 32, 64)]
    assert all(1 <= w <= gamma + 1 for w in widths) and not policy.plain_decode(32)
    assert set(widths) <= set(policy.graph_widths())
