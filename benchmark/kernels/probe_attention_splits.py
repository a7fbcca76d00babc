"""Probe: the decode attention's split of the key range at the rank model's shapes.

    python benchmark/kernels/probe_attention_splits.py [--m 1,4] [--out FILE]

`window_sparse_attention` at DeepSeek-V4.1-Flash's decode shapes on one GPU (64 query heads of
512 channels over one latent head, window 128, 512 entries selected by the indexer, sinks, the
inverse rope epilogue: `bench_attention.py`'s inputs at 64 heads) for M query rows of one request
(1: a plain step; 4: a DSpark verify of width 4), the window cache in bf16 and FP8: the library's
split of the key range (`num_splits=None`) against forced splits, each checked against the
reference, then timed from a CUDA graph over 40 input sets (one a layer, so the keys come from
DRAM as in a decode step, not from L2). Splits past the last key tile are allowed (they
contribute nothing).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from benchmark.kernels.bench_attention import (  # noqa: E402
    _attn_rope_epilogue,
    _attn_rope_ref,
    _rope_inputs,
)
from benchmark.kernels.graph_timing import graph_time_us, max_rel_err  # noqa: E402

HEADS = 64
LAYERS = 40
SPLITS = (None, 1, 2, 4, 5, 8, 10, 20, 40)


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
        for dtype, name in ((torch.float8_e4m3fn, "fp8"), (torch.bfloat16, "bf16")):
            layers = [
                _rope_inputs(m, "cuda", heads=HEADS, window_dtype=dtype, seed=i)
                for i in range(LAYERS)
            ]
            first = layers[0]
            # The reference on the same values (an FP8 window converted to q's dtype: exact).
            want = _attn_rope_ref(**{**first, "window_kv": first["window_kv"].to(torch.bfloat16)})
            library = None
            for splits in SPLITS:
                launch = functools.partial(_attn_rope_epilogue, num_splits=splits)
                calls = [functools.partial(launch, **x) for x in layers]
                err = max_rel_err(calls[0](), want)
                us = graph_time_us(calls, reps=4)
                library = us if splits is None else library
                tag = "library" if splits is None else str(splits)
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
