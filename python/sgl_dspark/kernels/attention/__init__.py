"""Attention kernels, chosen by `--attention-backend` (not a `--kernel-backend` family).

`reference.py` is the torch math (the torch backend and the DSpark draft's torch core);
`window_sparse.py` is DeepSeek-V4's attention (sliding window + compressed entries + sinks),
`packed_keys.py` DeepSeek-V4.1's (the FP8 window and FP4 latents decoded in its loads), both
split and merged as `splits.py` says; `draft.py` the DSpark draft stage's core;
`online_softmax.py` the step all three share.
"""
