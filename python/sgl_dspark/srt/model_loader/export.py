"""Write an HF-named DeepSeek-V4 state dict as a checkpoint in the released layout.

The inverse of the loader: tensors get released names (routed experts unstacked into per-expert
`w1/w3/w2`), optionally quantised the way the released V4-Flash checkpoint is (dense
linears FP8 with 128x128 E8M0 block scales, routed experts FP8 or MXFP4), and `config.json` uses
the released (legacy) keys. Used by tests to build tiny quantised checkpoints, and by users
to re-export a model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from sgl_dspark.srt.model_loader.name_mapping import (
    expert_stack_of,
    hf_to_released,
    released_expert_name,
    released_module_of_hf_linear,
    released_scale_name,
)
from sgl_dspark.srt.model_loader.quantization import quantize_fp8_block, quantize_mxfp4
from sgl_dspark.srt.model_loader.weight_utils import INDEX_FILE

if TYPE_CHECKING:
    from sgl_dspark.srt.configs.model_config import ModelConfig

# Released modules stored as FP8 in V4-Flash. Compressor/indexer-compressor projections,
# `indexer.weights_proj` and the router stay unquantised.
_FP8_MODULE_SUFFIXES = (
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_a",
    "attn.wo_b",
    "attn.indexer.wq_b",
    "ffn.shared_experts.w1",
    "ffn.shared_experts.w2",
    "ffn.shared_experts.w3",
)
_CANONICAL_RATIOS = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
EXPERT_DTYPES = ("fp8", "fp4")


def _is_fp8_dense(hf_name: str) -> bool:
    module = released_module_of_hf_linear(hf_name)
    return module is not None and module.split(".", 2)[2] in _FP8_MODULE_SUFFIXES


def _quantized(
    name: str, weight: torch.Tensor, fmt: str | None, block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """`{name: weight}` or the quantised pair `{name: q, scale_name: scale}`."""
    if fmt is None:
        return {name: weight}
    q, scale = quantize_fp8_block(weight, block) if fmt == "fp8" else quantize_mxfp4(weight)
    return {name: q, released_scale_name(name): scale}


def released_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor],
    quantize: bool = False,
    expert_dtype: str = "fp8",
    block: tuple[int, int] = (128, 128),
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> released-named tensors (experts unstacked; optionally quantised).

    Experts: `gate_up_proj [E, 2I, D]` -> `experts.{e}.w1 = [:I]`, `w3 = [I:]`;
    `down_proj [E, D, I]` -> `experts.{e}.w2`. Unquantised tensors keep their dtype.
    """
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype={expert_dtype!r}: expected one of {EXPERT_DTYPES}")
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf_state_dict.items():
        tensor = tensor.detach().cpu()
        stack = expert_stack_of(hf_name)
        if stack is None:
            fmt = "fp8" if quantize and _is_fp8_dense(hf_name) else None
            out.update(_quantized(hf_to_released(hf_name), tensor.clone(), fmt, block))
            continue
        layer, kind = stack
        if tensor.dim() != 3:
            raise ValueError(
                f"{hf_name!r}: expected a stacked [E, out, in] tensor, got {tuple(tensor.shape)}"
            )
        fmt = expert_dtype if quantize else None
        for expert in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                if tensor.shape[1] % 2:
                    raise ValueError(
                        f"{hf_name!r}: gate_up_proj rows {tensor.shape[1]} must be even"
                    )
                half = tensor.shape[1] // 2
                pieces = {"w1": tensor[expert, :half], "w3": tensor[expert, half:]}
            else:
                pieces = {"w2": tensor[expert]}
            for proj, piece in pieces.items():
                name = released_expert_name(layer, expert, proj)  # type: ignore[arg-type]
                out.update(_quantized(name, piece.clone(), fmt, block))
    return out


def released_config_dict(
    config: ModelConfig, quantize: bool = False, expert_dtype: str = "fp8"
) -> dict[str, Any]:
    """`config.json` contents in the released style (the legacy keys)."""
    ratios = list(config.compress_ratios)
    d: dict[str, Any] = {
        "architectures": list(config.architectures),
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "q_lora_rank": config.q_lora_rank,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "num_experts_per_tok": config.num_experts_per_tok,
        "n_routed_experts": config.n_routed_experts,
        "n_shared_experts": config.n_shared_experts,
        "scoring_func": config.scoring_func,
        "norm_topk_prob": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_main.theta,
        "compress_rope_theta": config.rope_compress.theta,
        "compress_ratios": ratios,
        "hc_mult": config.hc_mult,
        "hc_sinkhorn_iters": config.hc_sinkhorn_iters,
        "hc_eps": config.hc_eps,
        "swiglu_limit": config.swiglu_limit,
        "sliding_window": config.sliding_window,
        "o_groups": config.o_groups,
        "o_lora_rank": config.o_lora_rank,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
        "index_topk": config.index_topk,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids)
        if len(config.eos_token_ids) != 1
        else config.eos_token_ids[0],
        "torch_dtype": config.torch_dtype,
    }
    if config.pad_token_id is not None:
        d["pad_token_id"] = config.pad_token_id
    rates = dict(config.compress_rates)
    d["compress_rate_csa"] = rates["compressed_sparse_attention"]
    d["compress_rate_hca"] = rates["heavily_compressed_attention"]
    # `compress_ratios` alone can only express the canonical rates 4/128 (HF and SGLang map the
    # ratio back to a layer type), so non-canonical tiny configs also carry the layer types.
    if any(_CANONICAL_RATIOS.get(r) != t for r, t in zip(ratios, config.layer_types)):
        d["layer_types"] = list(config.layer_types)
    num_hash = sum(1 for t in config.mlp_layer_types if t == "hash_moe")
    d["num_hash_layers"] = num_hash
    if list(config.mlp_layer_types) != ["hash_moe"] * num_hash + ["moe"] * (len(ratios) - num_hash):
        d["mlp_layer_types"] = list(config.mlp_layer_types)
    rope = config.rope_compress
    if rope.rope_type == "yarn":
        d["rope_scaling"] = {
            "type": "yarn",
            "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
        }
        if rope.attention_factor != 1.0:
            d["rope_scaling"]["attention_factor"] = rope.attention_factor
    if not config.q_head_norm:
        d["q_head_norm"] = False
    if quantize:
        block = config.quantization.weight_block_size if config.quantization else (128, 128)
        d["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
        }
        d["expert_dtype"] = expert_dtype
    d.update(config.extra_dict())
    return d


def write_shards(
    tensors: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int | None
) -> None:
    """`tensors` as `model.safetensors`, or with `max_shard_bytes` as shards of at most that
    many bytes (a larger tensor gets a shard of its own) plus the index the loader reads."""
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_released_checkpoint(
    hf_state_dict: Mapping[str, torch.Tensor],
    config: ModelConfig,
    out_dir: str,
    quantize: bool = False,
    expert_dtype: str = "fp8",
    max_shard_bytes: int | None = None,
) -> None:
    """Write `hf_state_dict` (HF names) to `out_dir` as a released-layout checkpoint.

    Args:
        hf_state_dict: HF-named tensors (e.g. `DeepseekV4ForCausalLM.state_dict()`).
        config: the model's config; written as released-style `config.json`.
        quantize: FP8-quantise the dense linears (128x128 blocks, or the config's block size)
            and quantise routed experts as `expert_dtype` ("fp8" or "fp4" = MXFP4).
        max_shard_bytes: split into `model-0000i-of-0000n.safetensors` + index when set.
    """
    if config.v41 is not None:
        raise ValueError(
            "save_released_checkpoint writes the DeepSeek-V4 layout; a DeepSeek-V4.1 config "
            f"(model_type {config.model_type!r}) has other tensors and config fields"
        )
    block = config.quantization.weight_block_size if config.quantization else (128, 128)
    tensors = released_state_dict(hf_state_dict, quantize, expert_dtype, block)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(released_config_dict(config, quantize, expert_dtype), f, indent=2)
    write_shards(tensors, out_dir, max_shard_bytes)


__all__ = [
    "released_config_dict",
    "released_state_dict",
    "save_released_checkpoint",
    "write_shards",
]
