"""FP8 activations for the GEMMs on FP8 weights (`--fp8-activations`, `KernelChoice.
fp8_activations`): where they apply, where their quantisation happens, and the numerics class.

Where: a linear layer whose weight is kept as stored in FP8 (`--weight-format native`) and whose
input has more rows than the decode-size weight-only kernels take (`MAX_M`: prefill chunks, wide
verify batches) runs the W8A8 block-scaled GEMM (`kernels/fp8/w8a8.py`) instead of dequantising
the weight per call; so does the grouped output projection. The DSpark main projection (K =
taps x D, a fixed row count per captured graph) runs the split-K W8A8 GEMM at every size up to
`SPLIT_K_MAX_M` rows: its input (the mean of the target's streams, a torch op, so no epilogue to
fold the quantisation into) is quantised once (`quantize_act_fp8`), then the split GEMM reads
the codes and an ordered reduce sums the splits; quantising in the GEMM's prologue instead
would repeat the activation's quantisation once per column tile. With
`KernelChoice.mx_moe_block` the routed MXFP4 experts run the MX path (`kernels/fp8/mx_moe.py`)
wherever the sorted expert path runs (more than 4 tokens), sorted in blocks of the rows the
target's scaled MMA needs (32 on gfx950, 128 on Blackwell).

Quantisation is per token and per `group` channels (the checkpoint's weight block along K), with
power-of-two scales when the checkpoint declares `scale_fmt: ue8m0`. It is folded into the
producer of the activation where that producer is one of our kernels and all of its consumers
want the same rows:
  * the mHC boundary writes the next sublayer's normed input and its FP8 form in the same
    launch (`srt/layers/mhc.py`); the attention's input projections and the shared expert's
    gate-up projection read the codes;
  * the SiLU-mul-clamp epilogue writes the shared expert's activation as FP8 codes and scales
    only (`srt/layers/moe/experts.py`); the down projection reads them;
  * the MX MoE's stage 1 writes its activation as MXFP8 for stage 2.
A producer's FP8 form travels with the tensor object it describes (`attach_fp8`): a consumer
handed that same object (not a view, a copy or a slice) reads the codes; any other input is
quantised by a separate launch (`quantize_act_fp8`). That covers the inputs whose producers do
not fold it yet, each a few KB per token read once more:
  * q_b's input, the q rank's RMSNorm (`norm/rmsnorm.py`): the norm kernel could write the FP8
    form beside its output as the boundary does; it is another family's kernel and has not
    been given the epilogue;
  * o_a's input, the attention output: the attention kernel writes its rows from two places
    (the single pass and the merge of its key splits), each with the inverse-rope epilogue,
    and the quantiser would have to join both;
  * o_b's input, o_a's output: the grouped GEMM's tiles hold whole groups of the output and
    could quantise them, but the attention reshapes that output ([T, G, N] -> [T, G * N])
    into a new tensor object, which a recorded FP8 form does not follow.

Numerics class (what changes against dequantise-then-bf16, `kernels/fp8/reference.py`): the
weights are the same numbers; the activation is rounded to E4M3 with its group scale (relative
error at most 2^-4 per element in E4M3's normal range), the products are exact, and each chunk
of min(group, weight group) channels is summed in the matrix unit before joining the fp32
accumulator. So outputs move by at most sum_k |w| * 2^-4 |x| (`w8a8_bf16_gap_bound_ref`); for
random-sign data the typical move is the elements' RMS relative rounding error, about 2^-5 of
the output's RMS: logits change, greedy tokens may. Inputs at decode sizes keep the weight-only kernels (activations exact), so a token's
numerics depend on whether its forward had more than `MAX_M` rows: a DSpark verify of more
than `MAX_M` rows and a plain decode step of fewer may round differently, and greedy outputs
with and without DSpark are equal only within one regime (`--fp8-activations off` keeps one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sgl_dspark.kernels.fp8.reference import Fp8ActFormat, Fp8Activation
from sgl_dspark.kernels.linear.reference import QuantizedWeight

if TYPE_CHECKING:
    from sgl_dspark.kernels.quant.reference import Fp8Rows
    from sgl_dspark.srt.configs.model_config import QuantConfig
    from sgl_dspark.srt.core.kernel_choice import KernelChoice

# Rows up to which the DSpark main projection runs split-K (a verify of 32 requests x 4 tokens);
# above, the plain W8A8 GEMM has tiles enough.
SPLIT_K_MAX_M = 128
FP8_ACTIVATION_MODES = ("auto", "on", "off")
_ATTR = "_fp8_activation"
# (x [..., K], weight) -> x @ weight^T [..., N]
LinearFn = Callable[[torch.Tensor, "torch.Tensor | QuantizedWeight"], torch.Tensor]


def attach_fp8(x: torch.Tensor, fmt: Fp8ActFormat, act: Fp8Activation) -> torch.Tensor:
    """Record `act` (x quantised in `fmt`, written by x's producer) on the tensor object `x`;
    returns x. Identity, not the data pointer, finds it again: a tensor that later reuses x's
    memory is another object and can never pick up stale codes."""
    setattr(x, _ATTR, (fmt, act))
    return x


def attached_fp8(x: torch.Tensor, fmt: Fp8ActFormat) -> Fp8Activation | None:
    """The FP8 form `x`'s producer recorded in `fmt`, if any."""
    tagged = getattr(x, _ATTR, None)
    if tagged is None or tagged[0] != fmt:
        return None
    return tagged[1]


def attached_mxfp8(x: torch.Tensor) -> Fp8Rows | None:
    """x's MXFP8 form (codes and E8M0 bytes) when its producer wrote groups of 32 with
    power-of-two scales, else None."""
    from sgl_dspark.kernels.fp8.reference import MX_GROUP
    from sgl_dspark.kernels.quant.reference import Fp8Rows

    act = attached_fp8(x, Fp8ActFormat(MX_GROUP, True))
    if act is None:
        return None
    return Fp8Rows(act.q, (act.scale.view(torch.int32) >> 23).to(torch.uint8))


def activation_format(quant: QuantConfig | None) -> Fp8ActFormat | None:
    """The activation quantisation matching a checkpoint's FP8 weights: one scale per weight
    block along K, power-of-two scales where the checkpoint declares `scale_fmt: ue8m0`; None
    without FP8 weights."""
    if quant is None:
        return None
    return Fp8ActFormat(quant.weight_block_size[1], quant.scale_fmt == "ue8m0")


def resolve_fp8_paths(
    kernels: KernelChoice, mode: str, quant: QuantConfig | None, device: torch.device
) -> KernelChoice:
    """`kernels` with the FP8 paths of `--fp8-activations` (already resolved to on/off by the
    server arguments): the activation format when on and the checkpoint has FP8 weights, and the
    MX routed experts where the device executes `tl.dot_scaled` natively."""
    import dataclasses

    if mode not in ("on", "off"):
        raise ValueError(f"fp8_activations must be 'on' or 'off' once resolved, got {mode!r}")
    fmt = activation_format(quant) if mode == "on" else None
    if fmt is None:
        return kernels
    if kernels.of("linear") != "triton":
        raise ValueError("--fp8-activations on needs the triton 'linear' kernels")
    from sgl_dspark.kernels.fp8.targets import mx_dot_rows

    mx_rows = mx_dot_rows(device) if kernels.of("moe") == "triton" else 0
    return dataclasses.replace(kernels, fp8_activations=fmt, mx_moe_block=mx_rows)


class Fp8Linear:
    """The W8A8 linear layers of one activation format (module doc)."""

    def __init__(self, fmt: Fp8ActFormat) -> None:
        from sgl_dspark.kernels.fp8 import w8a8
        from sgl_dspark.kernels.fp8.act_quant import quantize_act_fp8
        from sgl_dspark.kernels.linear.quantized import MAX_M

        self.fmt = fmt
        self.max_m = MAX_M
        self._w8a8 = w8a8
        self._quantize = quantize_act_fp8

    def wants(self, rows: int) -> bool:
        """Whether inputs of `rows` rows take the FP8 GEMMs (their producers then write the FP8
        form)."""
        return rows > self.max_m

    def takes(self, x: torch.Tensor, weight: QuantizedWeight) -> bool:
        return (
            weight.data.dim() == 2
            and self._w8a8.supports(self.fmt.group, weight)
            and self.wants(x.numel() // max(x.shape[-1], 1))
        )

    def quantize(self, x: torch.Tensor) -> Fp8Activation:
        """x's FP8 form: its producer's when recorded, else one quantiser launch."""
        act = attached_fp8(x, self.fmt)
        if act is not None:
            return act
        return self._quantize(x.contiguous(), self.fmt.group, self.fmt.ue8m0)

    def __call__(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """`x [..., K] @ dequant(weight)^T` with x quantised, in x's dtype."""
        act = self.quantize(x)
        k = x.shape[-1]
        flat = Fp8Activation(act.q.reshape(-1, k), act.scale.reshape(-1, act.scale.shape[-1]))
        out = self.apply(flat, weight, x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    def apply(
        self, act: Fp8Activation, weight: QuantizedWeight, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The GEMM on an activation already quantised in this format ([M, K])."""
        return self._w8a8.w8a8_linear(act, weight, self.fmt.group, out_dtype)

    def grouped(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """The grouped output projection: x [M, G, K], weight [G * N, K] -> [M, G, N]."""
        act = self.quantize(x)
        return self._w8a8.w8a8_grouped_linear(act, weight, self.fmt.group, x.dtype)

    def split_k(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """The split-K GEMM of x [M, K]: x quantised once, the split GEMM, the ordered reduce
        (module doc)."""
        return self._w8a8.w8a8_split_k_linear(x.contiguous(), weight, self.fmt)


def fp8_linear_impl(kernels: KernelChoice | None) -> Fp8Linear | None:
    """The W8A8 linear of `kernels`' activation format, or None when FP8 activations are off."""
    if kernels is None or kernels.fp8_activations is None:
        return None
    return Fp8Linear(kernels.fp8_activations)


def split_k_linear_impl(kernels: KernelChoice | None, fallback: LinearFn) -> LinearFn:
    """The linear of a fixed-shape, weight-bound projection with a long K (the DSpark main
    projection): with FP8 activations on and an FP8 weight the split-K W8A8 GEMM up to
    `SPLIT_K_MAX_M` rows and the W8A8 GEMM above (at every row count: the draft's numerics
    never touch the target's); else `fallback` (the family's linear)."""
    fp8 = fp8_linear_impl(kernels)
    if fp8 is None:
        return fallback
    from sgl_dspark.kernels.fp8.w8a8 import split_k_supports

    def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if (
            not isinstance(weight, QuantizedWeight)
            or weight.fmt != "fp8"
            or weight.data.dim() != 2
            or x.dim() != 2
            or x.shape[0] == 0
            or not split_k_supports(fp8.fmt.group, weight)
        ):
            return fallback(x, weight)
        if x.shape[0] <= SPLIT_K_MAX_M:
            return fp8.split_k(x, weight)
        return fp8(x, weight)

    return linear


def mx_fused_moe_impl(kernels: KernelChoice | None, fused_moe: Callable) -> Callable:
    """`fused_moe`, or with `kernels.mx_moe_block` a function of its signature that runs MXFP4
    expert stacks through the MX kernels (`mx_fused_moe`, reading x's MXFP8 form when its
    producer wrote one) and any other weights through `fused_moe`. The caller sorts the routes
    in blocks of `kernels.mx_moe_block` rows then."""
    if kernels is None or not kernels.mx_moe_block:
        return fused_moe
    from sgl_dspark.kernels.fp8.mx_moe import mx_fused_moe, mx_supported

    def run(
        x: torch.Tensor,
        gate_up: object,
        down: object,
        sort: object,
        topk: int,
        limit: float | None,
        block_size: int = 32,
        out: torch.Tensor | None = None,
        weight_before_down: bool = False,
    ) -> torch.Tensor:
        if (
            mx_supported(gate_up, down)
            and x.shape[-1] % 32 == 0
            and gate_up.shape[1] % 64 == 0  # type: ignore[attr-defined]
            and gate_up.shape[1] // 2 % 32 == 0  # type: ignore[attr-defined]
        ):
            return mx_fused_moe(
                x,
                gate_up,  # type: ignore[arg-type]
                down,  # type: ignore[arg-type]
                sort,  # type: ignore[arg-type]
                topk,
                limit,
                block_size,
                out,
                weight_before_down,
                x_mx=attached_mxfp8(x),
            )
        return fused_moe(x, gate_up, down, sort, topk, limit, block_size, out, weight_before_down)

    return run


__all__ = [
    "FP8_ACTIVATION_MODES",
    "SPLIT_K_MAX_M",
    "Fp8Linear",
    "activation_format",
    "attach_fp8",
    "attached_fp8",
    "attached_mxfp8",
    "fp8_linear_impl",
    "mx_fused_moe_impl",
    "resolve_fp8_paths",
    "split_k_linear_impl",
]
