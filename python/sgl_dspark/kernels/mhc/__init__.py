"""mHC hyper-connection sublayer boundaries ("mhc" kernel family).

`reference.py` is the torch spec of the fused boundary; `post_combine.py` holds its launchers,
`boundary_kernel.py` the kernel, whose two phases live in `stream_update.py` (A) and
`coefficients.py` (B). The model's unfused torch path (`srt/layers/mhc.py`) follows HF's
rounding (post/comb cast to the activation dtype, a matmul) and is not this reference.
"""
