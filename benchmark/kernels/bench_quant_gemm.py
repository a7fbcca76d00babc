"""Weight-only quantised GEMMs at DeepSeek-V4-Flash decode shapes (M = 1, 4, 16): the bf16 Triton
kernel, cuBLAS bf16 (`F.linear`), W8A16 (FP8 E4M3, E8M0 scales per 128 x 128 block, and per
32 x 32 as V4.1 stores them) and W4A16 (MXFP4, one E8M0 scale per 32 channels), against the byte
floor (weight + activation + output bytes over the measured copy bandwidth).

    python benchmark/kernels/bench_quant_gemm.py --out $OUT/quant_gemm.md

Dense projections run `small_m_linear` / `quantized_linear` (`quantized_grouped_linear` for the
grouped output projection); the MoE rows run the engine's dispatch for one EP4 rank's 96 experts,
top-6 routes: the per-route / per-token kernels up to 4 tokens, `moe_sort` + `fused_moe` above
(the grouped rows time the sorted path at every M). Timing: a CUDA graph of back-to-back calls
cycling over enough weight copies that the working set exceeds the L2 cache, best of 5 replays.
Every quantised result is checked against the dequantise-then-reference product first.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sgl_dspark.kernels.linear.quantized import (  # noqa: E402
    quantized_grouped_linear,
    quantized_linear,
)
from sgl_dspark.kernels.linear.reference import (  # noqa: E402
    QuantizedWeight,
    dequantize_weight_ref,
)
from sgl_dspark.kernels.linear.small_m import small_m_grouped_linear, small_m_linear  # noqa: E402
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe  # noqa: E402
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort  # noqa: E402
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up, moe_token_down_reduce  # noqa: E402

DEVICE = "cuda"
WORKING_SET = 512 * 2**20  # bytes of bf16 weight copies cycled through per graph
# (name, N, K, groups): groups > 1 is the grouped output projection (G x N rows over G x K).
DENSE = [
    ("q_b 32768x1024", 32768, 1024, 1),
    ("wide 32768x4096", 32768, 4096, 1),
    ("o_b 4096x8192", 4096, 8192, 1),
    ("o_a 8x1024x4096 grouped", 1024, 4096, 8),
    ("q_a 1024x4096", 1024, 4096, 1),
    ("shared gate_up 4096x4096", 4096, 4096, 1),
    ("shared down 4096x2048", 4096, 2048, 1),
]
FORMATS = (("fp8", 128), ("fp8", 32), ("mxfp4", 32))
EXPERTS, TOPK, HIDDEN, INTER, LIMIT = 96, 6, 4096, 2048, 10.0


def quantize_random(shape: tuple[int, ...], fmt: str, group: int, gen: torch.Generator):
    """Random codes (every E2M1 code; every E4M3 code but NaN) with scales near RMS 0.02, in
    the runtime layout: FP8 with group x group blocks, MXFP4 with per-row groups."""
    *lead, n, k = shape
    if fmt == "mxfp4":
        data = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8)
        rows, byte = 1, 127 - 7
    else:
        codes = torch.randint(0, 256, (*lead, n, k), generator=gen, dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
        data = codes.view(torch.float8_e4m3fn)
        rows, byte = group, 127 - 13
    scale = torch.randint(byte - 1, byte + 2, (*lead, -(-n // rows), -(-k // group)), generator=gen)
    return QuantizedWeight(data.to(DEVICE), scale.to(torch.uint8).to(DEVICE), fmt, group, rows)


def time_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Microseconds per call: a CUDA graph of `reps` rounds over `calls`, best of 5 replays
    (`--smoke` on a CPU: one call each, no timing)."""
    if DEVICE == "cpu":
        for c in calls:
            c()
        return 1.0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    return best


def copy_bandwidth() -> float:
    if DEVICE == "cpu":
        return 1e12
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    us = time_us([lambda: y.copy_(x)], 10)
    return 2 * x.numel() / (us * 1e-6)


def _copies(bf16_bytes: int) -> int:
    return max(1, min(64, -(-WORKING_SET // bf16_bytes)))


def _max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def bench_dense(m: int, name: str, n: int, k: int, groups: int, bw: float) -> list[dict]:
    gen = torch.Generator().manual_seed(n + k + m)
    rows = n * groups
    copies = _copies(2 * rows * k)
    reps = max(2, 64 // copies)
    if groups == 1:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
        act_bytes = 2 * (m * k + m * n)
    else:
        x = torch.randn(m, groups, k, generator=gen).to(torch.bfloat16).to(DEVICE)
        act_bytes = 2 * groups * (m * k + m * n)
    out = []

    def row(variant: str, us: float, weight_bytes: int, err: float) -> None:
        floor = (weight_bytes + act_bytes) / bw * 1e6
        out.append(dict(shape=name, m=m, variant=variant, us=us, floor_us=floor, err=err, tbps=0.0))
        out[-1]["tbps"] = (weight_bytes + act_bytes) / (us * 1e-6) / 1e12

    dense_w = [
        (torch.randn(rows, k, generator=gen) * k**-0.5).to(torch.bfloat16).to(DEVICE)
        for _ in range(copies)
    ]
    if groups == 1:
        want = F.linear(x, dense_w[0])
        got = small_m_linear(x, dense_w[0])
        row(
            "bf16 triton",
            time_us([lambda w=w: small_m_linear(x, w) for w in dense_w], reps),
            2 * rows * k,
            _max_rel_err(got, want),
        )
        row(
            "bf16 cuBLAS",
            time_us([lambda w=w: F.linear(x, w) for w in dense_w], reps),
            2 * rows * k,
            0.0,
        )
    else:
        grouped = [w.view(groups, n, k) for w in dense_w]
        want = torch.einsum("mgk,gnk->mgn", x.float(), grouped[0].float())
        got = small_m_grouped_linear(x, grouped[0])
        calls = [lambda w=w: small_m_grouped_linear(x, w) for w in grouped]
        row("bf16 triton", time_us(calls, reps), 2 * rows * k, _max_rel_err(got, want))
    del dense_w
    for fmt, group in FORMATS:
        qws = [quantize_random((rows, k), fmt, group, gen) for _ in range(copies)]
        ref = dequantize_weight_ref(qws[0], torch.float32)
        if groups == 1:
            want = x.float() @ ref.T
            got = quantized_linear(x, qws[0])
            calls = [lambda w=w: quantized_linear(x, w) for w in qws]
        else:
            want = torch.einsum("mgk,gnk->mgn", x.float(), ref.view(groups, n, k))
            got = quantized_grouped_linear(x, qws[0])
            calls = [lambda w=w: quantized_grouped_linear(x, w) for w in qws]
        label = f"W{'4' if fmt == 'mxfp4' else '8'}A16 {fmt} /{group}"
        row(label, time_us(calls, reps), qws[0].nbytes, _max_rel_err(got, want))
        del qws
    return out


def bench_moe(m: int, bw: float) -> list[dict]:
    gen = torch.Generator().manual_seed(7 + m)
    x = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).to(DEVICE)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(m)])
    ids = ids.to(torch.int32).to(DEVICE)
    weights = torch.rand(m, TOPK, generator=gen).to(DEVICE)
    plan = prepare_moe_sort(torch.ones(EXPERTS, dtype=torch.int32, device=DEVICE))
    distinct = int(ids.unique().numel())
    act_bytes = 2 * (m * HIDDEN * 2 + m * TOPK * INTER)
    out = []

    def run_token(w13, w2):
        h = moe_route_gate_up(x, w13, ids, plan.local_table, plan.num_local, LIMIT)
        return moe_token_down_reduce(h, w2, ids, weights, plan.local_table, plan.num_local)

    def run_grouped(w13, w2):
        routes = moe_sort(ids, weights, plan, 0, block_size=32)
        return fused_moe(x, w13, w2, routes, TOPK, LIMIT, block_size=32)

    variants: list[tuple[str, object, object, int]] = []
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.02).to(torch.bfloat16)
    per_expert = 2 * 3 * INTER * HIDDEN
    variants.append(("bf16 triton", w13.to(DEVICE), w2.to(DEVICE), per_expert))
    del w13, w2
    for fmt, group in (("fp8", 128), ("mxfp4", 32)):
        q13 = quantize_random((EXPERTS, 2 * INTER, HIDDEN), fmt, group, gen)
        q2 = quantize_random((EXPERTS, HIDDEN, INTER), fmt, group, gen)
        label = f"W{'4' if fmt == 'mxfp4' else '8'}A16 {fmt} /{group}"
        variants.append((label, q13, q2, (q13.nbytes + q2.nbytes) // EXPERTS))
    for label, w13, w2, expert_bytes in variants:
        weight_bytes = distinct * expert_bytes
        floor = (weight_bytes + act_bytes) / bw * 1e6
        paths = [("grouped", run_grouped)] + ([("token", run_token)] if m <= 4 else [])
        for path, fn in paths:
            us = time_us([lambda fn=fn, a=w13, b=w2: fn(a, b)], 16)
            out.append(
                dict(
                    shape=f"MoE {path} {EXPERTS}x(2x{INTER}+{INTER})x{HIDDEN} top-{TOPK}",
                    m=m,
                    variant=label,
                    us=us,
                    floor_us=floor,
                    err=float("nan"),
                    tbps=(weight_bytes + act_bytes) / (us * 1e-6) / 1e12,
                )
            )
    del variants
    torch.cuda.empty_cache()
    return out


# Launch shapes `--sweep` tries for the quantised linear: (BLOCK_N, weight bytes per row per K
# step, num_stages, num_warps); the first row of each group is the library's own choice.
SWEEP = [
    (16, 256, 6, 4),
    (16, 512, 4, 4),
    (16, 1024, 3, 4),
    (32, 512, 4, 4),
    (32, 1024, 3, 4),
    (64, 512, 3, 4),
    (32, 512, 4, 8),
    (64, 1024, 2, 8),
]


def sweep_linear(m_values: list[int], name: str, n: int, k: int, bw: float) -> list[dict]:
    """The quantised linear at each `SWEEP` launch shape, its result compared with the default
    launch's (the error column: another K step sums the scale groups in another order)."""
    import sgl_dspark.kernels.linear.quantized as quantized

    default_meta = quantized._quantized_meta
    gen = torch.Generator().manual_seed(n + k)
    out = []
    for fmt, group in FORMATS:
        qws = [quantize_random((n, k), fmt, group, gen) for _ in range(_copies(2 * n * k))]
        reps = max(2, 64 // len(qws))
        for m in m_values:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
            want = quantized_linear(x, qws[0])
            label = f"W{'4' if fmt == 'mxfp4' else '8'}A16 {fmt} /{group}"
            chosen = default_meta(fmt, group, n, k)
            shapes = [None] + SWEEP
            for shape in shapes:
                if shape is None:
                    meta, tag = chosen, "default"
                else:
                    bn, row_bytes, stages, warps = shape
                    block_k = row_bytes * (2 if fmt == "mxfp4" else 1)
                    if block_k > triton_next_pow2(k) or block_k < group and group % block_k:
                        continue
                    meta = dict(BLOCK_N=bn, BLOCK_K=block_k, num_stages=stages, num_warps=warps)
                    tag = f"BN{bn} BK{block_k} s{stages} w{warps}"
                quantized._quantized_meta = lambda *args, meta=meta: dict(meta)
                try:
                    got = quantized_linear(x, qws[0])
                    err = _max_rel_err(got, want)
                    us = time_us([lambda w=w, x=x: quantized_linear(x, w) for w in qws], reps)
                except Exception as exc:  # noqa: BLE001 - a shape the target cannot run
                    print(f"{name} {label} {tag}: {type(exc).__name__}: {exc}"[:300])
                    continue
                finally:
                    quantized._quantized_meta = default_meta
                moved = qws[0].nbytes + 2 * (m * k + m * n)
                out.append(
                    dict(
                        shape=name,
                        m=m,
                        variant=f"{label} {tag}",
                        us=us,
                        floor_us=moved / bw * 1e6,
                        err=err,
                        tbps=moved / (us * 1e-6) / 1e12,
                    )
                )
        del qws
    return out


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def render(rows: list[dict], bw: float) -> str:
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    lines = [
        f"{device}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s (the floor's)",
        "",
        "| shape | M | variant | us | floor us | x floor | TB/s | x bf16 triton | max rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["shape"], r["m"]): r["us"] for r in rows if r["variant"] == "bf16 triton"}
    for r in rows:
        ref = base.get((r["shape"], r["m"]))
        speedup = f"{ref / r['us']:.2f}" if ref else "-"
        err = "-" if r["err"] != r["err"] else f"{r['err']:.1e}"
        lines.append(
            f"| {r['shape']} | {r['m']} | {r['variant']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
            f"{r['us'] / r['floor_us']:.2f} | {r['tbps']:.2f} | {speedup} | {err} |"
        )
    return "\n".join(lines) + "\n"


def _shrink() -> None:
    global DEVICE, DENSE, EXPERTS, HIDDEN, INTER, WORKING_SET
    DEVICE, EXPERTS, HIDDEN, INTER, WORKING_SET = "cpu", 8, 256, 128, 1
    DENSE = [(name, max(n // 16, 32), max(k // 16, 64), g) for name, n, k, g in DENSE]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,4,16")
    p.add_argument("--only", default="", help="substring of the shapes to run")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--sweep",
        action="store_true",
        help="instead: the quantised linear's launch shapes (SWEEP) at the --only shapes",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the script (Triton interpreter): shapes / 16, 8 experts, no timing",
    )
    a = p.parse_args()
    if a.smoke:
        _shrink()
    bw = copy_bandwidth()
    rows: list[dict] = []

    def progress(new: list[dict]) -> None:
        rows.extend(new)
        print("\n".join(render(new, bw).splitlines()[4:]), flush=True)
        if a.out:  # rewritten after every shape, so a run cut short keeps what it measured
            Path(a.out).write_text(render(rows, bw))

    if a.sweep:
        for name, n, k, groups in DENSE:
            if a.only in name and groups == 1:
                progress(sweep_linear([int(v) for v in a.m.split(",")], name, n, k, bw))
        print(render(rows, bw))
        return
    for m in (int(v) for v in a.m.split(",")):
        for name, n, k, groups in DENSE:
            if a.only in name:
                progress(bench_dense(m, name, n, k, groups, bw))
        if not a.no_moe and a.only in "MoE":
            progress(bench_moe(m, bw))
    print(render(rows, bw))


if __name__ == "__main__":
    main()
