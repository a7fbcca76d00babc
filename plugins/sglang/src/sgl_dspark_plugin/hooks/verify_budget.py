"""DSpark verify budget (the confidence policy's async top-K budget): sglang-dspark's
`compute_verify_budget` for SGLang's ``compute_verify_token_budget``.

The contracts match: both take the lagged survival rows of the scheduled requests and an SPS
table (diagonal: steps/s at the largest probe <= tokens; additive: bias + alpha(R) + theta(M),
interpolated and clamped) and return K = argmax_k Theta(k) with Theta(k) = (R + S_k) x SPS(R + k)
(S_k = the k largest survivals >= eps), the first maximum on ties. SGLang's table is converted
to ours field by field. A diagonal table gives the same K and Theta bit for bit; an additive
table's interpolation rounds in another order (Theta equal to about 1e-15 relative).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sgl_dspark_plugin.contract import Target
from sgl_dspark_plugin.hooks._common import decline

NAME = "verify_budget"
OURS = (
    "sgl_dspark.srt.speculative.dspark.planner:compute_verify_budget",
    "sgl_dspark.srt.speculative.dspark.sps:sps_table_from_json_dict",
    "sgl_dspark.srt.speculative.dspark.sps:AdditiveSpsTable",
)
TARGET = Target(
    "sglang.srt.speculative.dspark_components.dspark_planner.compute_verify_token_budget",
    ("history_survival_probs", "sps_table", "cfg"),
)


def our_table(sps_table: Any) -> Any:
    """sglang-dspark's SPS table with the values of SGLang's (raises ValueError if invalid)."""
    from sgl_dspark.srt.speculative.dspark.sps import sps_table_from_json_dict
    from sglang.srt.speculative.dspark_components.dspark_sps import (
        SpsAdditiveCostTable,
        SpsCostTable,
    )

    if isinstance(sps_table, SpsCostTable):
        return sps_table_from_json_dict(
            {
                "sample_batch_tokens": list(sps_table.sample_batch_tokens),
                "sample_steps_per_sec": list(sps_table.sample_steps_per_sec),
                "max_batch_tokens": int(sps_table.max_batch_tokens),
            },
            kind="diagonal",
        )
    if isinstance(sps_table, SpsAdditiveCostTable):
        return sps_table_from_json_dict(
            {
                "bias_seconds": sps_table.bias_seconds,
                "bs_probes": list(sps_table.bs_probes),
                "alpha_seconds": list(sps_table.alpha_seconds),
                "m_probes": list(sps_table.m_probes),
                "theta_seconds": list(sps_table.theta_seconds),
            },
            kind="additive",
        )
    raise TypeError(f"unknown SPS table type {type(sps_table).__name__}")


def around(
    original: Callable[..., Any], *, history_survival_probs: torch.Tensor, sps_table: Any, cfg: Any
) -> Any:
    from sgl_dspark.srt.speculative.dspark.planner import compute_verify_budget
    from sgl_dspark.srt.speculative.dspark.sps import AdditiveSpsTable
    from sglang.srt.speculative.dspark_components.dspark_planner import VerifyBudgetDecision

    try:
        table = our_table(sps_table)
    except (TypeError, ValueError) as exc:
        decline(NAME, f"SPS table outside sglang-dspark's validation: {exc}")
        return original(history_survival_probs=history_survival_probs, sps_table=sps_table, cfg=cfg)
    requests = int(history_survival_probs.shape[0])
    survival = history_survival_probs[:, : cfg.resolved_max_verify_len()]
    result = compute_verify_budget(survival, table, eps=float(cfg.survival_eps))
    tokens = requests + result.budget
    if isinstance(table, AdditiveSpsTable):
        step_seconds: float | None = float(table.step_seconds(requests, tokens))
    else:
        sps = float(np.asarray(table.steps_per_sec_floor(tokens)))
        step_seconds = 1.0 / sps if sps > 0 else None
    return VerifyBudgetDecision(
        budget=result.budget, predicted_step_seconds=step_seconds, predicted_theta=result.theta
    )
