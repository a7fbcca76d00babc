"""Stage 2 of the per-token experts in slot groups (`token_down.py`): the programs of a tile each
form their slots' products and the last of them to arrive reduces them all.

Whatever the grouping (one slot a program, two, every slot in one program) and column width,
the reduce reads the same rounded products in the same slot order: on a GPU the same bits
(checked against each other and against the sorted path); under the CPU interpreter, whose dot
is numpy's matmul (its sums depend on the tile shape), within CHAIN_TOL. Against the reference
on the dequantised stack: CHAIN_TOL. The arrival counters are checked to be zero after every
call (the next launch or graph replay relies on it) and to be reused across calls. Outputs are
poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.moe import token_down
from sgl_dspark.kernels.moe.reference import moe_token_down_reduce_ref
from sgl_dspark.kernels.moe.sort import prepare_moe_sort
from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce, token_down_arrival_count
from test_moe_grouped_gemm import CHAIN_TOL, pytestmark  # noqa: F401
from test_moe_mixed_experts import _routes, _stacks
from test_quantized_gemm import DEVICE, _experts, _same_bits

DTYPE = torch.bfloat16

# (GROUP_SLOTS, BLOCK_N) launch shapes that must agree: every slot in one program (8: as many
# as a case has), two slots, one slot at two widths.
SHAPES = [(8, 16), (2, 32), (1, 64), (1, 16)]

# (M, routed top-k, routed experts, D, I, routing): the extra expert (FP8 beside MXFP4) is the
# last slot but for "no_extra"; "remote": every other routed expert on another rank.
CASES = [
    (1, 6, 8, 160, 64, "shared_last"),  # V4.1's 6 + 1 slots; D: a partial 64-column tile
    (2, 3, 5, 96, 96, "shared_last"),  # I: a partial K step
    (2, 2, 4, 64, 32, "no_extra"),
    (3, 3, 6, 128, 64, "remote"),
]


def _setup(case: tuple, seed: int):
    m, topk, e, d, i, routing = case
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(e + 1, dtype=torch.int32)
    if routing == "remote":
        mask[1:e:2] = 0
    n_loc = int(mask.sum())
    _, down, _, down_ref = _stacks("mxfp4", "fp8", n_loc - 1, d, i, g)
    ids, weights = _routes(m, topk, e, "no_extra" if routing == "no_extra" else "shared_last", g)
    h = torch.randn(ids.numel(), i, generator=g).to(DTYPE).to(DEVICE)
    shared = torch.randn(m, d, generator=g).to(DTYPE).to(DEVICE)
    table = prepare_moe_sort(mask.to(DEVICE)).local_table
    return h, down, down_ref, ids, weights, shared, table, n_loc


def _with_shape(monkeypatch: pytest.MonkeyPatch, group_slots: int, block_n: int) -> None:
    """`_down_meta` with a launch shape of its slot groups (at most the launch's slots)."""
    library = token_down._down_meta

    def shaped(k_dim: int, weight: object, slots: int) -> dict[str, int]:
        groups = min(group_slots, slots)
        return {**library(k_dim, weight, slots), "GROUP_SLOTS": groups, "BLOCK_N": block_n}

    monkeypatch.setattr(token_down, "_down_meta", shaped)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_slot_groups_give_the_same_result(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    h, down, down_ref, ids, weights, shared, table, n_loc = _setup(case, 40 + CASES.index(case))
    m, d = ids.shape[0], down.shape[1]
    want = moe_token_down_reduce_ref(h, down_ref, ids, weights, table, n_loc, 1.0, shared)
    arrivals = torch.zeros(m * d, dtype=torch.int32, device=DEVICE)  # enough for any shape
    outs = []
    for group_slots, block_n in SHAPES:
        with monkeypatch.context() as patch:
            _with_shape(patch, group_slots, block_n)
            for _ in range(2):  # the second call finds the counters re-armed by the first
                out = torch.full((m, d), float("nan"), dtype=DTYPE, device=DEVICE)
                got = moe_token_down_reduce(
                    h, down, ids, weights, table, n_loc, 1.0, shared, out, arrivals
                )
                assert not torch.isnan(got).any()
                assert torch.count_nonzero(arrivals) == 0, "arrival counters left armed"
        torch.testing.assert_close(got, want, **CHAIN_TOL[DTYPE])
        outs.append(got)
    for got in outs[1:]:
        _same_bits(got, outs[0], DTYPE)


def test_arrival_counters_by_launch_shape() -> None:
    """MXFP4 stacks run one slot a program (counters: a token's column tiles); bf16 and FP8
    stacks every slot in one program (none)."""
    g = torch.Generator().manual_seed(5)
    gate_up, down, _, _ = _stacks("mxfp4", "fp8", 4, 160, 64, g)
    meta = token_down._down_meta(64, down.stack, 8)
    assert meta["GROUP_SLOTS"] == 1
    assert token_down_arrival_count(2, down, 7) == 2 * -(-160 // meta["BLOCK_N"])
    _, fp8_down = _experts("fp8", 32, 4, 160, 64, g)
    assert token_down_arrival_count(2, fp8_down, 7) == 0
    bf16_down = torch.randn(4, 160, 64, generator=g).to(DTYPE)
    assert token_down_arrival_count(4, bf16_down, 6) == 0


def test_bad_arrival_counters_are_refused() -> None:
    h, down, _, ids, weights, shared, table, n_loc = _setup(CASES[0], 7)
    need = token_down_arrival_count(ids.shape[0], down, ids.shape[1])
    for bad in (
        torch.zeros(need - 1, dtype=torch.int32, device=DEVICE),
        torch.zeros(need, dtype=torch.int64, device=DEVICE),
    ):
        with pytest.raises(ValueError, match="arrivals must be contiguous int32"):
            moe_token_down_reduce(h, down, ids, weights, table, n_loc, 1.0, shared, None, bad)
    # Without counters a zeroed tensor is made for the call.
    want = moe_token_down_reduce(h, down, ids, weights, table, n_loc, 1.0, shared)
    arrivals = torch.zeros(need, dtype=torch.int32, device=DEVICE)
    got = moe_token_down_reduce(h, down, ids, weights, table, n_loc, 1.0, shared, None, arrivals)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
