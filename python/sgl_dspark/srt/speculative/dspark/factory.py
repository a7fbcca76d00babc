"""Resolve the DSpark draft for a target and build the worker.

Draft location: `--speculative-draft-model-path` (a directory, or a built-in draft); otherwise
the target directory itself when its config bundles `dspark_*` keys, then `<model>/dspark/`, and
the built-in draft of a built-in target (`tiny-dspark` for `tiny`, `tiny-v41-dspark` for
`tiny-v41`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.model_executor.model_runner import ModelRunner
from sgl_dspark.srt.model_loader.dummy import DummyWeights
from sgl_dspark.srt.model_loader.sources import WeightFactory
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.models.tiny import TINY_MODEL_NAME, tiny_weights
from sgl_dspark.srt.models.tiny_v41 import (
    TINY_V41_DSPARK_CONFIG,
    TINY_V41_DSPARK_NAME,
    TINY_V41_MODEL_NAME,
)
from sgl_dspark.srt.speculative.dspark.draft_checkpoint import load_draft_weights
from sgl_dspark.srt.speculative.dspark.worker import DSparkArgs, DSparkWorker

TINY_DSPARK_NAME = "tiny-dspark"
TINY_DSPARK_CONFIG = {
    "dspark_block_size": 5,
    "dspark_markov_rank": 32,
    "dspark_noise_token_id": 3,
    "dspark_target_layer_ids": [2, 3, 4],
    "dspark_n_routed_experts": 8,
    "dspark_num_experts_per_tok": 2,
    "sliding_window": 32,
    "enable_confidence_head": True,
}
# built-in target -> (its built-in draft, the draft's config)
BUILTIN_DRAFTS: dict[str, tuple[str, dict]] = {
    TINY_MODEL_NAME: (TINY_DSPARK_NAME, TINY_DSPARK_CONFIG),
    TINY_V41_MODEL_NAME: (TINY_V41_DSPARK_NAME, TINY_V41_DSPARK_CONFIG),
}


def resolve_draft(
    model_path: str,
    draft_path: str | None,
    runner: ModelRunner,
    block_size: int | None,
    seed: int = 0,
    load_format: str = "auto",
) -> tuple[DSparkConfig, Iterable[tuple[str, torch.Tensor]] | WeightFactory]:
    target = runner.model_cfg
    if draft_path is None:
        if target.extra:
            draft_path = model_path
        elif os.path.isdir(os.path.join(model_path, "dspark")):
            draft_path = os.path.join(model_path, "dspark")
        elif model_path in BUILTIN_DRAFTS:
            draft_path = BUILTIN_DRAFTS[model_path][0]
        else:
            raise ValueError(
                "DSpark needs a draft: pass --speculative-draft-model-path (the target config has "
                "no dspark_* keys and there is no <model>/dspark/ directory)"
            )
    builtin = {name: (tgt, raw) for tgt, (name, raw) in BUILTIN_DRAFTS.items()}
    if draft_path in builtin:
        pair, raw = builtin[draft_path]
        if model_path != pair:
            raise ValueError(
                f"the built-in {draft_path!r} draft pairs only with the {pair!r} target"
            )
        dcfg = DSparkConfig.from_dict(raw, target, block_size)
        shapes = [(k, tuple(v.shape)) for k, v in DSparkDraftModel(dcfg).state_dict().items()]
        return dcfg, tiny_weights(dcfg.stage_config, shapes, seed=seed + 1)
    if not os.path.isdir(draft_path):
        raise ValueError(f"--speculative-draft-model-path {draft_path!r} is not a directory")
    dcfg = DSparkConfig.from_pretrained(draft_path, target, block_size)
    if load_format == "dummy":  # random weights in the declared formats (only configs read)
        return dcfg, DummyWeights(dcfg.stage_config, seed + 1)
    return dcfg, load_draft_weights(draft_path, dcfg)


def create_dspark_worker(
    runner: ModelRunner,
    model_path: str,
    draft_path: str | None,
    block_size: int | None,
    args: DSparkArgs,
    seed: int = 0,
    load_format: str = "auto",
) -> DSparkWorker:
    """The worker of the draft `resolve_draft` finds; `seed` initialises a built-in or random
    draft."""
    dcfg, weights = resolve_draft(
        model_path, draft_path, runner, block_size, seed=seed, load_format=load_format
    )
    return DSparkWorker(runner, dcfg, weights, args)
