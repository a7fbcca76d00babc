"""SPS cost tables: JSON validation, round trip and the three lookups."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from sgl_dspark.srt.speculative.dspark.sps import (
    AdditiveSpsTable,
    DiagonalSpsTable,
    load_sps_table,
    save_sps_table,
    sps_table_from_json_dict,
)

DIAG = {
    "sample_batch_tokens": [6, 12, 24, 48, 96],
    "sample_steps_per_sec": [94.4, 82.3, 74.3, 63.7, 52.4],
    "max_batch_tokens": 96,
}
ADD = {
    "bias_seconds": 0.01,
    "bs_probes": [1, 8, 32],
    "alpha_seconds": [0.0, 0.002, 0.005],
    "m_probes": [64, 128, 256],
    "theta_seconds": [0.0, 0.003, -0.001],
}


def _floor_ref(tokens: list[int], values: list[float], t: float) -> float:
    best = values[0]
    for probe, v in zip(tokens, values):
        if probe <= t:
            best = v
    return best


def _lerp_ref(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def test_diagonal_round_trip_and_lookups(tmp_path):
    table = sps_table_from_json_dict(DIAG)
    assert isinstance(table, DiagonalSpsTable)
    path = tmp_path / "sps.json"
    save_sps_table(table, path)
    again = load_sps_table(path)
    assert again == table
    rng = random.Random(0)
    for _ in range(200):
        t = rng.uniform(0, 130)
        assert float(table.steps_per_sec_floor(t)) == _floor_ref(
            DIAG["sample_batch_tokens"], DIAG["sample_steps_per_sec"], t
        )
        assert float(table.steps_per_sec_interp(t)) == pytest.approx(
            _lerp_ref(DIAG["sample_batch_tokens"], DIAG["sample_steps_per_sec"], t), rel=1e-12
        )
    # Exact probes, just below a probe and the clamped ends.
    assert float(table.steps_per_sec_floor(12)) == 82.3
    assert float(table.steps_per_sec_floor(11)) == 94.4
    assert float(table.steps_per_sec_floor(1)) == 94.4
    assert float(table.steps_per_sec_floor(10_000)) == 52.4
    assert float(table.steps_per_sec_interp(18)) == pytest.approx((82.3 + 74.3) / 2)
    # Vectorised lookups agree with the scalar ones.
    ts = np.array([3, 6, 7, 47, 48, 200])
    np.testing.assert_array_equal(
        table.steps_per_sec_floor(ts), [float(table.steps_per_sec_floor(t)) for t in ts]
    )


def test_additive_round_trip_and_lookup(tmp_path):
    table = sps_table_from_json_dict(ADD)
    assert isinstance(table, AdditiveSpsTable)
    save_sps_table(table, tmp_path / "a.json")
    assert load_sps_table(tmp_path / "a.json") == table
    rng = random.Random(1)
    for _ in range(200):
        bs, m = rng.uniform(0, 40), rng.uniform(0, 300)
        want = (
            0.01
            + _lerp_ref(ADD["bs_probes"], ADD["alpha_seconds"], bs)
            + _lerp_ref(ADD["m_probes"], ADD["theta_seconds"], m)
        )
        assert float(table.step_seconds(bs, m)) == pytest.approx(want, rel=1e-12)
        assert float(table.steps_per_sec(bs, m)) == pytest.approx(1 / want, rel=1e-12)
    # Hand-derived point: bs 20 is halfway between 8 and 32, M 192 halfway between 128 and 256.
    assert float(table.step_seconds(20, 192)) == pytest.approx(0.01 + 0.0035 + 0.001)


def test_kind_detection(tmp_path):
    both = {**DIAG, **ADD}
    assert isinstance(sps_table_from_json_dict(both), AdditiveSpsTable)
    assert isinstance(sps_table_from_json_dict(both, kind="diagonal"), DiagonalSpsTable)
    with pytest.raises(ValueError, match="neither"):
        sps_table_from_json_dict({"foo": 1})
    with pytest.raises(ValueError, match="kind"):
        sps_table_from_json_dict(DIAG, kind="bogus")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_sps_table(bad)


def test_uninitialised_table():
    table = DiagonalSpsTable.uninitialised()
    assert table.is_uninitialised
    assert not sps_table_from_json_dict(DIAG).is_uninitialised
    for t in (1, 7, 1000):
        assert float(table.steps_per_sec_floor(t)) == 1.0
        assert float(table.steps_per_sec_interp(t)) == 1.0


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"sample_batch_tokens": [6, 12, 12, 48, 96]}, "strictly increasing"),
        ({"sample_batch_tokens": [6, 12, 8, 48, 96]}, "strictly increasing"),
        ({"sample_batch_tokens": [0, 12, 24, 48, 96]}, "'sample_batch_tokens'\\[0\\] must be >= 1"),
        (
            {"sample_batch_tokens": [6, 12.5, 24, 48, 96]},
            "'sample_batch_tokens'\\[1\\] must be an integer",
        ),
        ({"sample_batch_tokens": []}, "'sample_batch_tokens' must be a non-empty list"),
        (
            {"sample_steps_per_sec": [94.4, 82.3, 0.0, 63.7, 52.4]},
            "'sample_steps_per_sec'\\[2\\] must be > 0",
        ),
        (
            {"sample_steps_per_sec": [94.4, 82.3, -1.0, 63.7, 52.4]},
            "'sample_steps_per_sec'\\[2\\] must be > 0",
        ),
        (
            {"sample_steps_per_sec": [94.4, 82.3]},
            "'sample_steps_per_sec' has 2 entries, expected 5",
        ),
        ({"sample_steps_per_sec": [94.4, 82.3, float("nan"), 63.7, 52.4]}, "finite"),
        ({"max_batch_tokens": 0}, "'max_batch_tokens'"),
        ({"max_batch_tokens": "96"}, "'max_batch_tokens'"),
    ],
)
def test_diagonal_validation(patch, field):
    with pytest.raises(ValueError, match=field):
        DiagonalSpsTable.from_json_dict({**DIAG, **patch})


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"bias_seconds": 0.0}, "'bias_seconds' must be > 0"),
        ({"bias_seconds": None}, "'bias_seconds'"),
        ({"bs_probes": [1, 8, 8]}, "'bs_probes' must be strictly increasing"),
        ({"m_probes": [64, 32, 256]}, "'m_probes' must be strictly increasing"),
        ({"alpha_seconds": [0.0, 0.002]}, "'alpha_seconds' has 2 entries, expected 3"),
        ({"theta_seconds": [0.0, "x", 0.1]}, "'theta_seconds'\\[1\\]"),
        ({"theta_seconds": [0.0, 0.0, -0.02]}, "must be > 0"),
    ],
)
def test_additive_validation(patch, field):
    with pytest.raises(ValueError, match=field):
        AdditiveSpsTable.from_json_dict({**ADD, **patch})


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="strictly increasing"):
        DiagonalSpsTable((4, 2), (1.0, 2.0), 4)
    table = DiagonalSpsTable((2, 4), (3.0, 2.0), 4)
    assert json.loads(json.dumps(table.to_json_dict()))["sample_batch_tokens"] == [2, 4]


def test_load_error_names_the_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**DIAG, "sample_steps_per_sec": [1, 2, 3, 4, -5]}))
    with pytest.raises(ValueError, match="t.json.*'sample_steps_per_sec'\\[4\\]"):
        load_sps_table(path)
