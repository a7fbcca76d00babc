"""GEMMs on FP8 activations ("fp8" kernel family, `reference.py` is the spec): the per-token-group
activation quantiser, the W8A8 block-scaled GEMM for prefill-sized inputs, its split-K variant for
fixed-shape weight-bound projections, and the MX (`tl.dot_scaled`) MoE stages for targets with
native microscaling MMA."""
