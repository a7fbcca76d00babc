"""The kernel and policy hooks, one module each: its SGLang target, and an AROUND hook that runs
sglang-dspark's implementation where its contract holds and SGLang's otherwise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from sgl_dspark_plugin.contract import Target
from sgl_dspark_plugin.hooks import activation, argmax, mhc, moe_reduce, router, verify_budget


@dataclass(frozen=True)
class HookSpec:
    name: str  # also the value in DSPARK_PLUGIN_HOOKS
    flag: str  # the SGLang CLI flag that turns it on
    help: str
    target: Target
    around: Callable[..., Any]
    ours: tuple[str, ...]  # sglang-dspark names the hook calls ("module:attribute")


def _spec(module: ModuleType, help: str) -> HookSpec:
    flag = "--enable-dspark-" + module.NAME.replace("_", "-")
    return HookSpec(module.NAME, flag, help, module.TARGET, module.around, module.OURS)


HOOKS: tuple[HookSpec, ...] = (
    _spec(
        mhc,
        "DeepSeek-V4 mHC boundary (post, next pre, Sinkhorn, collapse, RMSNorm) in sglang-dspark's "
        "fused kernel.",
    ),
    _spec(
        router,
        "DeepSeek-V4 router gate (sqrtsoftplus, bias, top-k, renormalise, pad fill) in "
        "sglang-dspark's kernel.",
    ),
    _spec(activation, "Clamped SwiGLU of the MoE experts in sglang-dspark's kernel."),
    _spec(
        moe_reduce,
        "Route-reduce epilogue of the Triton MoE runner (slot sum, routed scale) in "
        "sglang-dspark's kernel.",
    ),
    _spec(argmax, "Greedy argmax of the DSpark verify in sglang-dspark's split-vocab kernel."),
    _spec(
        verify_budget,
        "DSpark confidence verify budget (top-K over lagged survival and the SPS table) from "
        "sglang-dspark's planner.",
    ),
)

BY_NAME: dict[str, HookSpec] = {spec.name: spec for spec in HOOKS}
