"""Triton kernels of sgl_dspark: the public launchers (references `*_ref` live beside each kernel
in its family module and are imported only by tests and benchmarks)."""

from sgl_dspark.kernels.activation import Fp8Activation, silu_mul_clamp
from sgl_dspark.kernels.compressor_decode import compressor_decode
from sgl_dspark.kernels.compressor_extend import compressor_extend
from sgl_dspark.kernels.compressor_pool import PooledEntries, compressor_pool
from sgl_dspark.kernels.draft_inputs import DraftInputs, prepare_draft_inputs
from sgl_dspark.kernels.fp4_indexer import IndexQFp4Output, fp4_index_k_quant, index_q_rope_fp4
from sgl_dspark.kernels.fused_moe import fused_moe, moe_grouped_gemm
from sgl_dspark.kernels.index_topk import index_topk
from sgl_dspark.kernels.indexer import indexer_logits
from sgl_dspark.kernels.markov import MarkovGreedyOutput, markov_greedy
from sgl_dspark.kernels.mhc import MhcPostCombineOutput, mhc_post_combine, mhc_pre
from sgl_dspark.kernels.moe_reduce import moe_reduce
from sgl_dspark.kernels.moe_route import (
    RouterTopkOutput,
    RouterWorkspace,
    make_router_workspace,
    router_topk,
)
from sgl_dspark.kernels.moe_sort import MoeSortOutput, MoeSortPlan, moe_sort, prepare_moe_sort
from sgl_dspark.kernels.rmsnorm import rms_norm
from sgl_dspark.kernels.rope import rope_tail
from sgl_dspark.kernels.rope_qkv import rope_q_kv
from sgl_dspark.kernels.small_m_linear import small_m_linear
from sgl_dspark.kernels.sparse_attention import window_sparse_attention
from sgl_dspark.kernels.spec_accept import AcceptOutput, spec_accept
from sgl_dspark.kernels.vocab_argmax import combine_shard_argmax, shard_argmax_pairs, vocab_argmax

__all__ = [
    "AcceptOutput",
    "DraftInputs",
    "Fp8Activation",
    "IndexQFp4Output",
    "MhcPostCombineOutput",
    "MoeSortOutput",
    "MoeSortPlan",
    "RouterTopkOutput",
    "RouterWorkspace",
    "combine_shard_argmax",
    "fp4_index_k_quant",
    "fused_moe",
    "index_q_rope_fp4",
    "make_router_workspace",
    "mhc_post_combine",
    "moe_grouped_gemm",
    "moe_reduce",
    "moe_sort",
    "prepare_draft_inputs",
    "prepare_moe_sort",
    "rope_tail",
    "router_topk",
    "shard_argmax_pairs",
    "silu_mul_clamp",
    "spec_accept",
    "vocab_argmax",
    "window_sparse_attention",
    "PooledEntries",
    "compressor_pool",
    "indexer_logits",
    "rms_norm",
    "compressor_decode",
    "compressor_extend",
    "index_topk",
    "mhc_pre",
    "MarkovGreedyOutput",
    "markov_greedy",
    "small_m_linear",
    "rope_q_kv",
]
