"""Which devices execute the FP8 paths natively (no Triton import; read by the server arguments
and the model runner).

FP8 x FP8 `tl.dot` lowers to a native FP8 MMA on NVIDIA compute capability 8.9 and later
(sm89 `mma`, sm90 `wgmma ... e4m3`, sm100 `tcgen05 kind::f8f6f4`) and on AMD gfx950
(`v_mfma_f32_*_f8f6f4`). gfx942's FP8 MFMA takes the FNUZ encodings (another exponent bias and
NaN code), not the checkpoints' E4M3FN: Triton converts E4M3FN operands to fp16 there, so it is
not listed. `tl.dot_scaled` (MXFP8 x MXFP4) is native on gfx950 (`v_mfma_scale_f32_*_f8f6f4`, any
tile of 16 rows or more) and on Blackwell (compute capability 10 and later: `tcgen05.mma
kind::mxf8f6f4.block_scale`, which Triton emits for tiles of 128 rows; smaller tiles fall back to
an upcast bf16 MMA); sm90 and older always emulate it by upcasting to bf16 inside the dot,
which gains nothing over the W4A16 kernels.
"""

from __future__ import annotations

import torch

_FP8_MMA_ARCHS = ("gfx950",)
_MX_DOT_ARCHS = ("gfx950",)


def _hip_arch(device: torch.device) -> str:
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def native_fp8_mma(device: torch.device) -> bool:
    """Whether `device` multiplies E4M3FN x E4M3FN tiles in its matrix units."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        return _hip_arch(device) in _FP8_MMA_ARCHS
    return torch.cuda.get_device_capability(device) >= (8, 9)


def mx_dot_rows(device: torch.device) -> int:
    """The row tile at which `device` executes `tl.dot_scaled` (E4M3 x E2M1 with E8M0 group
    scales) in its matrix units: 32 on gfx950, 128 on Blackwell; 0 where it never does."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    if torch.version.hip is not None:
        return 32 if _hip_arch(device) in _MX_DOT_ARCHS else 0
    return 128 if torch.cuda.get_device_capability(device)[0] >= 10 else 0
