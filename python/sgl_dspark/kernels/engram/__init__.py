"""DeepSeek-V4.1's Engram: the gather of the hashed n-gram rows of a layer's embedding table
(`gather.py`) and the gated add of the projected value to the mHC streams (`gate.py`), beside
their pure-torch references (`reference.py`)."""
