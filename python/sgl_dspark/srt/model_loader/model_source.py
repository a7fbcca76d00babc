"""Resolve `--model-path` to a config and a weight stream: the built-in tiny model or a
checkpoint directory (HF or released names, optionally FP8/MXFP4)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.model_loader.loader import load_checkpoint
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.tiny import TINY_MODEL_NAME, tiny_config, tiny_weights


def resolve_model(
    model_path: str,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[ModelConfig, Iterable[tuple[str, torch.Tensor]]]:
    if model_path == TINY_MODEL_NAME:
        cfg = tiny_config()
        shapes = [(k, tuple(v.shape)) for k, v in DeepseekV4ForCausalLM(cfg).state_dict().items()]
        return cfg, tiny_weights(cfg, shapes, seed=seed)
    if not os.path.isdir(model_path):
        raise ValueError(
            f"--model-path {model_path!r}: not a directory and not 'tiny' "
            "(downloads from a model hub are not supported)"
        )
    cfg = ModelConfig.from_pretrained(model_path)
    return cfg, load_checkpoint(model_path, cfg, dtype)
