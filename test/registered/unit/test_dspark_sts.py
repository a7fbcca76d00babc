"""STS calibration: ECE, left-to-right grid fit, JSON record, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from sgl_dspark.srt.speculative.dspark.sts import (
    StsCalibration,
    apply_sts,
    expected_calibration_error,
    fit_sts,
    sts_temperature_grid,
)
from sgl_dspark.tools import dspark_sts_fit


def _ece_loop(probs: list[float], labels: list[float], bins: int = 15) -> float:
    total = 0.0
    for b in range(bins):
        members = [
            (min(max(p, 1e-8), 1 - 1e-8), y)
            for p, y in zip(probs, labels)
            if min(int(min(max(p, 1e-8), 1 - 1e-8) * bins), bins - 1) == b
        ]
        if members:
            mean_p = sum(p for p, _ in members) / len(members)
            mean_y = sum(y for _, y in members) / len(members)
            total += len(members) / len(probs) * abs(mean_p - mean_y)
    return total


def _synthetic(n: int, true_t: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    raw = 1.0 + 2.0 * torch.randn((n, len(true_t)), generator=gen, dtype=torch.float64)
    c = torch.sigmoid(raw / torch.tensor(true_t, dtype=torch.float64))
    accepted = torch.rand(c.shape, generator=gen, dtype=torch.float64) < c
    prefix = torch.cumprod(accepted.to(torch.int64), dim=1)
    return raw.float(), prefix.float()


def test_ece_hand_derived():
    probs = torch.tensor([0.05, 0.05, 0.95, 0.95])
    labels = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin 0: |0.05 - 0.5| * 2/4 = 0.225; bin 14: |0.95 - 1| * 2/4 = 0.025.
    assert float(expected_calibration_error(probs, labels)) == pytest.approx(0.25)
    # p = 1 lands in the last bin, p = 0 is clamped to 1e-8 in bin 0.
    assert float(
        expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    ) == pytest.approx((1e-8 + 1e-8) / 2, abs=1e-12)


def test_ece_matches_loop_reference():
    gen = torch.Generator().manual_seed(3)
    for bins in (1, 7, 15):
        probs = torch.rand((500, 4), generator=gen, dtype=torch.float64)
        labels = (torch.rand(500, generator=gen) < 0.4).double()
        got = expected_calibration_error(probs, labels, bins)
        for col in range(4):
            assert float(got[col]) == pytest.approx(
                _ece_loop(probs[:, col].tolist(), labels.tolist(), bins), rel=1e-9
            )
    with pytest.raises(ValueError, match="rows"):
        expected_calibration_error(torch.rand(3), torch.rand(4))


def test_grid():
    grid = sts_temperature_grid()
    assert grid.numel() == 41
    assert float(grid[0]) == pytest.approx(0.1) and float(grid[-1]) == pytest.approx(10.0)
    ratios = grid[1:] / grid[:-1]
    assert torch.allclose(ratios, torch.full_like(ratios, 10 ** (2 / 40)))


def test_fit_recovers_known_temperatures():
    true_t = [0.5, 1.0, 2.0, 3.5]
    raw, prefix = _synthetic(40_000, true_t, seed=0)
    calib = fit_sts(raw, prefix, dataset="synthetic")
    assert calib.num_samples == 40_000 and calib.dataset == "synthetic"
    for fitted, true in zip(calib.temperatures, true_t):
        assert abs(math.log10(fitted / true)) <= 0.1, (
            calib.temperatures,
            true_t,
        )  # within 2 grid steps
    for k, true in enumerate(true_t):
        assert calib.ece_after[k] <= calib.ece_before[k] + 1e-12
        if true != 1.0:
            assert calib.ece_after[k] < 0.5 * calib.ece_before[k]
    # Reported ECE is the ECE of the fitted cumulative survival.
    cum = torch.cumprod(apply_sts(raw, calib.temperatures).double(), dim=1)
    for k in range(len(true_t)):
        assert calib.ece_after[k] == pytest.approx(
            float(expected_calibration_error(cum[:, k], prefix[:, k])), abs=1e-6
        )


def test_fit_validates_inputs():
    with pytest.raises(ValueError, match="\\[n, gamma\\]"):
        fit_sts(torch.zeros(5, 3), torch.zeros(5, 2))
    with pytest.raises(ValueError, match="non-finite"):
        fit_sts(torch.tensor([[float("nan")]]), torch.ones(1, 1))


def test_apply():
    raw = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    temps = [0.5, 1.0, 4.0]
    want = 1 / (1 + torch.exp(-raw / torch.tensor(temps)))
    assert torch.allclose(apply_sts(raw, temps), want, atol=1e-6)
    assert torch.allclose(StsCalibration(tuple(temps)).apply(raw), want, atol=1e-6)


def test_json_round_trip_and_validation(tmp_path):
    calib = StsCalibration((0.5, 2.0), "d", 10, (0.1, 0.2), (0.01, 0.02))
    calib.save(tmp_path / "s.json")
    assert StsCalibration.load(tmp_path / "s.json", gamma=2) == calib
    with pytest.raises(
        ValueError, match="'temperatures' has 2 entries but the draft block size is 3"
    ):
        StsCalibration.load(tmp_path / "s.json", gamma=3)
    good = calib.to_json_dict()
    for patch, field in [
        ({"temperatures": []}, "'temperatures'"),
        ({"temperatures": [1.0, 0.0]}, "'temperatures'\\[1\\]"),
        ({"temperatures": [1.0, -2.0]}, "'temperatures'\\[1\\]"),
        ({"temperatures": [1.0, "a"]}, "'temperatures'\\[1\\]"),
        ({"num_samples": -1}, "'num_samples'"),
        ({"dataset": 3}, "'dataset'"),
        ({"ece_after": [0.1]}, "'ece_after'"),
    ]:
        with pytest.raises(ValueError, match=field):
            StsCalibration.from_json_dict({**good, **patch})
    assert StsCalibration.from_json_dict({"temperatures": [1, 2]}).temperatures == (1.0, 2.0)
    assert StsCalibration.identity(3).temperatures == (1.0, 1.0, 1.0)


def test_cli(tmp_path):
    raw, prefix = _synthetic(6000, [0.7, 1.5, 1.5], seed=4)
    for i in range(3):
        sl = slice(i * 2000, (i + 1) * 2000)
        torch.save({"raw": raw[sl], "prefix_mask": prefix[sl]}, tmp_path / f"col.{i}.pt")
    out = tmp_path / "sts.json"
    assert (
        dspark_sts_fit.main(
            ["--data-glob", str(tmp_path / "col.*.pt"), "--out", str(out), "--gamma", "3"]
        )
        == 0
    )
    data = json.loads(out.read_text())
    want = fit_sts(raw, prefix)
    assert data["temperatures"] == pytest.approx(list(want.temperatures))
    assert data["num_samples"] == 6000
    with pytest.raises(ValueError, match="gamma 3, --gamma is 4"):
        dspark_sts_fit.load_shards(str(tmp_path / "col.*.pt"), gamma=4)
    with pytest.raises(ValueError, match="matches no file"):
        dspark_sts_fit.load_shards(str(tmp_path / "nothing.*.pt"))
