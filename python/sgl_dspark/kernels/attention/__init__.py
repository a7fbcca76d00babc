"""Attention kernels, chosen by `--attention-backend` (not a `--kernel-backend` family).

`reference.py` is the torch math (the torch backend and the DSpark draft's torch core);
`window_sparse.py` is the target model's attention (sliding window + compressed entries + sinks),
`draft.py` the DSpark draft stage's core, `online_softmax.py` the step both share.
"""
