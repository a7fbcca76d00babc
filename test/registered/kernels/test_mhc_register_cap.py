"""The mHC boundary's phase A under a register cap (`post_combine._PHASE_A_MAX_REGISTERS`, NVIDIA's
`maxnreg`): asked for only where the backend takes one and only for the single-pass row tile of
`_CAPPED_BLOCK_M` rows; on a GPU the capped boundary gives the uncapped one's bits (a cap changes
registers, not instructions' results). That the capped launch compiles within the cap without
spilling is checked ahead of time (`gpu_targets_check.check_register_caps`)."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels import _triton_utils
from sgl_dspark.kernels.mhc import post_combine as mhc_module
from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine
from test_mhc import _KW, DEVICE, _make_inputs, _poisoned_out, _prev_pre

_OUTPUTS = ("streams", "pre", "post", "comb", "x_in", "x_normed")


def test_register_cap_only_where_the_backend_takes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _triton_utils.register_cap(torch.device("cpu"), 168) == {}
    assert _triton_utils.register_cap(torch.device("cuda", 0), None) == {}
    # The device test itself (`_nvidia_sm90_or_later`: a CUDA build on sm90+) stood in for.
    monkeypatch.setattr(_triton_utils, "_nvidia_sm90_or_later", lambda index: True)
    assert _triton_utils.register_cap(torch.device("cuda", 0), 168) == {"maxnreg": 168}
    monkeypatch.setattr(_triton_utils, "_nvidia_sm90_or_later", lambda index: False)  # ROCm
    assert _triton_utils.register_cap(torch.device("cuda", 0), 168) == {}


@pytest.mark.parametrize(
    "m,n,single_pass,capped",
    [
        (1, 4, True, False),
        (8, 4, True, False),
        (32, 4, True, True),
        (33, 4, True, False),
        (32, 4, False, False),
        (32, 3, True, False),
    ],
)
def test_phase_a_asks_for_the_cap_only_for_its_tile(
    m: int, n: int, single_pass: bool, capped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Single pass of four streams, 17 to 32 rows run 8 a program (capped); 1 and 8 rows 1 and
    2 a program, 33 rows 1 a program, V4's two-pass tiles and other stream counts uncapped;
    phase B never asks."""
    asked: list[int | None] = []

    def spy(device: torch.device, registers: int | None) -> dict:
        asked.append(registers)
        return {}

    monkeypatch.setattr(mhc_module, "register_cap", spy)
    inp = _make_inputs(m, n, 64, torch.bfloat16, seed=m)
    if single_pass:
        inp["collapse_pre"] = _prev_pre(m, n, seed=m + 1)
    mhc_post_combine(**inp, sinkhorn_iters=2, **_KW)
    want = mhc_module._PHASE_A_MAX_REGISTERS if capped else None
    assert asked == [want], asked


@pytest.mark.skipif(DEVICE != "cuda", reason="a register cap exists only when compiled for a GPU")
@pytest.mark.parametrize("m", [1, 4, 8, 32])
@pytest.mark.parametrize("single_pass", [True, False])
def test_capped_phase_a_keeps_every_bit(
    m: int, single_pass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = 5120 if single_pass else 4096
    inp = _make_inputs(m, 4, d, torch.bfloat16, seed=7 * m + d)
    if single_pass:
        inp["collapse_pre"] = _prev_pre(m, 4, seed=m + 3)

    def run() -> mhc_module.MhcPostCombineOutput:
        out = _poisoned_out(m, 4, d, torch.bfloat16)
        return mhc_post_combine(**inp, out=out, sinkhorn_iters=20, **_KW)

    capped = run()
    monkeypatch.setattr(mhc_module, "_PHASE_A_MAX_REGISTERS", None)
    uncapped = run()
    for name in _OUTPUTS:
        a, b = getattr(capped, name), getattr(uncapped, name)
        assert not torch.isnan(a).any(), name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
