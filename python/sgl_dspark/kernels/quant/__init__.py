"""DeepSeek-V4.1's activation quantisers (FP8 window KV, FP4 latents, FP4 indexer q/k): the
pure-torch spec (`reference.py`) and the Triton encoders / decoders the storing and reading
kernels share (`codec.py`). No launcher of its own: the kernels that use the formats belong to
their own families (rope, compressor, indexer, attention).
"""
