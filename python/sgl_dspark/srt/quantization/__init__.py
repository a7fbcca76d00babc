"""Numeric formats the models define as part of their semantics (FP8 and FP4 fake-quantisation):
a leaf package, so the layers that compute with them and the KV pools that store them share one
definition without depending on each other."""
