"""FP8 activations on a GPU: numerics and speed of the W8A8 GEMMs at DeepSeek-V4-Flash shapes.

    python benchmark/kernels/bench_fp8_gemm.py --out $OUT/fp8_gemm.md      (about a minute)
    TRITON_INTERPRET=1 python benchmark/kernels/bench_fp8_gemm.py --smoke  (CPU: small checks)

Checks first (exit status 1 if one fails), on random activations and random FP8 weights (E8M0
scales per 128 x 128 block, and per 32 x 32 as V4.1 stores them):
  * the quantiser (`quantize_act_fp8`) equals `quantize_act_fp8_ref` bit for bit;
  * `w8a8_linear` / `w8a8_split_k_linear` against the reference with the same activation
    quantisation (`w8a8_linear_ref`, exact chunk sums): max relative error and the fraction of
    bf16 outputs that differ (one-ulp flips of the fp32 sum order);
  * against dequantise-then-bf16 on the unquantised activation: every output within
    `w8a8_bf16_gap_bound_ref` (plus the outputs' rounding);
  * the MX MoE (`mx_fused_moe`) against `mx_fused_moe_ref` (on sm90 `tl.dot_scaled` is emulated
    by Triton: a layout check, not a speed one).
Then times, under a CUDA graph of back-to-back calls (best of 5 replays): prefill-sized GEMMs
(M = 512 and 4096) as W8A8 (with and without its quantiser launch) against cuBLAS bf16 on the
same weights dequantised once, and against the library's path for such M without FP8
activations (the one-pass Triton dequantisation per call, `linear/dequantize.py`, then cuBLAS);
the DSpark main projection (3 x 4096 -> 4096) at M = 1..128 as split-K W8A8 (its quantiser
launch, the split GEMM and the ordered reduce) against the W8A16 kernel and cuBLAS bf16.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sgl_dspark.kernels.fp8.act_quant import quantize_act_fp8  # noqa: E402
from sgl_dspark.kernels.fp8.mx_moe import mx_fused_moe  # noqa: E402
from sgl_dspark.kernels.fp8.reference import (  # noqa: E402
    Fp8ActFormat,
    mx_fused_moe_ref,
    quantize_act_fp8_ref,
    w8a8_bf16_gap_bound_ref,
    w8a8_linear_ref,
)
from sgl_dspark.kernels.fp8.w8a8 import split_k_splits, w8a8_linear, w8a8_split_k_linear  # noqa: E402
from sgl_dspark.kernels.linear.dequantize import dequantize_weight  # noqa: E402
from sgl_dspark.kernels.linear.quantized import quantized_linear  # noqa: E402
from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref  # noqa: E402
from sgl_dspark.kernels.moe.sort import MoeSortPlan, moe_sort, prepare_moe_sort  # noqa: E402

from benchmark.kernels.graph_timing import graph_time_us, max_rel_err  # noqa: E402

DEVICE = "cuda"
# (name, N, K)
PREFILL = [
    ("q_b 32768x1024", 32768, 1024),
    ("o_b 4096x8192", 4096, 8192),
    ("gate_up 4096x4096", 4096, 4096),
]
MAIN_PROJ = ("main_proj 4096x12288", 4096, 12288)


def fp8_weight(n: int, k: int, block: int, gen: torch.Generator) -> QuantizedWeight:
    """Random E4M3 codes (never NaN) with E8M0 scales near 2^-13 per block x block block."""
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scale = torch.randint(113, 116, (-(-n // block), -(-k // block)), generator=gen)
    return QuantizedWeight(
        codes.view(torch.float8_e4m3fn).to(DEVICE),
        scale.to(torch.uint8).to(DEVICE),
        "fp8",
        block,
        block,
    )


def time_us(call: Callable[[], object]) -> float:
    """Microseconds per call, 20 back-to-back calls a graph."""
    return graph_time_us([call], reps=20)


def check_w8a8(m: int, n: int, k: int, block: int, group: int, gen: torch.Generator) -> list[str]:
    """Numerics of one shape; returns failure messages."""
    w = fp8_weight(n, k, block, gen)
    x = (
        (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 4, (m, k), generator=gen)))
        .to(torch.bfloat16)
        .to(DEVICE)
    )
    fails = []
    act = quantize_act_fp8(x, group, True)
    ref_act = quantize_act_fp8_ref(x, group, True)
    if not (
        torch.equal(act.q.view(torch.uint8), ref_act.q.view(torch.uint8))
        and torch.equal(act.scale, ref_act.scale)
    ):
        fails.append(f"quantiser M={m} K={k} group={group}: not the reference's bits")
    got = w8a8_linear(act, w, group)
    want = w8a8_linear_ref(act, w, group, torch.bfloat16)
    rel = max_rel_err(got, want)
    flips = float((got != want).float().mean())
    print(
        f"w8a8 M={m} N={n} K={k} block={block} group={group}: rel err {rel:.2e}, flips {flips:.4f}"
    )
    # Gated as `not <=` so that a NaN fails. Flips: the FP8 MMA sums a chunk in its own order
    # (reported, not gated).
    if not rel <= 2**-7:
        fails.append(f"w8a8 M={m} N={n} K={k}: rel {rel:.2e} flips {flips:.4f}")
    dense = x.float() @ dequantize_weight_ref(w, torch.float32).t()
    gap = w8a8_bf16_gap_bound_ref(x, act, w, group)
    slack = gap + (dense.abs() + got.float().abs()) * 2.0**-8
    if not ((got.float() - dense).abs() <= slack).all():
        fails.append(f"w8a8 M={m} N={n} K={k}: outside the bf16 gap bound")
    if group <= block and m <= 128:
        fmt = Fp8ActFormat(group, True)
        split = w8a8_split_k_linear(x, w, fmt)
        rel = max_rel_err(split, want)
        print(f"split-K M={m} S={split_k_splits(m, n, k)}: rel err vs unsplit reference {rel:.2e}")
        if not rel <= 2**-7:
            fails.append(f"split-K M={m}: rel {rel:.2e}")
    return fails


class MxMoeCase(NamedTuple):
    """The MX MoE check's inputs, every tensor on one device."""

    x: torch.Tensor
    gate_up: QuantizedWeight
    down: QuantizedWeight
    ids: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    plan: MoeSortPlan


def mx_moe_case(gen: torch.Generator, device: str | torch.device, small: bool) -> MxMoeCase:
    """Random MXFP4 experts and routes on `device`. The sort plan is built as the engine builds
    it (`srt/layers/moe/experts.py`): from the mask on the host, with no device read, then its
    table moved to the routes' device, where `moe_sort` requires it."""
    from sgl_dspark.srt.model_loader.quantization import mxfp4_to_runtime, quantize_mxfp4

    e, d, inter, m, topk = (4, 96, 64, 9, 2) if small else (8, 512, 256, 40, 4)

    def mx(shape):
        q = mxfp4_to_runtime(*quantize_mxfp4(torch.randn(*shape, generator=gen) * 0.05, 32), 32)
        return q._replace(data=q.data.to(device), scale=q.scale.to(device))

    gate_up, down = mx((e, 2 * inter, d)), mx((e, d, inter))
    x = torch.randn(m, d, generator=gen).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(m)]).int().to(device)
    weights = torch.rand(m, topk, generator=gen).to(device)
    host_mask = torch.ones(e, dtype=torch.int32)
    plan = prepare_moe_sort(host_mask)
    plan = plan._replace(local_table=plan.local_table.to(device))
    return MxMoeCase(x, gate_up, down, ids, weights, host_mask.to(device), plan)


def check_mx(gen: torch.Generator) -> list[str]:
    case = mx_moe_case(gen, DEVICE, small=DEVICE != "cuda")
    topk = case.ids.shape[1]
    sort = moe_sort(case.ids, case.weights, case.plan, 0, block_size=32)
    got = mx_fused_moe(case.x, case.gate_up, case.down, sort, topk, 10.0)
    want = mx_fused_moe_ref(case.x, case.gate_up, case.down, case.ids, case.mask, 10.0)
    rel = max_rel_err(got, want)
    print(f"mx_fused_moe (tl.dot_scaled on this device): rel err {rel:.2e}")
    return [] if rel <= 2**-5 else [f"mx_fused_moe: rel {rel:.2e}"]


def _dequantise_then_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return F.linear(x, dequantize_weight(w, x.dtype))


def _quantise_then_w8a8(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return w8a8_linear(quantize_act_fp8(x, 128, True), w, 128)


def bench(gen: torch.Generator) -> list[str]:
    rows = ["| shape | M | variant | us | TFLOP/s |", "|---|---|---|---|---|"]

    def row(name: str, m: int, variant: str, us: float, n: int, k: int) -> None:
        rows.append(f"| {name} | {m} | {variant} | {us:.1f} | {2 * m * n * k / us / 1e6:.0f} |")

    for name, n, k in PREFILL:
        w = fp8_weight(n, k, 128, gen)
        dense = dequantize_weight_ref(w, torch.bfloat16)
        for m in (512, 4096):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
            act = quantize_act_fp8(x, 128, True)
            row(
                name,
                m,
                "cuBLAS bf16 (weights dequantised once)",
                time_us(partial(F.linear, x, dense)),
                n,
                k,
            )
            row(
                name,
                m,
                "dequantise per call (Triton) + cuBLAS",
                time_us(partial(_dequantise_then_linear, x, w)),
                n,
                k,
            )
            row(name, m, "W8A8 GEMM", time_us(partial(w8a8_linear, act, w, 128)), n, k)
            row(
                name,
                m,
                "W8A8 quantise + GEMM",
                time_us(partial(_quantise_then_w8a8, x, w)),
                n,
                k,
            )
    name, n, k = MAIN_PROJ
    w = fp8_weight(n, k, 128, gen)
    dense = dequantize_weight_ref(w, torch.bfloat16)
    fmt = Fp8ActFormat(128, True)
    for m in (1, 8, 32, 128):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
        row(name, m, "cuBLAS bf16", time_us(partial(F.linear, x, dense)), n, k)
        if m <= 16:
            row(name, m, "W8A16 quantized_linear", time_us(partial(quantized_linear, x, w)), n, k)
        label = f"split-K W8A8 (S={split_k_splits(m, n, k)}, quantise + split GEMM + reduce)"
        row(name, m, label, time_us(partial(w8a8_split_k_linear, x, w, fmt)), n, k)
    return rows


CHECKS = [  # (M, N, K, weight block, activation group)
    (512, 4096, 4096, 128, 128),
    (300, 1000, 1100, 32, 32),
    (96, 640, 12288, 128, 128),
    (8, 4096, 12288, 128, 128),
]
SMOKE_CHECKS = [(70, 130, 300, 128, 128), (20, 64, 200, 32, 32)]


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="markdown file for the timings")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="small checks on the CPU, no timing")
    args = parser.parse_args(argv)
    if args.smoke:
        DEVICE = "cpu"
    gen = torch.Generator().manual_seed(0)
    fails = []
    for m, n, k, block, group in SMOKE_CHECKS if args.smoke else CHECKS:
        fails += check_w8a8(m, n, k, block, group, gen)
    fails += check_mx(gen)
    print("\n".join(["numerics: ok"] if not fails else ["FAILED:", *fails]))
    if not (args.skip_timing or args.smoke):
        table = "\n".join(bench(gen))
        print(table)
        if args.out:
            Path(args.out).write_text(f"# FP8 GEMMs on {torch.cuda.get_device_name()}\n\n{table}\n")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
