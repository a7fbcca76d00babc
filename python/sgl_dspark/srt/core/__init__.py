"""The ground floor of `srt`: records and helpers every other package may use (request state, the
forward batch, host/device copies, the kernel choice, the step contract). It imports only the leaf
packages `srt.sampling` and `srt.tokenizer`, so no package cycle can pass through it.
"""
