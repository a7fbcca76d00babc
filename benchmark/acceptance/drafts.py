"""The drafts a measurement compares: the draft under test, found where the engine finds it, and
the random-draft control, a draft of exactly the same architecture (its config.json) with seeded
random weights, for the same target. The control shows what acceptance a draft gets without
having learned anything (chance agreement with the target)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.entrypoints.builtin_dirs import BUILTIN_MODELS, materialize
from sgl_dspark.srt.models.shipped import shipped_model_dir
from sgl_dspark.srt.speculative.dspark.draft_checkpoint import save_draft_checkpoint
from sgl_dspark.srt.speculative.dspark.factory import BUILTIN_DRAFTS
from sgl_dspark.tools.init_dspark_draft import random_draft_weights


def model_dir(model_path: str) -> str:
    """The directory of a target: itself, or a built-in model written out as a directory."""
    if os.path.isdir(model_path):
        return model_path
    shipped = shipped_model_dir(model_path)
    if shipped is not None:
        return shipped
    if model_path in BUILTIN_MODELS:
        return materialize(model_path)
    raise ValueError(f"--model-path {model_path!r} is neither a directory nor a built-in model")


def _read_config(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def draft_dir(model_path: str, draft_path: str | None) -> str:
    """The directory holding the draft the engine would use for these arguments (the same
    search as the engine's: the given path or built-in draft; else the target directory when
    its config bundles `dspark_*` keys, else `<target>/dspark/`)."""
    if draft_path is not None:
        if os.path.isdir(draft_path):
            return draft_path
        targets = {name: target for target, (name, _) in BUILTIN_DRAFTS.items()}
        if draft_path in targets:
            return os.path.join(materialize(targets[draft_path]), "dspark")
        raise ValueError(f"--draft-path {draft_path!r} is neither a directory nor a built-in draft")
    target = model_dir(model_path)
    if ModelConfig.from_hf_dict(_read_config(target)).extra:
        return target
    bundled = os.path.join(target, "dspark")
    if os.path.isdir(bundled):
        return bundled
    raise ValueError(f"no draft for {model_path!r}: pass --draft-path")


def draft_block_size(model_path: str, draft_path: str | None) -> int:
    """The block size (drafts per step) the draft checkpoint declares."""
    target = ModelConfig.from_hf_dict(_read_config(model_dir(model_path)))
    return DSparkConfig.from_pretrained(draft_dir(model_path, draft_path), target).block_size


def write_random_draft(model_path: str, draft_path: str | None, out_dir: Path, seed: int) -> str:
    """A draft with the config of the draft under test and seeded random weights, written to
    `out_dir`; returns its directory."""
    target = ModelConfig.from_hf_dict(_read_config(model_dir(model_path)))
    raw = _read_config(draft_dir(model_path, draft_path))
    raw.pop("quantization_config", None)  # the random weights are written unquantised
    dcfg = DSparkConfig.from_dict(raw, target)
    save_draft_checkpoint(random_draft_weights(dcfg, seed), dcfg, raw, str(out_dir))
    return str(out_dir)
