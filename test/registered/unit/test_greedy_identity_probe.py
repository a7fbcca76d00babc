"""`benchmark/gpu/greedy_identity_probe.py`'s bookkeeping on hand-built forwards: which verify
rows count (their context is the no-spec run's), and which module is named first."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmark.gpu.greedy_identity_probe import (  # noqa: E402
    by_position,
    clean_rows,
    compare,
    reference_tokens,
    row_checksums,
)


def _fwd(positions, ids, sums):
    """A forward record; `sums` maps module -> one checksum value per row."""
    modules = [(name, torch.tensor([[v, 2 * v] for v in vals])) for name, vals in sums.items()]
    return {"positions": positions, "input_ids": ids, "modules": modules}


def test_row_checksums_see_one_ulp() -> None:
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[1, 5] += 1  # the next bf16 value
    a, b = row_checksums(x), row_checksums(y)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and not torch.equal(a[1], b[1])


def test_clean_rows_stop_at_the_first_token_the_reference_did_not_commit() -> None:
    tokens = {0: 5, 1: 6, 2: 7, 3: 8}
    fwd = _fwd([1, 2, 3], [6, 9, 8], {"m": [1, 2, 3]})
    assert clean_rows(fwd, tokens) == [0]  # row 2 holds 8 at position 3 but follows a rejection
    assert clean_rows(_fwd([1, 2], [6, 7], {"m": [1, 2]}), tokens) == [0, 1]


def test_compare_names_the_first_module_that_finished_differently() -> None:
    plain = {
        "output_ids": [7, 8, 4],
        "forwards": [
            _fwd([0, 1], [5, 6], {"a": [1, 1], "b": [2, 2]}),
            _fwd([2], [7], {"a": [3], "b": [4]}),
            _fwd([3], [8], {"a": [5], "b": [6]}),
        ],
    }
    spec = {
        "output_ids": [7, 8, 9],
        "forwards": [
            _fwd([0, 1], [5, 6], {"a": [1, 1], "b": [2, 2]}),
            _fwd([2, 3], [7, 8], {"a": [3, 5], "b": [4, 60]}),  # position 3: b differs, a not
        ],
    }
    tokens = reference_tokens(plain["forwards"], plain["output_ids"])
    assert tokens == {0: 5, 1: 6, 2: 7, 3: 8, 4: 4}
    assert set(by_position(spec["forwards"], tokens)) == {0, 1, 2, 3}
    got = compare(plain, spec)
    assert got["identical"] is False and got["first_token_difference"] == 2
    assert got["position"] == 3 and got["first_modules"] == ["b"]
    assert compare(plain, plain) == {"identical": True, "tokens": 3}
