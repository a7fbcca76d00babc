"""Models by HF architecture name (`ModelConfig.architecture`): what the model runner builds, the
KV pool it sizes, the checkpoint names the loader maps, and what each architecture refuses at
startup. Entries import their modules only when resolved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.mem_cache.base import BaseKVPool
from sgl_dspark.srt.model_loader.name_mapping import V4_NAMES, V41_NAMES, NameTable
from sgl_dspark.srt.models.base import BaseCausalLM

# (cfg, num_slots, req_slots, max_verify_tokens, dtype, device[, window_dtype=]) -> pool;
# window_dtype is passed only to models without a fixed_kv_cache_dtype.
KVPoolFactory = Callable[..., BaseKVPool]


@dataclass(frozen=True)
class ModelEntry:
    build_model: Callable[[ModelConfig, KernelChoice], BaseCausalLM]
    build_kv_pool: KVPoolFactory
    kv_bytes_per_token: Callable[..., float]  # (cfg, dtype[, window_dtype=]), as the pool
    # (cfg, kernels, attention backend name) -> None, or ValueError naming the argument
    check_runtime: Callable[[ModelConfig, KernelChoice, str], None]
    checkpoint_names: NameTable
    # (cfg, model directory) -> tensors the model needs besides the checkpoint's (None: none)
    model_files: Callable[[ModelConfig, str], list[tuple[str, torch.Tensor]]] | None = None
    # The window KV's storage when the model defines it (`--kv-cache-dtype` may only repeat it);
    # None: chosen by `--kv-cache-dtype`, passed to the pool and its size as `window_dtype`.
    fixed_kv_cache_dtype: str | None = None


def _no_checks(cfg: ModelConfig, kernels: KernelChoice, attention_backend: str) -> None:
    del cfg, kernels, attention_backend


def _deepseek_v4() -> ModelEntry:
    from sgl_dspark.srt.mem_cache.kv_pool import DeepseekV4KVPool
    from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    return ModelEntry(
        build_model=DeepseekV4ForCausalLM,
        build_kv_pool=DeepseekV4KVPool,
        kv_bytes_per_token=DeepseekV4KVPool.bytes_per_token,
        check_runtime=_no_checks,
        checkpoint_names=V4_NAMES,
    )


def _engram_token_map(cfg: ModelConfig, model_dir: str) -> list[tuple[str, torch.Tensor]]:
    import os

    from sgl_dspark.srt.tokenizer.engram_map import byte_tokenizer_token_map, compressed_token_map
    from sgl_dspark.srt.tokenizer.hf_tokenizer import MARKER_FILE

    engram = cfg.v41.engram if cfg.v41 is not None else None
    if engram is None:
        return []
    args = (cfg.vocab_size, engram.compressed_vocab_size, engram.pad_id)
    if os.path.isfile(os.path.join(model_dir, MARKER_FILE)):
        # The directory names the byte tokenizer (`tokenizer/hf_tokenizer.py`): its map.
        token_map = byte_tokenizer_token_map(*args)
    else:
        token_map = compressed_token_map(os.path.join(model_dir, "tokenizer.json"), *args)
    return [("model.engram_token_map", token_map)]


def _deepseek_v41() -> ModelEntry:
    from sgl_dspark.srt.mem_cache.v41_pool import DeepseekV41KVPool
    from sgl_dspark.srt.models.deepseek_v41 import DeepseekV41ForCausalLM, check_runtime

    return ModelEntry(
        build_model=DeepseekV41ForCausalLM,
        build_kv_pool=DeepseekV41KVPool,
        kv_bytes_per_token=DeepseekV41KVPool.bytes_per_token,
        check_runtime=check_runtime,
        checkpoint_names=V41_NAMES,
        model_files=_engram_token_map,
        fixed_kv_cache_dtype="fp8_e4m3",
    )


MODEL_REGISTRY: dict[str, Callable[[], ModelEntry]] = {
    "DeepseekV4ForCausalLM": _deepseek_v4,
    "DeepseekV41ForCausalLM": _deepseek_v41,
}


def model_entry(cfg: ModelConfig) -> ModelEntry:
    name = cfg.architecture
    if name not in MODEL_REGISTRY:
        raise ValueError(
            f"config field 'architectures'={list(cfg.architectures)}: no model registered "
            f"under {name!r} (registered: {sorted(MODEL_REGISTRY)})"
        )
    return MODEL_REGISTRY[name]()


__all__ = ["MODEL_REGISTRY", "ModelEntry", "model_entry"]
