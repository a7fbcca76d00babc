"""Interleaved RoPE on the trailing channels of each head ("rope" kernel family).

`reference.py` is the torch implementation and the spec; `tail.py` rotates (and optionally
normalises and scatters) rows in one launch, `q_kv.py` rotates an attention layer's query heads
and KV row in one launch, `epilogue.py` is the inverse rotation as another kernel's epilogue, and
`rows.py` the row code and argument plan these share.
"""
