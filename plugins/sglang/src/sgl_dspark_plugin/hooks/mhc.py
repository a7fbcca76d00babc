"""DeepSeek-V4 mHC boundary: `mhc_post_combine` for SGLang's post + pre between two sublayers
(``HcReadCall.update_and_read`` of the V4 scheme, where each sublayer's collapse uses its own
fresh ``pre``).

SGLang's unfused chain there: ``hc_post`` (R' = post * y + comb^T R), then ``hc_pre`` of the
next hyper-connection on R' (weightless RMS, the ``fn`` projection, sigmoid pre/post, softmax +
Sinkhorn comb), the collapse sum_j pre_j R'_j and the sublayer's RMSNorm. `mhc_post_combine`
is that chain in two launches, returning the same (R', post', comb', normed input). R' sums the
streams in a fixed order where SGLang's torch expression reduces in its own; the coefficients
and the normed input go through split reductions and exp/sigmoid lowerings: equal to fp32
rounding, R' within one bf16 ulp on bf16 rows.

Taken when the layer runs the V4 scheme (not V4.1's lagged ``pre``), the producer is SGLang's
plain ``HcUpdate``, the norm is a plain RMSNorm whose epsilon is the mHC one (the kernel uses
one epsilon for both), and the tensors have the kernel's dtypes and layouts. The normed input
is returned unquantized, as SGLang's own fused boundaries do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sgl_dspark_plugin.contract import Target
from sgl_dspark_plugin.hooks._common import decline, kernels_run_on

NAME = "mhc_post_combine"
OURS = ("sgl_dspark.kernels:mhc_post_combine",)
TARGET = Target(
    "sglang.srt.models.deepseek_v4_boundary.HcReadCall.update_and_read",
    ("self", "update", "value", "residual", "norm", "kwargs"),
)


def _decline_reason(read: Any, update: Any, value: Any, residual: Any, norm: Any) -> str | None:
    from sglang.srt.models.deepseek_v4_boundary import HcUpdate, ReadState

    layer = read.layer
    if layer.boundary_pre_from_prev:
        return "V4.1 scheme (the collapse uses the previous pre)"
    if type(update) is not HcUpdate or type(residual) is not ReadState:
        return "producer is not SGLang's plain HcUpdate"
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return "sublayer output is not a [tokens, hidden] tensor"
    streams, post, comb = residual.streams, residual.post, residual.comb
    if not all(isinstance(t, torch.Tensor) for t in (streams, post, comb)):
        return "no (streams, post, comb) from the previous hc_pre"
    rows, hidden = value.shape
    mult = streams.shape[1] if streams.dim() == 3 else -1
    act = value.dtype
    if act not in (torch.float32, torch.bfloat16) or streams.dtype != act:
        return "activations are not fp32/bf16, or streams and output differ in dtype"
    if streams.shape != (rows, mult, hidden) or post.shape != (rows, mult):
        return "streams / post shapes"
    if comb.shape != (rows, mult, mult) or post.dtype != torch.float32:
        return "comb shape or coefficient dtype"
    weight = getattr(norm, "weight", None)
    if (
        weight is None
        or getattr(norm, "cast_x_before_out_mul", False)
        or getattr(norm, "variance_size_override", None) is not None
        or getattr(norm, "override_orig_dtype", None) is not None
        or weight.shape != (hidden,)
        or weight.dtype not in (torch.float32, torch.bfloat16)
    ):
        return "the next norm is not a plain RMSNorm of the hidden width"
    if getattr(norm, "variance_epsilon", None) != layer.rms_norm_eps:
        return "the norm's epsilon differs from the mHC RMS epsilon"
    fn, scale, base = read._parameters()
    if fn.dtype != torch.float32 or scale.dtype != torch.float32 or base.dtype != torch.float32:
        return "mHC parameters are not fp32"
    if not all(t.is_contiguous() for t in (value, streams, post, comb, fn, base, scale)):
        return "non-contiguous operands"
    if not kernels_run_on(value, streams, fn):
        return f"tensors on {value.device.type}"
    return None


def around(
    original: Callable[..., Any],
    self: Any,
    update: Any,
    value: Any,
    residual: Any,
    norm: Any,
    **kwargs: Any,
) -> Any:
    from sgl_dspark.kernels import mhc_post_combine
    from sglang.srt.models.deepseek_v4_boundary import ReadState

    reason = "extra keyword arguments" if kwargs else None
    reason = reason or _decline_reason(self, update, value, residual, norm)
    if reason is not None:
        decline(NAME, reason)
        return original(self, update, value, residual, norm, **kwargs)
    layer = self.layer
    fn, scale, base = self._parameters()
    out = mhc_post_combine(
        residual.streams,
        value,
        residual.post,
        residual.comb,
        fn,
        base,
        scale,
        norm.weight,
        hc_eps=float(layer.hc_eps),
        sinkhorn_iters=int(layer.hc_sinkhorn_iters),
        rms_eps=float(layer.rms_norm_eps),
    )
    return out.x_normed, ReadState(out.streams, out.post, out.comb, None, call=self.call)
