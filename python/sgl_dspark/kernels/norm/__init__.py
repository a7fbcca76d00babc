"""RMSNorm ("norm" kernel family): `reference.py` is the torch implementation and the spec,
`rmsnorm.py` the one-launch Triton kernel."""
