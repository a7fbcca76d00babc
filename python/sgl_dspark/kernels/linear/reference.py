"""Bias-free linear layers in torch with fp32 accumulation: the reference of the small-M kernels
(`small_m.py`, `quantized.py`), and the one definition of the weights kept as stored.

The "linear" family's torch backend is the BLAS (`F.linear`), which sums in another order; with a
quantised weight it dequantises the weight on every call (`dequantize_weight_ref`) and then runs
the BLAS: slow, but the exact weights.

Quantised weights (`QuantizedWeight`), as the engine keeps them on the device:
* "fp8": `data` float8_e4m3fn `[..., N, K]`;
* "mxfp4": `data` uint8 `[..., N, K / 2]`, element 2j in the low nibble and 2j + 1 in the high
  nibble of byte j, each an E2M1 code (bit 3 the sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6);
* `scale`: uint8 `[..., ceil(N / block_rows), ceil(K / group)]` E8M0 exponent bytes e
  (1..254; MXFP4 at most `MXFP4_MAX_SCALE_BYTE`), one per block of `block_rows` rows and
  `group` input channels:
  `W[.., n, k] = value(data[.., n, k]) * 2^(e[.., n // block_rows, k // group] - 127)`.
  FP8 checkpoints declare (block_rows, group) blocks (128 x 128 for V4, 32 x 32 for V4.1);
  MXFP4 has block_rows 1 and group 32. Weights stacked along N (the projections of one input,
  `layers/fused_linear.py`) keep their blocks when every member's rows fill whole blocks, else
  the stack's scales are repeated per row (block_rows 1).
Every dequantised value is exact in bf16 (an FP8 or E2M1 value times a power of two), so a
weight dequantised once at load and one dequantised in a kernel are the same numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

WEIGHT_FORMATS = ("fp8", "mxfp4")
E8M0_BIAS = 127
# The largest MXFP4 scale byte the Triton kernels decode (2^(128 - 127) = 2; `dequant.py`); the
# loader refuses larger ones for native weights.
MXFP4_MAX_SCALE_BYTE = 128
# E2M1 value of each 4-bit code; bit 3 is the sign.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


class QuantizedWeight(NamedTuple):
    """A weight kept in its stored format (module doc): `data`, `scale`, `fmt` ("fp8" or
    "mxfp4"), `group` (input channels per scale) and `block_rows` (rows per scale)."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    group: int
    block_rows: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantised) shape `[..., N, K]`."""
        *lead, n, stored_k = self.data.shape
        return (*lead, n, 2 * stored_k if self.fmt == "mxfp4" else stored_k)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel()

    def expert(self, index: int) -> QuantizedWeight:
        """The `index`-th matrix of a stacked weight `[E, N, K]`."""
        return self._replace(data=self.data[index], scale=self.scale[index])

    def per_row(self) -> QuantizedWeight:
        """The same weight with one scale row per row (block_rows 1)."""
        if self.block_rows == 1:
            return self
        n = self.data.shape[-2]
        scale = self.scale.repeat_interleave(self.block_rows, dim=-2)[..., :n, :]
        return self._replace(scale=scale.contiguous(), block_rows=1)


def check_quantized_weight(w: QuantizedWeight, name: str = "weight") -> None:
    """ValueError naming `name` unless `w` is a well-formed `QuantizedWeight` (module doc)."""
    if w.fmt not in WEIGHT_FORMATS:
        raise ValueError(f"{name}: format must be one of {WEIGHT_FORMATS}, got {w.fmt!r}")
    want = torch.float8_e4m3fn if w.fmt == "fp8" else torch.uint8
    if w.data.dtype != want:
        raise ValueError(f"{name}: {w.fmt} data must be {want}, got {w.data.dtype}")
    if w.group < 1 or w.group & (w.group - 1):
        raise ValueError(f"{name}: scale group must be a power of two, got {w.group}")
    if w.block_rows < 1:
        raise ValueError(f"{name}: block_rows must be >= 1, got {w.block_rows}")
    *lead, n, _ = w.shape
    expected = (*lead, -(-n // w.block_rows), -(-w.shape[-1] // w.group))
    if w.scale.dtype != torch.uint8 or tuple(w.scale.shape) != expected:
        raise ValueError(
            f"{name}: scale must be uint8 {list(expected)}, got {w.scale.dtype} "
            f"{list(w.scale.shape)}"
        )


def e8m0_to_float_ref(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes (uint8) -> float32 multipliers 2^(e - 127)."""
    return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)


def e2m1_values_ref(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 pairs uint8 `[..., n]` -> float32 values `[..., 2n]` (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).long()
    return table[codes].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_weight_ref(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[..., N, K]` in `dtype` (exact: each value is a stored value times a power of
    two)."""
    values = w.data.to(torch.float32) if w.fmt == "fp8" else e2m1_values_ref(w.data)
    n, k = values.shape[-2:]
    multipliers = e8m0_to_float_ref(w.scale).repeat_interleave(w.group, dim=-1)[..., :k]
    multipliers = multipliers.repeat_interleave(w.block_rows, dim=-2)[..., :n, :]
    return (values * multipliers).to(dtype)


def small_m_linear_ref(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """`x @ weight^T` accumulated in fp32, rounded once to x's dtype.

    x [M, K] (bf16/fp16/fp32), weight [N, K] of x's dtype (or quantised: dequantised first).
    Returns [M, N]."""
    if isinstance(weight, QuantizedWeight):
        weight = dequantize_weight_ref(weight, x.dtype)
    return (x.float() @ weight.float().t()).to(x.dtype)


def small_m_grouped_linear_ref(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight
) -> torch.Tensor:
    """`y[:, g] = x[:, g] @ weight[g]^T` accumulated in fp32, rounded once to x's dtype.
    x [M, G, K], weight [G, N, K] of x's dtype, or quantised [G * N, K] (its scale blocks may
    span groups). Returns [M, G, N]."""
    if isinstance(weight, QuantizedWeight):
        dense = dequantize_weight_ref(weight, x.dtype)
        weight = dense.view(x.shape[1], dense.shape[0] // x.shape[1], dense.shape[1])
    return torch.einsum("mgk,gnk->mgn", x.float(), weight.float()).to(x.dtype)
