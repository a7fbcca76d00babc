"""Resolve `--model-path` to a config and a weight stream: the built-in tiny model or a
checkpoint directory (HF or released names, optionally FP8/MXFP4)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable

import torch

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import get_parallel_state, replicated
from sgl_dspark.srt.model_loader.dummy import DummyWeights
from sgl_dspark.srt.model_loader.loader import CheckpointWeights
from sgl_dspark.srt.model_loader.sources import WeightFactory, WeightSource
from sgl_dspark.srt.models.registry import model_entry
from sgl_dspark.srt.models.tiny import TINY_MODEL_NAME, tiny_config, tiny_weights


def resolve_model(
    model_path: str,
    dtype: torch.dtype,
    seed: int = 0,
    load_format: str = "auto",
) -> tuple[ModelConfig, Iterable[tuple[str, WeightSource]] | WeightFactory]:
    """(config, weights): the checkpoint's tensors, read lazily onto the device by the model
    runner (`model_loader.CheckpointWeights`), or with `load_format="dummy"` seeded random
    weights in the checkpoint's declared formats (only config.json is read)."""
    del dtype  # the runner materialises every tensor in its own dtype
    if model_path == TINY_MODEL_NAME:
        cfg = tiny_config()
        with replicated():  # the full tensors: each rank keeps its slice when loading
            model = model_entry(cfg).build_model(cfg, KernelChoice())
        shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        return cfg, tiny_weights(cfg, shapes, seed=seed)
    if not os.path.isdir(model_path):
        raise ValueError(
            f"--model-path {model_path!r}: not a directory and not 'tiny' "
            "(downloads from a model hub are not supported)"
        )
    cfg = ModelConfig.from_pretrained(model_path)
    if load_format == "dummy":
        return cfg, DummyWeights(cfg, seed)
    entry = model_entry(cfg)
    ps = get_parallel_state()
    local = cfg.n_routed_experts // ps.ep_size
    # An expert-parallel rank reads only its own experts (the model's slice of them).
    experts = (ps.ep_rank * local, local) if ps.ep_size > 1 else None
    weights = CheckpointWeights(model_path, cfg, entry.checkpoint_names, experts)
    if entry.model_files is None:
        return cfg, weights
    # Tensors derived from other files of the model directory (the tokenizer), checked now.
    return cfg, itertools.chain(weights, entry.model_files(cfg, model_path))
