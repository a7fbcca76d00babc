"""DeepSeek-V4 router gate with pad fill: `router_topk` from the router logits for SGLang's
``biased_topk_jit_kernel_impl`` (sqrtsoftplus scores, correction bias for the choice,
renormalised weights, optional routed scaling, padded rows filled).

The same rule as SGLang's fused gate: scores sqrtsoftplus(l) (= l above 20), choice on score +
bias, weights = unbiased scores renormalised, times the routed scaling factor when SGLang applies
it on the output; rows at or past ``num_token_non_padded`` get id -1 and weight 0 exactly where
SGLang's gate masks them (CUDA, sqrtsoftplus). Differences, all at the ulp level: the
sqrtsoftplus lowering (exp2/log2 against SGLang's), and the renormalisation's divisor (sum +
1e-20 against SGLang's sum, equal unless the chosen scores sum below 2**-43). The slot order of a
row is descending by choice value; readers of the top-k treat slots as a set.

Only SGLang's plain call shape is taken: no fused shared experts, no packed ids, no split-K
partials, the DeepSeek-V4 NaN rule (not V4.1's log1p form), fp32 logits.
"""

from __future__ import annotations

import typing
import weakref
from collections.abc import Callable

import torch

from sgl_dspark_plugin.contract import Target
from sgl_dspark_plugin.hooks._common import decline, kernels_run_on

NAME = "router_gate"
OURS = ("sgl_dspark.kernels:router_topk",)
TARGET = Target(
    "sglang.srt.layers.moe.topk.biased_topk_jit_kernel_impl",
    (
        "hidden_states",
        "gating_output",
        "correction_bias",
        "topk",
        "renormalize",
        "scoring_func",
        "num_fused_shared_experts",
        "routed_scaling_factor",
        "num_token_non_padded",
        "expert_location_dispatch_info",
        "apply_routed_scaling_factor_on_output",
        "packed_out",
        "sqrtsoftplus_log1p",
        "router_logits_partials",
        "num_shared_append",
    ),
)
# SGLang's CUDA convention for padded rows' expert ids.
FILL_ID = -1

# fp32 copies of bf16 correction biases (V4 stores them in bf16): made once per bias tensor
# (outside graph capture: the first, eager forward makes it), refreshed when the bias changes.
_fp32_bias: weakref.WeakKeyDictionary[torch.Tensor, tuple[int, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _bias_fp32(bias: torch.Tensor) -> torch.Tensor:
    if bias.dtype == torch.float32 and bias.is_contiguous():
        return bias
    cached = _fp32_bias.get(bias)
    if cached is None or cached[0] != bias._version:
        cached = (bias._version, bias.float().contiguous())
        _fp32_bias[bias] = cached
    return cached[1]


def _router_config_type() -> type:
    """`router_topk`'s config class, found through the launcher's own annotation (the package
    exports the launcher; the config class lives beside it)."""
    from sgl_dspark.kernels import router_topk

    return typing.get_type_hints(router_topk)["config"]


def _pads_masked_by_sglang(scoring_func: str) -> bool:
    from sglang.srt.layers.moe import topk as sglang_topk

    return bool(sglang_topk._fused_gate_masks_padded_rows(scoring_func))


def around(original: Callable[..., tuple[torch.Tensor, torch.Tensor]], *args, **kwargs):
    from sgl_dspark.kernels import router_topk

    bound = dict(zip(TARGET.parameters, args))
    bound.update(kwargs)
    logits = bound["gating_output"]
    bias = bound["correction_bias"]
    n_valid = bound.get("num_token_non_padded")
    scale = bound.get("routed_scaling_factor")
    apply_scale = bool(bound.get("apply_routed_scaling_factor_on_output", False))
    scoring = bound.get("scoring_func", "sigmoid")

    def sglang():
        return original(*args, **kwargs)

    from sglang.srt.layers.moe import topk as sglang_topk

    if scoring != "sqrtsoftplus" or getattr(sglang_topk, "_use_aiter", False):
        decline(NAME, "not the CUDA sqrtsoftplus gate")
        return sglang()
    if (
        bound.get("num_fused_shared_experts", 0)
        or bound.get("packed_out") is not None
        or bound.get("sqrtsoftplus_log1p", False)
        or bound.get("router_logits_partials") is not None
        or bound.get("num_shared_append", 0)
    ):
        decline(NAME, "fused shared experts, packed ids, V4.1 NaN rule or split-K partials")
        return sglang()
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        decline(NAME, "router logits are not contiguous fp32 [tokens, experts]")
        return sglang()
    if bias is None or bias.shape != (logits.shape[1],):
        decline(NAME, "no correction bias of one value per expert")
        return sglang()
    if apply_scale and scale is None:
        decline(NAME, "scaling asked for without a routed scaling factor")
        return sglang()
    if n_valid is not None and (n_valid.numel() != 1 or n_valid.dtype != torch.int32):
        decline(NAME, "num_token_non_padded is not an int32 scalar")
        return sglang()
    if not kernels_run_on(logits, bias):
        decline(NAME, f"logits on {logits.device.type}")
        return sglang()
    config = _router_config_type()(
        topk=int(bound["topk"]),
        scoring="sqrtsoftplus",
        renormalize=bool(bound["renormalize"]),
        routed_scaling_factor=float(scale) if apply_scale else 1.0,
        fill_id=FILL_ID,
    )
    masked = n_valid is not None and _pads_masked_by_sglang(scoring)
    out = router_topk(
        config,
        logits=logits,
        correction_bias=_bias_fp32(bias),
        n_valid=n_valid.reshape(()) if masked else None,
    )
    return out.weights, out.ids
