"""The benchmark cases whose launcher writes into an input buffer (a KV pool, an index-key cache):
their reference and launcher, run on separate input sets as `run_all` runs them, pass the case's
check, and the check rejects a launcher output with one slot changed (it compares the buffers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.kernels import bench_indexer, bench_mhc_indexer, bench_spec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {c["name"]: c for c in bench_spec.CASES + bench_mhc_indexer.CASES + bench_indexer.CASES}
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize(
    "name,buffer",
    [("rope_q_kv_store_norms", 1), ("fp4_index_k_quant_store_68B_slots", None)],
)
def test_buffer_writing_case_checks(name: str, buffer: int | None, m: int) -> None:
    case = CASES[name]
    want = case["reference"](**case["make_inputs"](m, DEVICE))
    inputs = case["make_inputs"](m, DEVICE)
    untouched = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    got = case["launcher"](**inputs)
    case["check"](want, got)
    out = got if buffer is None else got[buffer]
    assert not torch.equal(out, untouched["cache" if buffer is None else "kv_out"]), (
        "the launcher wrote nothing"
    )
    # The slot the launcher wrote first, corrupted: the check must notice.
    slot = (inputs["loc"] if buffer is None else inputs["kv_rows"])[0]
    out[slot] = out[slot] + 1 if out.dtype == torch.uint8 else out[slot] * 3 + 1
    with pytest.raises(AssertionError):
        case["check"](want, got)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("steady", [False, True])
def test_compressor_decode_cases(steady: bool, m: int) -> None:
    """The fused decode step's cases: a block-end step writes one entry per request, a steady
    step none; both write every row to the ring; the check compares the entry pool and the
    rings, and rejects a changed entry or ring row."""
    case = CASES["compressor_decode_hca_m128_dh128" + ("_steady" if steady else "")]
    want = case["reference"](**case["make_inputs"](m, DEVICE))
    inputs = case["make_inputs"](m, DEVICE)
    before = inputs["entries"].clone()
    got = case["launcher"](**inputs)
    case["check"](want, got)
    changed = (got[0] != before).any(dim=1).nonzero().flatten()
    assert changed.numel() == (0 if steady else bench_indexer._bs_w(m)[0])
    assert (inputs["counters"] == 0).all()
    for buffer, row in ((0, changed[0] if changed.numel() else None), (1, inputs["token_slot"][0])):
        if row is None:
            continue
        got[buffer][row] = got[buffer][row] * 3 + 1
        with pytest.raises(AssertionError):
            case["check"](want, got)
        got[buffer][row] = want[buffer][row]


def test_launch_floor_case_adds_one_and_its_check_rejects_a_wrong_value() -> None:
    from benchmark.kernels import bench_floor

    (case,) = bench_floor.CASES
    for m in (1, 32):
        inputs = case["make_inputs"](m, DEVICE)
        got = case["launcher"](**inputs)
        case["check"](case["reference"](**inputs), got)
        assert inputs["x"].item() != 0.0  # random, not zeros
        assert case["launcher"](torch.full((1,), 2.5, device=DEVICE)).item() == 3.5
        with pytest.raises(AssertionError):
            case["check"](case["reference"](**inputs), got + 1)
