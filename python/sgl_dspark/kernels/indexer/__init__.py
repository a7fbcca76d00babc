"""The lightning indexer of CSA layers ("indexer" kernel family, with the compressors of
`kernels/compressor/`).

`reference.py` is the torch spec (scoring, top-k selection, the FP4 format); `logits.py` scores
every token against its request's compressed entries, `topk.py` selects the k best,
`fp4_k_quant.py` and `fp4_q_rope.py` quantise the index keys and queries to FP4 (V4.1), with
the format's Triton helpers in `fp4_codec.py`.
"""
