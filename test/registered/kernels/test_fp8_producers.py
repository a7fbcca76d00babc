"""Producers that write their output's FP8 form in the same launch (the W8A8 GEMMs' input):
the mHC boundary's normed sublayer input (`mhc_post_combine` / `mhc_pre` with `fp8_out`). The
SiLU-mul-clamp epilogue's "fp8_group" output is tested with the activation
(`test_moe_activation.py`).

The FP8 form is `quantize_act_fp8_ref` of the values the producer stores, bit for bit on every
backend (E4M3 rounded on the bits), whatever the row width: a row narrower than a group, partial
last groups, and rows wider than the boundary's 8192-column register block (its chunked path).
Asking for it changes no other output bit.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.fp8.reference import Fp8ActFormat, quantize_act_fp8_ref
from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine, mhc_pre
from test_mhc import _KW, _make_inputs, _poisoned_out, _prev_pre

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


@pytest.mark.parametrize("single_pass", [False, True])
@pytest.mark.parametrize("opening", [False, True])
@pytest.mark.parametrize(
    "m,d,group,ue8m0",
    [(3, 96, 128, True), (2, 300, 128, False), (4, 256, 32, True), (1, 8448, 128, True)],
)
def test_mhc_boundary_writes_the_quantiser_of_its_normed_input(
    m: int, d: int, group: int, ue8m0: bool, opening: bool, single_pass: bool
) -> None:
    """Single pass: the norm in chunks of 1024 columns over several programs (d 8448: nine,
    the last one partial)."""
    inp = _make_inputs(m, 4, d, torch.bfloat16, seed=m + d + group)
    if single_pass:
        inp["collapse_pre"] = _prev_pre(m, 4, seed=d)
    fmt = Fp8ActFormat(group, ue8m0)
    if opening:
        heads = {
            k: inp[k] for k in ("fn", "base", "scale", "norm_weight", "collapse_pre") if k in inp
        }
        plain = mhc_pre(inp["streams"], **heads, sinkhorn_iters=3, **_KW)
        out = mhc_pre(inp["streams"], **heads, sinkhorn_iters=3, **_KW, fp8_out=fmt)
    else:
        plain = mhc_post_combine(**inp, sinkhorn_iters=3, **_KW)
        poisoned = _poisoned_out(m, 4, d, torch.bfloat16)
        out = mhc_post_combine(**inp, sinkhorn_iters=3, **_KW, out=poisoned, fp8_out=fmt)
    assert plain.x_fp8 is None and out.x_fp8 is not None
    want = quantize_act_fp8_ref(out.x_normed, group, ue8m0)
    assert out.x_fp8.scale.shape == (m, -(-d // group))
    assert torch.equal(out.x_fp8.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(out.x_fp8.scale, want.scale)
    # Nothing else moves.
    for name in ("streams", "pre", "post", "comb", "x_in", "x_normed"):
        a, b = getattr(out, name), getattr(plain, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
