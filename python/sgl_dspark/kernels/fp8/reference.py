"""GEMMs on FP8 activations in torch: the reference of the "fp8" kernel family.

Activation quantisation (`quantize_act_fp8_ref`), per token and per group of `group`
consecutive channels (the last group of a row may be partial):

    s = max(amax, 1e-10) / 448        (correctly rounded; `ue8m0`: rounded up to a power of two)
    q = e4m3(clamp(x / s, -448, 448))  (x / s correctly rounded, E4M3FN round to nearest even)

`x` is read as stored (the bf16 value a producer writes). Dequantised, an element is `q * s`;
its error is at most `act_quant_error_bound_ref`: half an E4M3 step, i.e. 2^-4 of the value in
E4M3's normal range and 2^-10 * s below it. MXFP8 (`quantize_act_mxfp8_ref`) is the same
quantiser with group 32 and power-of-two scales, stored as E8M0 exponent bytes.

W8A8 block-scaled GEMM (`w8a8_linear_ref`): activations `act` quantised in groups of `group`,
an FP8 weight (`QuantizedWeight`, E8M0 scales per (block_rows x weight.group) block). The input
channels are taken in chunks of `min(group, weight.group)` channels, inside which both scales
are constant:

    P_c    = sum over the chunk of q_a[m, k] * q_w[n, k]         (products exact)
    out    = sum over chunks c in order of (P_c * s_a[m, c]) * s_w[n, c]   (fp32)

rounded once to the output dtype. Here P_c is the exact sum rounded once to fp32; a kernel sums
it in its matrix unit's order (on NVIDIA Hopper FP8 MMA accumulates with fewer than fp32's
bits inside an instruction, which is why every chunk is promoted to the fp32 accumulator).
Compared with dequantise-then-bf16 (`x @ dequant(W)^T` on the bf16 activation) the only change is
the activation's rounding to E4M3: |difference| <= sum_k |w[n, k]| * bound[m, k] plus the fp32
sums and the output rounding (`w8a8_bf16_gap_bound_ref`).

Split-K (`w8a8_split_k_linear_ref`): the chunks are cut into splits of `k_split` channels; each
split sums its chunks as above from zero, and the fp32 partials are summed in split order.

MX MoE (`mx_fused_moe_ref`): the routed experts with MXFP8 activations and MXFP4 weights: x is
MXFP8-quantised, stage 1's product is rounded to x's dtype, the clamped SwiGLU applied (and the
V4.1 route weight), the activation MXFP8-quantised, stage 2's product rounded to x's dtype. Every
value a matrix unit multiplies is an MXFP8 or MXFP4 value times its power-of-two scale, exact in
bf16, so the same math runs through the W4A16 kernels on the dequantised activations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref

if TYPE_CHECKING:
    from sgl_dspark.kernels.quant.reference import Fp8Rows

FP8_MAX = 448.0
AMAX_FLOOR = 1e-10
MX_GROUP = 32
E8M0_BIAS = 127


class Fp8Activation(NamedTuple):
    """q: float8_e4m3fn [..., K]; scale: fp32 [..., ceil(K / group)] (one per row and group;
    [..., 1] for one scale per row)."""

    q: torch.Tensor
    scale: torch.Tensor


class Fp8ActFormat(NamedTuple):
    """How activations are quantised for the FP8 GEMMs: `group` channels per scale (a power of
    two) and whether scales are rounded up to a power of two (`ue8m0`)."""

    group: int = 128
    ue8m0: bool = False


def round_scale_ue8m0_ref(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= scale (positive normal fp32), computed on the bits."""
    bits = scale.view(torch.int32)
    exponent = bits & 0x7F800000
    rounded = torch.where((bits & 0x7FFFFF) != 0, exponent + 0x800000, exponent)
    return rounded.view(torch.float32)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 `[..., K]` -> `[..., ceil(K / group), group]`, the last group zero-padded."""
    k = x.shape[-1]
    n_groups = -(-k // group)
    padded = F.pad(x.float(), (0, n_groups * group - k))
    return padded.reshape(*x.shape[:-1], n_groups, group)


def quantize_act_fp8_ref(x: torch.Tensor, group: int = 128, ue8m0: bool = False) -> Fp8Activation:
    """Per-token-group FP8 quantisation of `x [..., K]` (module doc)."""
    k = x.shape[-1]
    groups = _groups(x, group)
    amax = torch.clamp(groups.abs().amax(dim=-1), min=AMAX_FLOOR)
    # The correctly rounded quotient: a tensor divisor (CUDA torch divides by a Python scalar
    # through its rounded reciprocal).
    scale = amax / torch.full_like(amax, FP8_MAX)
    if ue8m0:
        scale = round_scale_ue8m0_ref(scale)
    q = torch.clamp(groups / scale[..., None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Activation(q.reshape(*x.shape[:-1], q.shape[-2] * group)[..., :k], scale)


def dequantize_act_fp8_ref(act: Fp8Activation, group: int) -> torch.Tensor:
    """fp32 `[..., K]`: every code times its group's scale."""
    k = act.q.shape[-1]
    scale = act.scale.repeat_interleave(group, dim=-1)[..., :k]
    return act.q.float() * scale


def act_quant_error_bound_ref(x: torch.Tensor, act: Fp8Activation, group: int) -> torch.Tensor:
    """fp32 `[..., K]`: the largest |x - dequantised x| the quantiser may leave (module doc):
    max(2^-4 |x|, 2^-10 s), widened by 2^-20 for the rounding of x / s."""
    k = x.shape[-1]
    scale = act.scale.repeat_interleave(group, dim=-1)[..., :k]
    bound = torch.maximum(x.float().abs() * 2.0**-4, scale * 2.0**-10)
    return bound * (1.0 + 2.0**-20)


def quantize_act_mxfp8_ref(x: torch.Tensor) -> Fp8Rows:
    """MXFP8 of `x [..., K]` (K a multiple of 32): E4M3 codes and one E8M0 exponent byte per 32
    channels, the quantiser above with power-of-two scales."""
    from sgl_dspark.kernels.quant.reference import Fp8Rows

    act = quantize_act_fp8_ref(x, MX_GROUP, ue8m0=True)
    exponents = (act.scale.view(torch.int32) >> 23).to(torch.uint8)
    return Fp8Rows(act.q, exponents)


def dequantize_act_mxfp8_ref(rows: Fp8Rows) -> torch.Tensor:
    """fp32 `[..., K]` of MXFP8 rows."""
    scale = torch.exp2(rows.exponents.float() - E8M0_BIAS)
    return dequantize_act_fp8_ref(Fp8Activation(rows.codes, scale), MX_GROUP)


def _chunk_terms(
    act: Fp8Activation, weight: QuantizedWeight, group: int
) -> tuple[list[torch.Tensor], int]:
    """Per chunk c (module doc) the fp32 term (P_c * s_a) * s_w `[M, N]`; and the chunk width."""
    qa = act.q.float()
    w = weight.per_row()
    qw = w.data.float()
    k = qa.shape[-1]
    sub = min(group, weight.group)
    w_scale = torch.exp2(w.scale.float() - E8M0_BIAS)  # [N, ceil(K / weight.group)]
    terms = []
    for k0 in range(0, k, sub):
        part = (qa[:, k0 : k0 + sub].double() @ qw[:, k0 : k0 + sub].double().t()).float()
        sa = act.scale[:, k0 // group]
        sw = w_scale[:, k0 // weight.group]
        terms.append((part * sa[:, None]) * sw[None, :])
    return terms, sub


def _check_fp8_weight(weight: QuantizedWeight) -> None:
    if weight.fmt != "fp8" or weight.data.dim() != 2:
        raise ValueError(f"weight: a 2-D FP8 QuantizedWeight, got {weight.fmt} {weight.shape}")


def w8a8_linear_ref(
    act: Fp8Activation, weight: QuantizedWeight, group: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """W8A8 block-scaled `[M, N]` (module doc): act.q `[M, K]`, weight FP8 `[N, K]`."""
    _check_fp8_weight(weight)
    m, n = act.q.shape[0], weight.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=act.q.device)
    for term in _chunk_terms(act, weight, group)[0]:
        acc = acc + term
    return acc.to(out_dtype)


def w8a8_grouped_linear_ref(
    act: Fp8Activation, weight: QuantizedWeight, group: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """G W8A8 products `[M, G, N]`: act.q `[M, G, K]` (scale `[M, G, C]`), weight `[G * N, K]`
    (group g's rows [g * N, (g + 1) * N); its scale blocks may span groups)."""
    _check_fp8_weight(weight)
    m, groups = act.q.shape[:2]
    n = weight.shape[0] // groups
    rows = weight.per_row()
    outs = []
    for g in range(groups):
        part = rows._replace(
            data=rows.data[g * n : (g + 1) * n], scale=rows.scale[g * n : (g + 1) * n]
        )
        outs.append(
            w8a8_linear_ref(Fp8Activation(act.q[:, g], act.scale[:, g]), part, group, out_dtype)
        )
    return torch.stack(outs, dim=1)


def w8a8_split_k_linear_ref(
    x: torch.Tensor, weight: QuantizedWeight, fmt: Fp8ActFormat, k_split: int
) -> torch.Tensor:
    """Split-K W8A8 of `x [M, K]` quantised by `fmt` (module doc), in x's dtype: splits of
    `k_split` channels (a multiple of the chunk width), each summed from zero, the partials
    summed in split order."""
    _check_fp8_weight(weight)
    act = quantize_act_fp8_ref(x, fmt.group, fmt.ue8m0)
    terms, sub = _chunk_terms(act, weight, fmt.group)
    if k_split % sub:
        raise ValueError(f"k_split {k_split} must be a multiple of the chunk width {sub}")
    per_split = k_split // sub
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for s in range(0, len(terms), per_split):
        partial = torch.zeros_like(out)
        for term in terms[s : s + per_split]:
            partial = partial + term
        out = out + partial
    return out.to(x.dtype)


def w8a8_bf16_gap_bound_ref(
    x: torch.Tensor, act: Fp8Activation, weight: QuantizedWeight, group: int
) -> torch.Tensor:
    """fp32 `[M, N]`: how far a W8A8 output may lie from dequantise-then-bf16's before either is
    rounded to the output dtype: sum_k |w[n, k]| * bound[m, k] (`act_quant_error_bound_ref`),
    plus summation slack of 2^-12 * sum_k |x[m, k] w[n, k]| (an FP8 MMA sums each chunk with
    fewer than fp32's bits: about 14 on Hopper)."""
    w = dequantize_weight_ref(weight, torch.float32).double()
    bound = act_quant_error_bound_ref(x, act, group).double()
    slack = (x.double().abs() @ w.abs().t()) * 2.0**-12
    return (bound @ w.abs().t() + slack).float()


def mx_fused_moe_ref(
    x: torch.Tensor,
    gate_up_proj: QuantizedWeight,
    down_proj: QuantizedWeight,
    topk_ids: torch.Tensor,
    expert_mask: torch.Tensor,
    limit: float | None,
    topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts with MXFP8 activations and MXFP4 weights (module doc), in terms of
    routes: `fused_moe_ref`'s layout and NaN rows, x and each route's activation MXFP8 values."""
    from sgl_dspark.kernels.moe.reference import silu_mul_clamp_ref

    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if w.fmt != "mxfp4" or w.group != MX_GROUP:
            raise ValueError(f"{name}: MXFP4 with scale groups of 32, got {w.fmt} / {w.group}")
    num_tokens, topk = topk_ids.shape
    num_experts = expert_mask.numel()
    is_local = expert_mask.long().cpu()
    local_ids = torch.cumsum(is_local, 0) - is_local
    x_mx = dequantize_act_mxfp8_ref(quantize_act_mxfp8_ref(x))
    gate_up = dequantize_weight_ref(gate_up_proj, torch.float32)
    down = dequantize_weight_ref(down_proj, torch.float32)
    y = torch.full((num_tokens, topk, down.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    for token in range(num_tokens):
        for slot in range(topk):
            expert = int(topk_ids[token, slot])
            if not (0 <= expert < num_experts) or is_local[expert] == 0:
                continue
            local = int(local_ids[expert])
            product = (x_mx[token] @ gate_up[local].t()).to(x.dtype)
            h = silu_mul_clamp_ref(product[None], limit)
            assert isinstance(h, torch.Tensor)
            if topk_weights is not None:
                h = (h.float() * topk_weights[token, slot].float()).to(x.dtype)
            h_mx = dequantize_act_mxfp8_ref(quantize_act_mxfp8_ref(h))
            y[token, slot] = (h_mx[0] @ down[local].t()).to(x.dtype)
    return y
