"""Probe: the decode attention's split of the key range at the rank model's shapes.

    python benchmark/kernels/probe_attention_splits.py [--m 1,4] [--out FILE]

`window_sparse_attention` at DeepSeek-V4.1-Flash's decode shapes on one GPU (64 query heads of
512 channels over one latent head, window 128, 512 entries selected by the indexer, sinks, the
inverse rope epilogue) for M query rows of one request (1: a plain step; 4: a DSpark verify of
width 4), the window cache in bf16 and FP8: the library's split of the key range
(`num_splits=None`) against forced splits, each checked against the reference, then timed from a
CUDA graph over 40 input sets (one a layer, so the keys come from DRAM as in a decode step,
not from L2). Splits past the last key tile are allowed (they contribute nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from sgl_dspark.kernels.attention.reference import window_sparse_attention_ref  # noqa: E402
from sgl_dspark.kernels.attention.window_sparse import window_sparse_attention  # noqa: E402

from benchmark.kernels.graph_timing import graph_time_us, max_rel_err  # noqa: E402

HEADS, HEAD_DIM, WINDOW, NUM_EXTRA, PAGE, ROPE_DIM = 64, 512, 128, 512, 64, 64
LAYERS = 40
SPLITS = (None, 1, 2, 4, 5, 8, 10, 20, 40)


def _inputs(m: int, window_dtype: torch.dtype, seed: int) -> dict:
    """One layer's decode attention inputs: M consecutive positions of one request with a 4k
    context in pages drawn at random from the pool."""
    gen = torch.Generator().manual_seed(seed)
    ctx = 4096
    pages = ctx // PAGE + 1
    rows = torch.randperm(pages, generator=gen)[: ctx // PAGE, None] * PAGE + torch.arange(PAGE)
    table = torch.zeros(2, ctx, dtype=torch.int64)
    table[1] = rows.reshape(-1)
    positions = torch.arange(ctx - m, ctx)
    entry_rows = ctx // 2  # the ratio-2 pool
    angles = torch.rand(m, ROPE_DIM // 2, generator=gen) * 7
    cpu = dict(
        q=torch.randn(m, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16),
        window_kv=torch.randn(pages * PAGE, HEAD_DIM, generator=gen).to(window_dtype),
        positions=positions,
        token_slot=torch.ones(m, dtype=torch.int64),
        req_to_token=table,
        sinks=torch.randn(HEADS, generator=gen),
        extra_kv=torch.randn(entry_rows, HEAD_DIM, generator=gen).to(torch.bfloat16),
        extra_slots=torch.randint(0, entry_rows, (m, NUM_EXTRA), generator=gen),
        extra_valid=torch.rand(m, NUM_EXTRA, generator=gen) < 0.95,
    )
    inputs = {k: v.cuda() for k, v in cpu.items()}
    rope = (angles.cos().cuda(), angles.sin().cuda())
    return {**inputs, "window": WINDOW, "scale": HEAD_DIM**-0.5, "inverse_rope": rope}


def _reference(inputs: dict) -> torch.Tensor:
    """The reference on the same inputs (an FP8 window cache converted to q's dtype: exact)."""
    return window_sparse_attention_ref(
        **{**inputs, "window_kv": inputs["window_kv"].to(inputs["q"].dtype)}
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,4")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lines = [
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}",
        "",
        "| M | window cache | splits | max rel err | us per call | vs library |",
        "|---|---|---|---|---|---|",
    ]
    for m in (int(v) for v in a.m.split(",")):
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            layers = [_inputs(m, dtype, 1000 * m + i) for i in range(LAYERS)]
            want = _reference(layers[0])
            library = None
            for splits in SPLITS:
                calls = [
                    lambda x=x, s=splits: window_sparse_attention(**x, num_splits=s) for x in layers
                ]
                err = max_rel_err(calls[0](), want)
                us = graph_time_us(calls, reps=4)
                library = us if splits is None else library
                tag = "library" if splits is None else str(splits)
                name = "fp8" if dtype == torch.float8_e4m3fn else "bf16"
                lines.append(
                    f"| {m} | {name} | {tag} | {err:.1e} | {us:.2f} | {library / us:.2f} |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
