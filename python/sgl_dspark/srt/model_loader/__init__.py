"""Checkpoint loading for DeepSeek-V4: safetensors (released or HF names, FP8/MXFP4) -> HF names.

`load_checkpoint(path, config, dtype)` yields `(hf_name, tensor)` pairs whose names are exactly
the model's parameter/buffer names; `save_released_checkpoint` writes the released layout.
"""

from __future__ import annotations

from sgl_dspark.srt.model_loader.export import save_released_checkpoint
from sgl_dspark.srt.model_loader.loader import load_checkpoint, load_state_dict
from sgl_dspark.srt.model_loader.name_mapping import detect_naming_scheme, is_fp32_param
from sgl_dspark.srt.model_loader.quantization import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    quantize_fp8_block,
    quantize_mxfp4,
)
from sgl_dspark.srt.model_loader.weight_utils import find_safetensors_files

__all__ = [
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "detect_naming_scheme",
    "find_safetensors_files",
    "is_fp32_param",
    "load_checkpoint",
    "load_state_dict",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "save_released_checkpoint",
]
