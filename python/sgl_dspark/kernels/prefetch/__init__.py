"""Memory hints ("prefetch"): `l2.py` pulls byte ranges of device memory (weights) into the
GPU's L2 cache. A hint computes nothing, so the family has no torch reference: no result of any
kernel depends on whether it ran."""
