"""Triton kernels of sgl_dspark, one folder per kernel family (`docs/kernels.md` lists them).

Each family keeps its torch reference in `<family>/reference.py`, a module that never imports
Triton: the tests compare the kernels against it, and the runtime's torch backend of the family
calls it. The public launchers below are imported lazily, on first access, so that importing a
reference module (or this package) never loads Triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_dspark.kernels.attention.draft import draft_attention
    from sgl_dspark.kernels.attention.window_sparse import window_sparse_attention
    from sgl_dspark.kernels.compressor.decode import compressor_decode
    from sgl_dspark.kernels.compressor.extend import compressor_extend
    from sgl_dspark.kernels.compressor.pool import compressor_pool
    from sgl_dspark.kernels.compressor.reference import PooledEntries
    from sgl_dspark.kernels.fp8.act_quant import quantize_act_fp8, quantize_act_mxfp8
    from sgl_dspark.kernels.fp8.mx_moe import mx_fused_moe
    from sgl_dspark.kernels.fp8.reference import Fp8ActFormat, Fp8Activation
    from sgl_dspark.kernels.fp8.w8a8 import (
        w8a8_grouped_linear,
        w8a8_linear,
        w8a8_split_k_linear,
    )
    from sgl_dspark.kernels.indexer.fp4_k_quant import fp4_index_k_quant
    from sgl_dspark.kernels.indexer.fp4_q_rope import index_q_rope_fp4
    from sgl_dspark.kernels.indexer.logits import indexer_logits
    from sgl_dspark.kernels.indexer.reference import IndexQFp4Output
    from sgl_dspark.kernels.indexer.topk import index_topk
    from sgl_dspark.kernels.linear.small_m import small_m_grouped_linear, small_m_linear
    from sgl_dspark.kernels.mhc.post_combine import mhc_post_collapse, mhc_post_combine, mhc_pre
    from sgl_dspark.kernels.mhc.reference import MhcPostCollapseOutput, MhcPostCombineOutput
    from sgl_dspark.kernels.moe.activation import silu_mul_clamp
    from sgl_dspark.kernels.moe.grouped_gemm import fused_moe, moe_grouped_gemm
    from sgl_dspark.kernels.moe.reduce import moe_reduce
    from sgl_dspark.kernels.moe.reference import (
        MoeSortOutput,
        RouterConfig,
        RouterTopkOutput,
    )
    from sgl_dspark.kernels.moe.router import RouterWorkspace, make_router_workspace, router_topk
    from sgl_dspark.kernels.moe.sort import MoeSortPlan, moe_sort, prepare_moe_sort
    from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
    from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up
    from sgl_dspark.kernels.norm.rmsnorm import rms_norm
    from sgl_dspark.kernels.rope.q_kv import rope_q_kv
    from sgl_dspark.kernels.rope.tail import rope_tail
    from sgl_dspark.kernels.sampling.vocab_argmax import (
        combine_shard_argmax,
        shard_argmax_pairs,
        vocab_argmax,
        vocab_greedy_logprobs,
    )
    from sgl_dspark.kernels.spec.accept import spec_accept
    from sgl_dspark.kernels.spec.draft_inputs import prepare_draft_inputs
    from sgl_dspark.kernels.spec.markov import markov_greedy
    from sgl_dspark.kernels.spec.reference import AcceptOutput, DraftInputs, MarkovGreedyOutput

# Public name -> the module that defines it.
_EXPORTS = {
    "draft_attention": "attention.draft",
    "window_sparse_attention": "attention.window_sparse",
    "compressor_decode": "compressor.decode",
    "compressor_extend": "compressor.extend",
    "compressor_pool": "compressor.pool",
    "PooledEntries": "compressor.reference",
    "quantize_act_fp8": "fp8.act_quant",
    "quantize_act_mxfp8": "fp8.act_quant",
    "mx_fused_moe": "fp8.mx_moe",
    "Fp8ActFormat": "fp8.reference",
    "Fp8Activation": "fp8.reference",
    "w8a8_grouped_linear": "fp8.w8a8",
    "w8a8_linear": "fp8.w8a8",
    "w8a8_split_k_linear": "fp8.w8a8",
    "fp4_index_k_quant": "indexer.fp4_k_quant",
    "index_q_rope_fp4": "indexer.fp4_q_rope",
    "indexer_logits": "indexer.logits",
    "IndexQFp4Output": "indexer.reference",
    "index_topk": "indexer.topk",
    "small_m_grouped_linear": "linear.small_m",
    "small_m_linear": "linear.small_m",
    "mhc_post_collapse": "mhc.post_combine",
    "mhc_post_combine": "mhc.post_combine",
    "mhc_pre": "mhc.post_combine",
    "MhcPostCollapseOutput": "mhc.reference",
    "MhcPostCombineOutput": "mhc.reference",
    "silu_mul_clamp": "moe.activation",
    "fused_moe": "moe.grouped_gemm",
    "moe_grouped_gemm": "moe.grouped_gemm",
    "moe_reduce": "moe.reduce",
    "MoeSortOutput": "moe.reference",
    "RouterConfig": "moe.reference",
    "RouterTopkOutput": "moe.reference",
    "RouterWorkspace": "moe.router",
    "make_router_workspace": "moe.router",
    "router_topk": "moe.router",
    "MoeSortPlan": "moe.sort",
    "moe_sort": "moe.sort",
    "prepare_moe_sort": "moe.sort",
    "moe_route_gate_up": "moe.token_gemm",
    "moe_token_down_reduce": "moe.token_down",
    "rms_norm": "norm.rmsnorm",
    "rope_q_kv": "rope.q_kv",
    "rope_tail": "rope.tail",
    "combine_shard_argmax": "sampling.vocab_argmax",
    "shard_argmax_pairs": "sampling.vocab_argmax",
    "vocab_argmax": "sampling.vocab_argmax",
    "vocab_greedy_logprobs": "sampling.vocab_argmax",
    "spec_accept": "spec.accept",
    "prepare_draft_inputs": "spec.draft_inputs",
    "markov_greedy": "spec.markov",
    "AcceptOutput": "spec.reference",
    "DraftInputs": "spec.reference",
    "MarkovGreedyOutput": "spec.reference",
}

__all__ = [
    "AcceptOutput",
    "DraftInputs",
    "Fp8ActFormat",
    "Fp8Activation",
    "IndexQFp4Output",
    "MarkovGreedyOutput",
    "MhcPostCollapseOutput",
    "MhcPostCombineOutput",
    "MoeSortOutput",
    "MoeSortPlan",
    "PooledEntries",
    "RouterConfig",
    "RouterTopkOutput",
    "RouterWorkspace",
    "combine_shard_argmax",
    "compressor_decode",
    "compressor_extend",
    "compressor_pool",
    "draft_attention",
    "fp4_index_k_quant",
    "fused_moe",
    "index_q_rope_fp4",
    "index_topk",
    "indexer_logits",
    "make_router_workspace",
    "markov_greedy",
    "mhc_post_collapse",
    "mhc_post_combine",
    "mhc_pre",
    "moe_grouped_gemm",
    "moe_reduce",
    "moe_route_gate_up",
    "moe_sort",
    "moe_token_down_reduce",
    "mx_fused_moe",
    "prepare_draft_inputs",
    "prepare_moe_sort",
    "quantize_act_fp8",
    "quantize_act_mxfp8",
    "rms_norm",
    "rope_q_kv",
    "rope_tail",
    "router_topk",
    "shard_argmax_pairs",
    "silu_mul_clamp",
    "small_m_grouped_linear",
    "small_m_linear",
    "spec_accept",
    "vocab_argmax",
    "vocab_greedy_logprobs",
    "w8a8_grouped_linear",
    "w8a8_linear",
    "w8a8_split_k_linear",
    "window_sparse_attention",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
