"""What one measured configuration is: the draft, the verify policy and the block size, turned into
the offline `Engine`'s keyword arguments (its `ServerArgs` fields).

Policy specs on the command line:
- `full`: every request verifies its whole block (`--speculative-dspark-verify-policy full`);
- `static:W`: every step verifies W tokens (the anchor and W - 1 drafts) at every batch size, from a
  width table written here (`static`, `--speculative-dspark-width-table-path`); W = 1 turns
  speculation off;
- `static`: the width table packaged for this device (`python/sgl_dspark/kernels/tuning/`);
- `confidence` / `confidence:async`: the confidence-driven budget (Algorithm 1 on this step's
  confidences, or top-K with a budget from lagged confidences), which needs an SPS cost table of
  this device (`--speculative-dspark-sps-table-path`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POLICY_KINDS = ("full", "static", "confidence")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    kind: str  # full | static | confidence
    width: int | None = None  # static: the fixed verify width; None: the packaged table
    confidence_mode: str = "sync"

    @property
    def label(self) -> str:
        if self.kind == "static" and self.width is not None:
            return f"static:{self.width}"
        if self.kind == "confidence" and self.confidence_mode != "sync":
            return f"confidence:{self.confidence_mode}"
        return self.kind


def parse_policy(spec: str) -> PolicySpec:
    """`full`, `static`, `static:W`, `confidence`, `confidence:sync` or `confidence:async`."""
    kind, _, arg = spec.strip().partition(":")
    if kind == "full" and not arg:
        return PolicySpec("full")
    if kind == "static":
        if not arg:
            return PolicySpec("static")
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"policy {spec!r}: the static width must be an integer >= 1")
        return PolicySpec("static", width=int(arg))
    if kind == "confidence" and arg in ("", "sync", "async"):
        return PolicySpec("confidence", confidence_mode=arg or "sync")
    raise ValueError(
        f"policy {spec!r}: choose full, static, static:W, confidence or confidence:async"
    )


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """One DSpark configuration: which draft (`draft_label` names it in the results), the
    policy, and the block size (None: the draft checkpoint's own)."""

    draft_label: str
    draft_path: str | None
    policy: PolicySpec
    block_size: int | None

    @property
    def name(self) -> str:
        block = "the draft's block size" if self.block_size is None else f"block {self.block_size}"
        return f"{self.draft_label} {self.policy.label}, {block}"


def write_width_table(width: int, tables_dir: Path) -> Path:
    """A width table giving every batch size the verify width `width`."""
    tables_dir.mkdir(parents=True, exist_ok=True)
    path = tables_dir / f"widths_static_{width}.json"
    path.write_text(json.dumps({"widths_by_batch_size": {"1": width}}, indent=2))
    return path


def full_width(block_size: int) -> int:
    return block_size + 1


def spec_engine_kwargs(
    cfg: SpecConfig, tables_dir: Path, sps_table: str | None, draft_block_size: int
) -> dict[str, Any]:
    """The Engine arguments of `cfg`; `draft_block_size` is the block size the run will use
    (the draft's own when `cfg.block_size` is None). Raises ValueError for a static width wider
    than the block's full width, or a confidence policy without an SPS table."""
    kw: dict[str, Any] = {
        "speculative_algorithm": "DSpark",
        "speculative_draft_model_path": cfg.draft_path,
        "speculative_dspark_block_size": cfg.block_size,
        "speculative_dspark_verify_policy": cfg.policy.kind,
    }
    policy = cfg.policy
    if policy.kind == "static" and policy.width is not None:
        if policy.width > full_width(draft_block_size):
            raise ValueError(
                f"static width {policy.width} exceeds the full verify width "
                f"{full_width(draft_block_size)} of block size {draft_block_size}"
            )
        kw["speculative_dspark_width_table_path"] = str(write_width_table(policy.width, tables_dir))
    if policy.kind == "confidence":
        if sps_table is None:
            raise ValueError("the confidence policy needs an SPS table")
        kw["speculative_dspark_sps_table_path"] = sps_table
        kw["speculative_dspark_confidence_mode"] = policy.confidence_mode
    return kw
