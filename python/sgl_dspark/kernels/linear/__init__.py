"""Decode-sized linear layers ("linear" kernel family): `small_m.py` spreads a GEMV over many
narrow column blocks; `reference.py` is its fp32-accumulating spec."""
