"""Check every kernel against its reference and time reference-eager, reference-torch.compile
and ours under CUDA graphs, at DeepSeek-V4-Flash decode shapes.

    python benchmark/kernels/run_all.py --out results.md

Timing: each callable is captured `--calls-per-graph` times into one CUDA graph; the graph is
replayed `--replays` times between CUDA events and the median replay time / calls is reported in
microseconds (launch gaps amortised, as in a captured decode step). Ours and compile are timed
twice each in ABBA order and averaged. A reference that cannot be
captured (host syncs) is timed eagerly with events and marked `*`. The bandwidth floor is the
case's minimal bytes over the measured device-to-device copy bandwidth (bytes read + written).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sgl_dspark.kernels._triton_utils import set_programmatic_launch  # noqa: E402

MODULES = (
    "benchmark.kernels.bench_spec",
    "benchmark.kernels.bench_moe",
    "benchmark.kernels.bench_mhc_indexer",
    "benchmark.kernels.bench_attention",
    "benchmark.kernels.bench_indexer",
    "benchmark.kernels.bench_norm",
    "benchmark.kernels.bench_engram",
    "benchmark.kernels.bench_index_topk",
    "benchmark.kernels.bench_markov",
    "benchmark.kernels.bench_linear",
    "benchmark.kernels.bench_floor",
)
M_VALUES = (1, 4, 8, 24, 32, 128)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * n / statistics.median(times)


def capture_calls(fn, calls: int) -> torch.cuda.CUDAGraph:
    """`calls` back-to-back calls of `fn` in one CUDA graph (after 3 warm-up calls and one on a
    side stream, which settle compilation and the allocator); raises if `fn` cannot be captured."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def time_graph(fn, calls: int, replays: int) -> tuple[float, bool]:
    """Median microseconds per call; second value False when graph capture failed."""
    try:
        run, graphed = capture_calls(fn, calls).replay, True
    except Exception:  # noqa: BLE001 - capture refuses host syncs; time eagerly then
        torch.cuda.synchronize()
        run, graphed = (lambda: [fn() for _ in range(calls)]), False
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times), graphed


def main() -> None:
    # A reference serves several cases and six M values: past dynamo's default of 8 shapes per
    # function, torch.compile silently falls back to eager (results before this line was added
    # compared against eager there).
    torch._dynamo.config.recompile_limit = 64
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="write the Markdown table here")
    p.add_argument("--calls-per-graph", type=int, default=20)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument(
        "--only",
        default=None,
        help="comma list of substrings; run the cases whose name contains one",
    )
    p.add_argument(
        "--pdl-ab",
        action="store_true",
        help="also time ours without programmatic dependent launch and torch.compile "
        "with Inductor's own PDL (triton.enable_pdl), in the same ABBA rounds",
    )
    p.add_argument("--m", default=None, help="comma list of M values (default: all of M_VALUES)")
    a = p.parse_args()
    m_values = tuple(int(m) for m in a.m.split(",")) if a.m else M_VALUES
    assert torch.cuda.is_available(), "run_all.py needs a GPU"
    bw = copy_bandwidth()
    lines = [
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"copy bandwidth {bw / 1e12:.2f} TB/s",
        "",
        "| kernel | M | check | eager us | compile us | ours us | floor us | "
        "ours/compile | ours/floor |" + (" ours no-PDL us | compile+PDL us |" if a.pdl_ab else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if a.pdl_ab else ""),
    ]
    t0 = time.time()
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001
            lines.append(f"| {mod_name} | - | import failed | | | | | | |")
            traceback.print_exc()
            continue
        for case in mod.CASES:
            if a.only and not any(k in case["name"] for k in a.only.split(",")):
                continue
            compiled = torch.compile(case["reference"], dynamic=False)
            compiled_pdl = (
                torch.compile(case["reference"], dynamic=False, options={"triton.enable_pdl": True})
                if a.pdl_ab
                else None
            )
            for m in m_values:
                row = [case["name"], str(m)]
                try:
                    # Two input sets (make_inputs is seeded by M): a case that writes into an
                    # input buffer (a KV pool, an index-key cache) is checked on its own copy.
                    inputs = case["make_inputs"](m, "cuda")
                    case["check"](
                        case["reference"](**case["make_inputs"](m, "cuda")),
                        case["launcher"](**inputs),
                    )
                    row.append("ok")
                    ref_fn, ours_fn = case["reference"], case["launcher"]
                    te, ge = time_graph(
                        lambda f=ref_fn, x=inputs: f(**x), a.calls_per_graph, a.replays
                    )

                    # ours and compile in ABBA order (ours, compile, compile, ours), each the
                    # mean of its two runs: a drift of the device clock over the case then
                    # weighs on both sides alike (the two are often within a few percent).
                    def ours_time(f=ours_fn, x=inputs) -> tuple[float, bool]:
                        return time_graph(lambda: f(**x), a.calls_per_graph, a.replays)

                    def compile_time(f=compiled, x=inputs) -> tuple[float, bool]:
                        try:
                            return time_graph(lambda: f(**x), a.calls_per_graph, a.replays)
                        except Exception:  # noqa: BLE001
                            return float("nan"), False

                    def no_pdl_time() -> tuple[float, bool]:
                        set_programmatic_launch(False)
                        try:
                            return ours_time()
                        finally:
                            set_programmatic_launch(True)

                    def compile_pdl_time(f=compiled_pdl, x=inputs) -> tuple[float, bool]:
                        return compile_time(f, x)

                    # --pdl-ab nests a second ABBA inside: ours, compile, no-PDL, compile+PDL,
                    # compile+PDL, no-PDL, compile, ours.
                    (to1, go), (tc1, gc) = ours_time(), compile_time()
                    extra1, extra2 = [], []
                    if a.pdl_ab:
                        tn1, tp1 = no_pdl_time()[0], compile_pdl_time()[0]
                        tp2, tn2 = compile_pdl_time()[0], no_pdl_time()[0]
                        extra1, extra2 = [tn1, tp1], [tn2, tp2]
                    (tc2, _), (to2, _) = compile_time(), ours_time()
                    to, tc = (to1 + to2) / 2, (tc1 + tc2) / 2
                    floor = case["bytes_moved"](m) / bw * 1e6
                    row += [
                        f"{te:.1f}{'' if ge else '*'}",
                        f"{tc:.1f}{'' if gc else '*'}",
                        f"{to:.1f}{'' if go else '*'}",
                        f"{floor:.2f}",
                        f"{to / tc:.2f}" if tc == tc else "n/a",
                        f"{to / floor:.1f}",
                    ]
                    row += [f"{(u + v) / 2:.2f}" for u, v in zip(extra1, extra2)]
                except Exception as e:  # noqa: BLE001
                    row += [f"FAIL {type(e).__name__}: {str(e)[:60]}"] + [""] * (
                        8 if a.pdl_ab else 6
                    )
                    traceback.print_exc()
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
                if a.out:  # written as it goes: a run cut short keeps its rows
                    Path(a.out).write_text("\n".join(lines) + "\n")
    lines.append("")
    lines.append(
        f"(`*` = not capturable in a CUDA graph, timed eagerly; total {time.time() - t0:.0f} s)"
    )
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
