"""Resolve `--model-path` to a config and a weight stream: a built-in tiny model (`tiny`,
DeepSeek-V4; `tiny-v41`, DeepSeek-V4.1) or a checkpoint directory (HF or released names,
optionally FP8/MXFP4)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable

import torch

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import get_parallel_state, replicated
from sgl_dspark.srt.model_loader.dummy import DummyWeights
from sgl_dspark.srt.model_loader.loader import CheckpointWeights
from sgl_dspark.srt.model_loader.sources import WeightFactory, WeightSource
from sgl_dspark.srt.models.registry import model_entry
from sgl_dspark.srt.models.tiny import TINY_MODEL_NAME, tiny_config, tiny_weights
from sgl_dspark.srt.models.tiny_v41 import TINY_V41_MODEL_NAME, tiny_v41_config, tiny_v41_weights

# name -> (config, weights(cfg, names and shapes, seed)) of the built-in models
WeightsFn = Callable[..., list[tuple[str, torch.Tensor]]]
BUILTIN_MODELS: dict[str, Callable[[], tuple[ModelConfig, WeightsFn]]] = {
    TINY_MODEL_NAME: lambda: (tiny_config(), tiny_weights),
    TINY_V41_MODEL_NAME: lambda: (tiny_v41_config(), tiny_v41_weights),
}


def resolve_model(
    model_path: str,
    dtype: torch.dtype,
    seed: int = 0,
    load_format: str = "auto",
) -> tuple[ModelConfig, Iterable[tuple[str, WeightSource]] | WeightFactory]:
    """(config, weights): a built-in model's seeded weights; the checkpoint's tensors, read
    lazily onto the device by the model runner (`model_loader.CheckpointWeights`); or with
    `load_format="dummy"` seeded random weights in the checkpoint's declared formats (only
    config.json is read)."""
    del dtype  # the runner materialises every tensor in its own dtype
    if model_path in BUILTIN_MODELS:
        cfg, make_weights = BUILTIN_MODELS[model_path]()
        with replicated():  # the full tensors: each rank keeps its slice when loading
            model = model_entry(cfg).build_model(cfg, KernelChoice())
        shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        return cfg, make_weights(cfg, shapes, seed=seed)
    if not os.path.isdir(model_path):
        raise ValueError(
            f"--model-path {model_path!r}: not a directory and not a built-in model "
            f"({sorted(BUILTIN_MODELS)}; downloads from a model hub are not supported)"
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
