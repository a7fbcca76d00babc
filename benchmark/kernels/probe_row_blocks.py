"""Probe: the quantised linear above 16 rows, one row block a program against two.

    python benchmark/kernels/probe_row_blocks.py [--m 16,32,64] [--out FILE]

At more than 16 rows (decode at 32 requests, a DSpark verify of several requests)
`quantized_linear` runs 16-row blocks. With one block a program (`ROW_BLOCKS` 1), every block
reads and decodes the whole weight again: 32 rows read it twice. With two (`ROW_BLOCKS` 2,
`dequant.quantized_product`'s SECOND_ROWS), a program multiplies each dequantised weight tile
by both blocks; its pipeline stages then hold two activation tiles, so fewer programs share an
SM. This times the library's choice (two blocks a program, `_ROW_BLOCKS_ABOVE_TILE`, three
stages), one block a program and two at other pipeline depths and warp counts, at V4.1-Flash's dense decode
projections (FP8 32 x 32): each variant's output must be bit for bit the one-block variant's
(the row blocks a program owns enter no sum) and within the GEMM tolerance of
dequantise-then-reference. Timed from a CUDA graph cycling over enough weight copies that they
come from DRAM.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

import sgl_dspark.kernels.linear.quantized as quantized  # noqa: E402
from sgl_dspark.kernels.linear.reference import (  # noqa: E402
    small_m_grouped_linear_ref,
    small_m_linear_ref,
)

from benchmark.kernels.bench_quant_gemm import (  # noqa: E402
    SETUP,
    _copies,
    _generator,
    _reps,
    quantize_random,
    time_us,
)
from benchmark.kernels.graph_timing import max_rel_err  # noqa: E402

# (name, N, K, groups) of a V4.1-Flash layer's FP8 projections at decode
SHAPES = (
    ("x_proj 1792x5120", 1792, 5120, 1),
    ("q_b 32768x1280", 32768, 1280, 1),
    ("o_a 8x1024x4096 grouped", 1024, 4096, 8),
    ("o_b 5120x8192", 5120, 8192, 1),
)
GROUP = 32
# (label, row blocks a program above 16 rows (None: the library's `_ROW_BLOCKS_ABOVE_TILE`),
# overrides of the launch shape the library then chooses).
VARIANTS: tuple[tuple[str, int | None, dict[str, int]], ...] = (
    ("library", None, {}),
    ("one block a program", 1, {}),  # the library's shape for one block (narrow FP8: 4 stages)
    ("two blocks, 4 stages", 2, {"num_stages": 4}),
    ("two blocks, 2 stages", 2, {"num_stages": 2}),
    ("two blocks, 8 warps", 2, {"num_warps": 8}),
)


@contextlib.contextmanager
def launch_shape(row_blocks: int | None, overrides: dict[str, int]) -> Iterator[None]:
    """Inside the block, `_quantized_meta` chooses its shape for `row_blocks` blocks a program
    above 16 rows (None: the library's number) and `overrides` replace parts of it."""
    blocks = quantized._ROW_BLOCKS_ABOVE_TILE if row_blocks is None else row_blocks
    default = quantized._quantized_meta
    with (
        mock.patch.object(quantized, "_ROW_BLOCKS_ABOVE_TILE", blocks),
        mock.patch.object(
            quantized, "_quantized_meta", lambda *a, **kw: {**default(*a, **kw), **overrides}
        ),
    ):
        yield


def _device_name() -> str:
    return torch.cuda.get_device_name() if SETUP.device == "cuda" else SETUP.device


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="16,32,64")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lines = [
        f"device: {_device_name()}  torch {torch.__version__}",
        "",
        "| shape | M | variant | bits as one block a program | max rel err | us per call "
        "| vs library |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, n, k, groups in SHAPES:
        gen = _generator(n + k)
        w0 = quantize_random((groups * n, k), "fp8", GROUP, gen)
        weights = [w0] + [
            quantize_random((groups * n, k), "fp8", GROUP, gen)
            for _ in range(_copies(w0.nbytes) - 1)
        ]
        linear = quantized.quantized_linear if groups == 1 else quantized.quantized_grouped_linear
        reference = small_m_linear_ref if groups == 1 else small_m_grouped_linear_ref
        for m in (int(v) for v in a.m.split(",")):
            shape = (m, k) if groups == 1 else (m, groups, k)
            x = torch.randn(shape, generator=gen, device=SETUP.device).to(torch.bfloat16)
            want = reference(x.float(), w0)
            with launch_shape(1, {}):
                one_block = linear(x, w0)
            library = None
            for label, row_blocks, overrides in VARIANTS:
                with launch_shape(row_blocks, overrides):
                    got = linear(x, w0)
                    same = torch.equal(got, one_block)
                    err = max_rel_err(got, want)
                    calls = [lambda w=w, x=x, f=linear: f(x, w) for w in weights]
                    us = time_us(calls, _reps(len(weights)))
                library = us if library is None else library
                lines.append(
                    f"| {name} | {m} | {label} | {'yes' if same else 'NO'} | {err:.1e} "
                    f"| {us:.2f} | {library / us:.2f} |"
                )
                print(lines[-1], flush=True)
        del weights
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
