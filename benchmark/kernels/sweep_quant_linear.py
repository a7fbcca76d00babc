"""Launch-shape sweep of the library's quantised linear (`bench_quant_gemm.py --sweep`): each
`SWEEP` shape of `quantized_linear` (`_quantized_meta` overridden) at the dense shapes of
`bench_quant_gemm.SETUP` (`quantized_grouped_linear` for the grouped ones), checked against
dequantise-then-reference, then timed with that script's harness."""

from __future__ import annotations

import torch
from sgl_dspark.kernels.linear.reference import small_m_grouped_linear_ref, small_m_linear_ref

from benchmark.kernels.bench_quant_gemm import (
    FORMATS,
    SETUP,
    Row,
    _copies,
    _generator,
    _label,
    _reps,
    max_rel_err,
    quantize_random,
    quantized_grouped_linear,
    quantized_linear,
    time_us,
)

# (BLOCK_N, BLOCK_K channels, SPLIT_K, num_stages, num_warps); the library's own choice runs
# before these (its row "default"), the first of them being its narrow-N shape and the second
# its previous one. SPLIT_K > 1 takes one warp per slice (more warps would repeat the batched
# dot).
# At N <= 8192 the 16-column blocks are few per SM, and a pipeline stage is mostly the
# activation tile padded to 16 rows (16 x BLOCK_K bf16): fewer or shallower stages let more
# programs share an SM, so a grid of a few hundred programs runs in one wave.
SWEEP = [
    (16, 512, 4, 4, 4),
    (16, 1024, 8, 3, 8),
    (16, 1024, 8, 2, 8),
    (16, 512, 4, 3, 4),
    (16, 512, 4, 2, 4),
    (16, 256, 2, 4, 2),
    (16, 256, 1, 8, 2),
    (32, 512, 4, 4, 4),
    (32, 1024, 8, 3, 8),
    (64, 256, 1, 4, 4),
    (64, 512, 4, 3, 4),
    # 64-channel slices: twice the warps for a step's channels (8 warps), or a step of half
    # the channels on the usual 4 warps (a smaller stage: four programs an SM)
    (16, 512, 8, 4, 8),
    (16, 256, 4, 4, 4),
]


def sweep_linear(
    m_values: list[int],
    name: str,
    n: int,
    k: int,
    formats: tuple[tuple[str, int], ...] = FORMATS,
    groups: int = 1,
) -> list[Row]:
    """`quantized_linear` (`quantized_grouped_linear` over `groups` groups of N x K) at each
    `SWEEP` launch shape (`_quantized_meta` overridden) for each (format, group) of `formats`,
    checked against dequantise-then-reference."""
    import sgl_dspark.kernels.linear.quantized as quantized

    default_meta = quantized._quantized_meta
    gen = _generator(n + k)
    linear = quantized_linear if groups == 1 else quantized_grouped_linear
    reference = small_m_linear_ref if groups == 1 else small_m_grouped_linear_ref
    out = []
    for fmt, group in formats:
        w0 = quantize_random((groups * n, k), fmt, group, gen)
        weights = [w0] + [
            quantize_random((groups * n, k), fmt, group, gen) for _ in range(_copies(w0.nbytes) - 1)
        ]
        for m in m_values:
            rows = (m, k) if groups == 1 else (m, groups, k)
            x = torch.randn(rows, generator=gen, device=SETUP.device).to(torch.bfloat16)
            want = reference(x.float(), w0)  # fp32 sums of the exact fp32 weights
            for shape in [None, *SWEEP]:
                if shape is None:  # the library's own choice (it sees the groups and the device)
                    tag = "default"
                else:
                    bn, bk, split, stages, warps = shape
                    meta = dict(
                        BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_stages=stages, num_warps=warps
                    )
                    tag = f"BN{bn} BK{bk} split{split} s{stages} w{warps}"
                    quantized._quantized_meta = lambda *args, meta=meta: dict(meta)
                try:
                    err = max_rel_err(linear(x, w0), want)
                    calls = [lambda w=w, x=x: linear(x, w) for w in weights]
                    us = time_us(calls, _reps(len(weights)))
                except Exception as exc:  # noqa: BLE001 - a shape the target cannot run
                    print(f"{name} {fmt}/{group} {tag}: {type(exc).__name__}: {exc}"[:300])
                    continue
                finally:
                    quantized._quantized_meta = default_meta
                moved = w0.nbytes + 2 * groups * (m * k + m * n)
                out.append(Row(name, m, f"{_label(fmt, group)} {tag}", us, moved, err))
        del weights
    return out
