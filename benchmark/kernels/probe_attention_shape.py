"""Probe: the launch shape of DeepSeek-V4.1's decode attention at the rank model's batch sizes.

    python benchmark/kernels/probe_attention_shape.py [--m 1,8,32] [--out FILE]

What a V4.1 layer runs after its keys' decode launch (`TritonAttentionBackend.attend_gathered`,
called as the engine calls it: `window_sparse_attention` with no window over the keys gathered
per token): 64 query heads of 512 channels over a token's 640 keys (the window's 128, then 512
latents of its top-k; a few masked), sinks, the inverse rope epilogue, for M tokens of M
requests. The library's launch shape (`window_sparse._attention_meta`: heads a program, keys a
tile, warps; the split of the key range chosen from the grid) against other shapes, each
checked against the reference (`sink_attention_ref`, then `rope_tail_ref`'s inverse rotation),
then timed from a CUDA graph over 40 input sets (one a layer, so the keys come from DRAM as in
a decode step).

At Dh 512 the library's program holds 16 heads with 4 warps (two programs an SM), so four
programs read each token's keys; more heads a program read them fewer times but hold a larger
accumulator, more warps leave one program an SM.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from sgl_dspark.kernels.attention import window_sparse  # noqa: E402
from sgl_dspark.kernels.attention.reference import sink_attention_ref  # noqa: E402
from sgl_dspark.kernels.rope.reference import rope_tail_ref  # noqa: E402
from sgl_dspark.srt.layers.attention import create_attention_backend  # noqa: E402
from sgl_dspark.srt.layers.attention.base import BaseAttentionBackend  # noqa: E402

from benchmark.kernels.graph_timing import graph_time_us, max_rel_err  # noqa: E402

HEADS, HEAD_DIM, WINDOW, TOPK, ROPE_DIM = 64, 512, 128, 512, 64
LAYERS = 40
# (heads a program, keys a tile, warps); None: the library's.
SHAPES: tuple[tuple[int, int, int] | None, ...] = (
    None,
    (16, 16, 8),
    (32, 16, 8),
    (16, 32, 8),
    (16, 64, 8),
    (32, 16, 16),
    (64, 16, 16),
)


def launch_shape(shape: tuple[int, int, int] | None) -> contextlib.AbstractContextManager:
    """The attention's launch shape overridden (None: the library's) inside the block."""
    if shape is None:
        return contextlib.nullcontext()
    return mock.patch.object(window_sparse, "_attention_meta", lambda heads, d_pow2: shape)


def layer_inputs(m: int, device: str, seed: int, heads: int = HEADS, head_dim: int = HEAD_DIM):
    """One layer's inputs for m tokens: q [m, H, Dh], gathered keys [m, K, Dh] with their
    validity (a few masked), sinks, the inverse rope's cos / sin."""
    g = torch.Generator().manual_seed(seed)
    keys_n = WINDOW + TOPK
    q = torch.randn(m, heads, head_dim, generator=g).to(torch.bfloat16)
    keys = torch.randn(m, keys_n, head_dim, generator=g).to(torch.bfloat16)
    valid = torch.rand(m, keys_n, generator=g) < 0.95
    valid[:, 0] = True
    angle = torch.rand(m, ROPE_DIM // 2, generator=g) * 6.0
    sinks = torch.randn(heads, generator=g)
    on = {"device": device}
    return {
        "q": q.to(**on),
        "keys": keys.to(**on),
        "valid": valid.to(**on),
        "sinks": sinks.to(**on),
        "cos": angle.cos().to(**on),
        "sin": angle.sin().to(**on),
    }


def attend(x: dict, backend: BaseAttentionBackend) -> torch.Tensor:
    """The engine's call: the triton backend's attention over keys gathered per token (one
    backend for every call, as a forward's layers share one: its row indices are built by the
    first call, outside a graph's capture)."""
    d = x["keys"].shape[2]
    return backend.attend_gathered(
        x["q"], x["keys"], x["valid"], x["sinks"], d**-0.5, inverse_rope=(x["cos"], x["sin"])
    )


def reference(x: dict) -> torch.Tensor:
    d = x["keys"].shape[2]
    out = sink_attention_ref(x["q"], x["keys"], x["valid"], x["sinks"], d**-0.5)
    return rope_tail_ref(out, x["cos"], x["sin"], inverse=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,8,32")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lines = [
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}",
        "",
        "| M | heads a program, keys a tile, warps | max rel err | us per call | vs library |",
        "|---|---|---|---|---|",
    ]
    backend = create_attention_backend("triton")
    for m in (int(v) for v in a.m.split(",")):
        layers = [layer_inputs(m, "cuda", seed=i) for i in range(LAYERS)]
        want = reference(layers[0])
        library = None
        for shape in SHAPES:
            with launch_shape(shape):
                err = max_rel_err(attend(layers[0], backend), want)
                us = graph_time_us([lambda x=x: attend(x, backend) for x in layers], reps=4)
            library = us if shape is None else library
            tag = "library" if shape is None else ", ".join(map(str, shape))
            lines.append(f"| {m} | {tag} | {err:.1e} | {us:.2f} | {library / us:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
