"""DeepSeek-V4.1's activation quantisers (FP8 window KV, FP4 latents, FP4 indexer q/k): the
pure-torch spec (`reference.py`) and the launch that rotates, quantises and stores cache rows in
their packed forms (`store.py`).
"""
