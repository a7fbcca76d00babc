"""The MX routed experts (`kernels/fp8/mx_moe.py`: MXFP8 activations x MXFP4 weights through
`tl.dot_scaled`) against `mx_fused_moe_ref`.

The Triton interpreter cannot run `tl.dot_scaled` (it has no implementation of it). On a CPU the
kernel therefore takes its EMULATE variant, which forms the same products from the dequantised
tiles with an fp32 dot: the test checks everything else the kernel does there (the sort's
blocks and padding, remote and out-of-range routes, stage 1's SwiGLU and route weight, the
MXFP8 epilogue, stage 2). The scaled instruction itself is checked by compiling the kernel for
gfx950 (`gpu_targets_check.py`: `v_mfma_scale_f32_*_f8f6f4`), and on a GPU this test runs the
real `tl.dot_scaled` (native on gfx950 and Blackwell, emulated by Triton on sm90). The same math
also runs through the W4A16 kernels: every MXFP8 value is exact in bf16, so stage 1 and stage 2
of `fused_moe`'s grouped GEMM on the MXFP8-rounded x and activation compute the MX reference.

Tolerance: the products are exact and summed in fp32 in another order than the reference's
(bf16 outputs: one ulp where a sum lands near a rounding boundary; an activation that rounds
differently moves one MXFP8 code, a relative step of 2^-3 of that element).
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.fp8.mx_moe import mx_fused_moe
from sgl_dspark.kernels.fp8.reference import (
    dequantize_act_mxfp8_ref,
    mx_fused_moe_ref,
    quantize_act_mxfp8_ref,
)
from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.kernels.moe.grouped_gemm import moe_grouped_gemm
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort
from sgl_dspark.srt.model_loader.quantization import mxfp4_to_runtime, quantize_mxfp4
from test_moe_grouped_gemm import _local_pairs, _mask, _routes, pytestmark  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Outputs within 2^-6 relative of the output scale: bf16 rounding of the product before the
# activation (2^-9) can move an MXFP8 code of h by one step (2^-3 of that element); a sum
# over I such elements moves by far less than that relative to the output's scale.
MX_TOL = dict(rtol=2**-6, atol=2**-6)


def mxfp4(w: torch.Tensor) -> QuantizedWeight:
    q = mxfp4_to_runtime(*quantize_mxfp4(w, 32), 32)
    return q._replace(data=q.data.to(DEVICE), scale=q.scale.to(DEVICE))


def _setup(m: int, e: int, d: int, inter: int, topk: int, routing: str, mask_kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up = mxfp4(torch.randn(e, 2 * inter, d, generator=gen) * 0.1)
    down = mxfp4(torch.randn(e, d, inter, generator=gen) * 0.1)
    x = (torch.randn(m, d, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    ids, weights = _routes(m, topk, e, routing, gen)
    mask = _mask(mask_kind, e, gen)
    sort = moe_sort(ids, weights, prepare_moe_sort(mask), 0, block_size=32)  # plan on DEVICE
    return x, gate_up, down, ids, weights, mask, sort


def _close_where_local(got: torch.Tensor, want: torch.Tensor, local: torch.Tensor) -> None:
    torch.testing.assert_close(got[local].float(), want[local].float(), **MX_TOL)


# (M, E, D, I, topk, routing, mask)
CASES = [
    (5, 4, 96, 64, 2, "random", "all_local"),  # D past one 128-channel step, partial
    (37, 8, 128, 96, 3, "hot", "ep_slice"),  # full blocks of one expert; remote experts
    (9, 6, 64, 128, 4, "fills", "random"),  # out-of-range ids dropped, random locality
]


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_mx_fused_moe_matches_reference(case: tuple, before: bool) -> None:
    m, e, d, inter, topk, routing, mask_kind = case
    x, gate_up, down, ids, weights, mask, sort = _setup(*case, seed=CASES.index(case))
    out = torch.full((m, topk, d), float("nan"), dtype=x.dtype, device=DEVICE)
    got = mx_fused_moe(x, gate_up, down, sort, topk, 7.0, out=out, weight_before_down=before)
    assert got is out
    want = mx_fused_moe_ref(x, gate_up, down, ids, mask, 7.0, weights if before else None)
    local = _local_pairs(ids, mask)
    assert not torch.isnan(got[local]).any()
    assert torch.isnan(got[~local]).all()  # remote routes are never written
    _close_where_local(got, want, local)
    # The producer's MXFP8 form of x gives the same bits as quantising it here.
    again = mx_fused_moe(
        x, gate_up, down, sort, topk, 7.0, weight_before_down=before, x_mx=quantize_act_mxfp8_ref(x)
    )
    assert torch.equal(again[local], got[local])


def test_same_math_through_the_w4a16_kernels() -> None:
    """The MX reference is what the W4A16 grouped GEMMs compute on MXFP8-rounded inputs: stage 1
    (SwiGLU epilogue) on x's MXFP8 values, the activation's MXFP8 values, stage 2."""
    m, e, d, inter, topk = 11, 4, 96, 64, 2
    x, gate_up, down, ids, weights, mask, sort = _setup(
        m, e, d, inter, topk, "random", "all_local", 9
    )
    routes = (sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, topk)
    x_mx = dequantize_act_mxfp8_ref(quantize_act_mxfp8_ref(x)).to(x.dtype)  # exact in bf16
    h = moe_grouped_gemm(x_mx, gate_up, *routes, out_swiglu=True, swiglu_limit=7.0)
    h_mx = dequantize_act_mxfp8_ref(quantize_act_mxfp8_ref(h)).to(x.dtype)
    y = moe_grouped_gemm(h_mx, down, *routes, a_per_pair=True).view(m, topk, d)
    want = mx_fused_moe_ref(x, gate_up, down, ids, mask, 7.0)
    _close_where_local(y, want, _local_pairs(ids, mask))
    got = mx_fused_moe(x, gate_up, down, sort, topk, 7.0)
    _close_where_local(got, y, _local_pairs(ids, mask))


def test_bad_arguments_raise() -> None:
    x, gate_up, down, ids, weights, mask, sort = _setup(3, 2, 96, 64, 2, "random", "all_local", 1)
    fp8 = gate_up._replace(fmt="fp8")
    with pytest.raises(ValueError, match="gate_up_proj"):
        mx_fused_moe(x, fp8, down, sort, 2, 7.0)
    with pytest.raises(ValueError, match="down_proj"):
        mx_fused_moe(x, gate_up, gate_up, sort, 2, 7.0)
    with pytest.raises(ValueError, match="block_size"):
        mx_fused_moe(x, gate_up, down, sort, 2, 7.0, block_size=24)
    # The checks it shares with `fused_moe` (`fused_moe_out`).
    with pytest.raises(ValueError, match="limit"):
        mx_fused_moe(x, gate_up, down, sort, 2, 0.0)
    with pytest.raises(ValueError, match="out must be"):
        mx_fused_moe(x, gate_up, down, sort, 2, 7.0, out=torch.empty(3, 3, 96, device=DEVICE))
    for field in ("sorted_ids", "sorted_weights"):
        elsewhere = sort._replace(**{field: getattr(sort, field).to("meta")})
        with pytest.raises(ValueError, match=f"{field} is on meta"):
            mx_fused_moe(x, gate_up, down, elsewhere, 2, 7.0)
