"""Resolve the DSpark draft for a target and build the worker.

Draft location: `--speculative-draft-model-path` (a directory, or `tiny-dspark`); otherwise the
target directory itself when its config bundles `dspark_*` keys, then `<model>/dspark/`, and the
built-in `tiny-dspark` for the built-in `tiny` target.
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
        elif model_path == TINY_MODEL_NAME:
            draft_path = TINY_DSPARK_NAME
        else:
            raise ValueError(
                "DSpark needs a draft: pass --speculative-draft-model-path (the target config has "
                "no dspark_* keys and there is no <model>/dspark/ directory)"
            )
    if draft_path == TINY_DSPARK_NAME:
        if model_path != TINY_MODEL_NAME:
            raise ValueError("the built-in 'tiny-dspark' draft pairs only with the 'tiny' target")
        dcfg = DSparkConfig.from_dict(TINY_DSPARK_CONFIG, target, block_size)
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
