"""Quantised copies of a trained V4.1 model's tensors (HF names), in the formats the release
declares: FP8 E4M3 with 32x32 E8M0 block scales for the dense projections the release stores in
FP8 (attention q/kv/o, the indexer's query projection, the shared expert, Engram's projection),
routed experts in FP8 or MXFP4; everything else as given (embeddings, head, router, norms, mHC,
compressor and indexer key/weight projections). The loader keeps them packed (`--weight-format
native`) or dequantises them (`bf16`)."""

from __future__ import annotations

from typing import Any

import torch

from sgl_dspark.srt.model_loader.quantization import quantize_fp8_block, quantize_mxfp4

FP8_BLOCK = (32, 32)
FP8_DENSE_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_proj.weight",
    "self_attn.o_a_proj.weight",
    "self_attn.o_b_proj.weight",
    "self_attn.indexer.q_b_proj.weight",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
    "engram.wkv.weight",
)
EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4")


def quantize_tensors(
    tensors: dict[str, torch.Tensor], expert_format: str
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> the stored set: FP8 dense projections (`<module>.weight` +
    `<module>.weight_scale_inv`), experts per `expert_format` (`<stack>` + `<stack>_scale_inv`)."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert format {expert_format!r}: expected one of {EXPERT_FORMATS}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(FP8_DENSE_SUFFIXES):
            q, scale = quantize_fp8_block(t.float(), FP8_BLOCK)
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = q, scale
        elif name.endswith(EXPERT_SUFFIXES) and expert_format != "bf16":
            if expert_format == "fp8":
                q, scale = quantize_fp8_block(t.float(), FP8_BLOCK)
            else:
                q, scale = quantize_mxfp4(t.float())
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            out[name] = t
    return out


def quantization_config(expert_format: str) -> dict[str, Any]:
    """The `quantization_config` of `config.json` for `quantize_tensors(..., expert_format)`."""
    return {
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
        "expert_dtype": "fp4" if expert_format == "mxfp4" else "fp8",
    }


__all__ = ["EXPERT_FORMATS", "quantization_config", "quantize_tensors"]
