"""DeepSeek-V4.1's Engram: the gather of the hashed n-gram rows of a layer's embedding table
(`gather.py`) beside its pure-torch reference (`reference.py`)."""
