"""mHC (manifold-constrained hyper-connection) sublayer boundaries in torch: the reference of
`post_combine.py`.

A DeepSeek-V4 block carries n residual streams Rs [M, n, D]. Closing a sublayer applies its
stream update ``Rs'[k] = post[k]·y + Σ_j C[j,k]·Rs[j]``; opening the next computes its
hyper-connection's coefficients from ``Rs'`` (weightless RMSNorm over n·D, ``fn`` projection,
sigmoid pre/post, softmax + Sinkhorn comb), collapses ``x_in = Σ_j pre'[j]·Rs'[j]`` and applies
the next sublayer's weighted RMSNorm. Activations are rounded where the unfused chain stores
them; everything else is fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_dspark.kernels.fp8.reference import Fp8Activation
from sgl_dspark.kernels.norm.reference import rms_norm_ref


class MhcPostCombineOutput(NamedTuple):
    """Outputs of :func:`mhc_post_combine` (``M`` rows, ``n`` streams, width ``D``)."""

    streams: torch.Tensor  # [M, n, D] activation dtype: updated streams Rs'
    pre: torch.Tensor  # [M, n] fp32: next sublayer's collapse weights
    post: torch.Tensor  # [M, n] fp32: next sublayer's expand weights
    comb: torch.Tensor  # [M, n, n] fp32: next sublayer's Sinkhorn-normalised mixing matrix
    x_in: torch.Tensor  # [M, D] activation dtype: Σ_j pre[j]·Rs'[j]
    x_normed: torch.Tensor  # [M, D] activation dtype: RMSNorm_w(x_in)
    # `quantize_act_fp8_ref(x_normed, ...)` when the FP8 form was asked for (`fp8_out`), else None
    x_fp8: Fp8Activation | None = None


class MhcPostCollapseOutput(NamedTuple):
    """Outputs of :func:`mhc_post_collapse` (no coefficients)."""

    streams: torch.Tensor  # [M, n, D] activation dtype: updated streams Rs'
    x_in: torch.Tensor  # [M, D] activation dtype: Σ_j collapse_pre[j]·Rs'[j]
    x_normed: torch.Tensor  # [M, D] activation dtype: RMSNorm_w(x_in)


def mhc_coeffs_ref(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hyper-connection coefficients of the next sublayer from its input streams.

    Args: streams [M, n, D]; fn [(2+n)·n, n·D]; base [(2+n)·n]; scale [3] (pre, post, comb).
    Returns fp32 (pre [M, n], post [M, n], comb [M, n, n]) with comb[j, k] weighting source
    stream j into destination stream k.
    """
    m, n, d = streams.shape
    u = streams.reshape(m, n * d).float()
    u = u * torch.rsqrt(u.square().mean(-1, keepdim=True) + rms_eps)
    mix = torch.nn.functional.linear(u, fn.float())
    pre_logit, post_logit, comb_logit = mix.split([n, n, n * n], dim=-1)
    pre_base, post_base, comb_base = base.float().split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.float().unbind(0)
    pre = torch.sigmoid(pre_logit * pre_scale + pre_base) + hc_eps
    post = 2 * torch.sigmoid(post_logit * post_scale + post_base)
    comb_logit = comb_logit.view(m, n, n) * comb_scale + comb_base.view(n, n)
    comb = torch.softmax(comb_logit, dim=-1) + hc_eps
    # Sinkhorn: the softmax was the first row step; columns are normalised last.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_post_ref(
    streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Stream update Rs'[k] = post[k]·y + Σ_j comb[j,k]·Rs[j] in fp32, cast to Rs.dtype.

    Args: streams [M, n, D]; y [M, D]; post [M, n]; comb [M, n, n]. Returns [M, n, D].
    The sum runs over j in increasing order after the post term (the kernel's operand order).
    """
    acc = post.float().unsqueeze(-1) * y.float().unsqueeze(1)
    for j in range(streams.shape[1]):
        acc = acc + comb[:, j, :].float().unsqueeze(-1) * streams[:, j].float().unsqueeze(1)
    return acc.to(streams.dtype)


def mhc_collapse_ref(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x_in = Σ_j pre[j]·Rs[j] in fp32 (j increasing), cast to Rs's dtype. [M, n, D] -> [M, D]."""
    acc = pre[:, 0].float().unsqueeze(-1) * streams[:, 0].float()
    for j in range(1, streams.shape[1]):
        acc = acc + pre[:, j].float().unsqueeze(-1) * streams[:, j].float()
    return acc.to(streams.dtype)


def mhc_post_combine_ref(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    collapse_pre: torch.Tensor | None = None,
) -> MhcPostCombineOutput:
    """The chain `mhc_post_combine` fuses: mhc_post_ref, then mhc_coeffs_ref of the next
    sublayer on the updated (stored, i.e. dtype-rounded) streams, its collapse, and its
    RMSNorm. Single-pass mHC (DeepSeek-V4.1): the collapse uses `collapse_pre` [M, n] fp32,
    the closed site's pre, instead of the new pre."""
    new_streams = mhc_post_ref(streams, y, post, comb)
    pre2, post2, comb2 = mhc_coeffs_ref(
        new_streams, fn, base, scale, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, rms_eps=rms_eps
    )
    x_in = mhc_collapse_ref(new_streams, pre2 if collapse_pre is None else collapse_pre)
    x_normed = rms_norm_ref(x_in, norm_weight, rms_eps)
    return MhcPostCombineOutput(new_streams, pre2, post2, comb2, x_in, x_normed)


def mhc_pre_ref(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    collapse_pre: torch.Tensor | None = None,
) -> MhcPostCombineOutput:
    """Open the first sublayer: coeffs, collapse (with `collapse_pre` when given, single-pass
    mHC) and RMSNorm of the (unchanged) streams."""
    pre, post, comb = mhc_coeffs_ref(
        streams, fn, base, scale, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, rms_eps=rms_eps
    )
    x_in = mhc_collapse_ref(streams, pre if collapse_pre is None else collapse_pre)
    return MhcPostCombineOutput(
        streams, pre, post, comb, x_in, rms_norm_ref(x_in, norm_weight, rms_eps)
    )


def mhc_post_collapse_ref(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    collapse_pre: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    rms_eps: float,
) -> MhcPostCollapseOutput:
    """Close a sublayer and collapse the new streams with a given pre, then the weighted
    RMSNorm; no coefficients (single-pass mHC before an Engram layer and into the final
    norm)."""
    new_streams = mhc_post_ref(streams, y, post, comb)
    x_in = mhc_collapse_ref(new_streams, collapse_pre)
    return MhcPostCollapseOutput(new_streams, x_in, rms_norm_ref(x_in, norm_weight, rms_eps))
