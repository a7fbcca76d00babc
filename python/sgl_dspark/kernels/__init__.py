
from sgl_dspark.kernels.draft_inputs import DraftInputs, prepare_draft_inputs
from sgl_dspark.kernels.rope import rope_tail
from sgl_dspark.kernels.spec_accept import AcceptOutput, spec_accept
from sgl_dspark.kernels.vocab_argmax import combine_shard_argmax, shard_argmax_pairs, vocab_argmax
