"""The routed-expert (MoE) layer ("moe" kernel family).

`reference.py` is the torch spec of every op here. Routing: `router.py` (gate GEMV, scores,
top-k, padded rows; one or two launches) with the row routing in `route_rows.py` and the hash
layers' GEMV in `hash_gemv.py`. Experts, sorted path: `sort.py` groups the routes by local
expert, `grouped_gemm.py` runs the grouped GEMMs (stage 1 with the activation as epilogue,
stage 2), `reduce.py` sums each token's routes with the shared expert. Experts, per-token path
for a few tokens: `token_gemm.py` (stage 1 per route) and `token_down.py` (stage 2 with the
reduce as epilogue). Both paths form their products through `expert_weights.py` (expert weights as
stacked tensors or kept as stored, and the one expert product). `activation.py` is the clamped
SwiGLU (also the shared expert's).
"""
