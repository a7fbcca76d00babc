
from sgl_dspark.kernels.draft_inputs import DraftInputs, prepare_draft_inputs
from sgl_dspark.kernels.rope import rope_tail
from sgl_dspark.kernels.spec_accept import AcceptOutput, spec_accept
from sgl_dspark.kernels.vocab_argmax import combine_shard_argmax, shard_argmax_pairs, vocab_argmax
from sgl_dspark.kernels.fp4_indexer import IndexQFp4Output, fp4_index_k_quant, index_q_rope_fp4
from sgl_dspark.kernels.mhc import MhcPostCombineOutput, mhc_post_combine
