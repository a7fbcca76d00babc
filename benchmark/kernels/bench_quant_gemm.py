"""Weight-only quantised GEMMs at DeepSeek-V4-Flash decode shapes, in one device call: the bf16
Triton kernel, cuBLAS bf16 (`F.linear`), the previous W8A16 / W4A16 kernel
(`baseline_quant_linear.py`) and the library's (`quantized_linear`), for FP8 E4M3 with E8M0
scales per 128 x 128 block (V4) and per 32 x 32 (V4.1) and MXFP4 (one E8M0 scale per 32
channels), at M = 1, 4, 8, 16; then the routed experts of one EP4 rank (96 experts + the folded
shared expert, 6 routes + the shared one per token) in bf16, FP8 and MXFP4 through the engine's
two paths (sorted: `moe_sort` + `fused_moe` + `moe_reduce`; per token, up to 4 tokens:
`moe_route_gate_up` + `moe_token_down_reduce`). `--moe-unsplit` times the quantised experts a
second time with the expert products unsplit along K (`expert_split_k` forced to 1), the
comparison behind the library's split.

    python benchmark/kernels/bench_quant_gemm.py --out $OUT/quant_gemm.md  (stops at --budget-s)
    TRITON_INTERPRET=1 python benchmark/kernels/bench_quant_gemm.py --smoke     (CPU check)

Every kernel is compiled first by `--jobs` worker processes (one Triton compilation per process
at a time; a cold cache otherwise dominates the call), then timed: a CUDA graph of back-to-back
calls cycling over enough weight copies that the working set exceeds the L2 cache, best of 5
replays, programmatic launch as the engine uses it. Every result is checked against
dequantise-then-reference first (the max rel err column). The byte floor is the bytes a call
must move (weights with their scales, activations in, outputs) over `--peak-tbps` (the HBM
bandwidth of the target; 4.8 TB/s by default); the measured copy bandwidth is printed beside
it. The summary table gives each quantised kernel's speedup over the bf16 Triton kernel against
the goals (W8A16 >= 1.8x, W4A16 >= 2.5x).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
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
from sgl_dspark.kernels.moe import grouped_gemm, token_down, token_gemm  # noqa: E402
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe  # noqa: E402
from sgl_dspark.kernels.moe.reduce import moe_reduce  # noqa: E402
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort, sort_block_size  # noqa: E402
from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up  # noqa: E402

from benchmark.kernels.baseline_quant_linear import (  # noqa: E402
    baseline_quantized_grouped_linear,
    baseline_quantized_linear,
)
from benchmark.kernels.bench_floor import add_one  # noqa: E402
from benchmark.kernels.graph_timing import graph_time_us, max_rel_err  # noqa: E402


@dataclass
class Setup:
    """Shapes and sizes of a run (`--smoke` shrinks them for the CPU interpreter)."""

    device: str = "cuda"
    # (name, N, K, groups): groups > 1 is the grouped output projection (G x N rows over G x K).
    dense: tuple[tuple[str, int, int, int], ...] = (
        ("q_b 32768x1024", 32768, 1024, 1),
        ("wide 32768x4096", 32768, 4096, 1),
        ("o_b 4096x8192", 4096, 8192, 1),
        ("o_a 8x1024x4096 grouped", 1024, 4096, 8),
        ("q_a 1024x4096", 1024, 4096, 1),
        ("shared gate_up 4096x4096", 4096, 4096, 1),
        ("shared down 4096x2048", 4096, 2048, 1),
        # DeepSeek-V4.1-Flash (D 5120): a layer's joint x projection (q_a 1280 + kv 512) and o_b.
        ("v41 x_proj 1792x5120", 1792, 5120, 1),
        ("v41 o_b 5120x8192", 5120, 8192, 1),
    )
    experts: int = 96  # one EP4 rank's routed experts; the shared expert is folded as one more
    topk: int = 6
    hidden: int = 4096
    inter: int = 2048
    working_set: int = 256 * 2**20  # bytes of weight copies cycled through per timed variant
    max_copies: int = 64
    moe_unsplit: bool = False  # also time the quantised experts without the K split


SETUP = Setup()
FORMATS = (("fp8", 128), ("fp8", 32), ("mxfp4", 32))
MOE_FORMATS = (("fp8", 128), ("mxfp4", 32))
LIMIT = 10.0
GOALS = {"W8A16": 1.8, "W4A16": 2.5}


def _label(fmt: str, group: int) -> str:
    return f"W{'4' if fmt == 'mxfp4' else '8'}A16 {fmt} /{group}"


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=SETUP.device).manual_seed(seed)


def quantize_random(shape: tuple[int, ...], fmt: str, group: int, gen: torch.Generator):
    """Random codes (every E2M1 code; every E4M3 code but NaN) with scales near RMS 0.02, made on
    the device, in the runtime layout: FP8 with group x group blocks, MXFP4 per-row groups."""
    *lead, n, k = shape
    dev = SETUP.device
    if fmt == "mxfp4":
        data = torch.randint(
            0, 256, (*lead, n, k // 2), generator=gen, device=dev, dtype=torch.uint8
        )
        rows, byte = 1, 127 - 7
    else:
        codes = torch.randint(0, 256, (*lead, n, k), generator=gen, device=dev, dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
        data = codes.view(torch.float8_e4m3fn)
        rows, byte = group, 127 - 13
    scale_shape = (*lead, -(-n // rows), -(-k // group))
    scale = torch.randint(byte - 1, byte + 2, scale_shape, generator=gen, device=dev)
    return QuantizedWeight(data, scale.to(torch.uint8), fmt, group, rows)


def _bf16_random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, device=SETUP.device)
    return (x * shape[-1] ** -0.5).to(torch.bfloat16)


def _copies(nbytes: int) -> int:
    return max(1, min(SETUP.max_copies, -(-SETUP.working_set // max(nbytes, 1))))


def time_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Microseconds per call: a CUDA graph of `reps` rounds over `calls`, best of 5 replays
    (on a CPU: one call each, no timing)."""
    if SETUP.device == "cpu":
        for c in calls:
            c()
        return float("nan")
    return graph_time_us(calls, reps)


def _reps(copies: int) -> int:
    return max(2, 64 // copies)


@dataclass
class Row:
    shape: str
    m: int
    variant: str
    us: float
    moved: int  # bytes a call must move (the byte floor's numerator)
    err: float


# ---------------------------------------------------------------------------------------------
# Dense projections


def _dense_variants(m: int, n: int, k: int, groups: int, gen: torch.Generator):
    """(variant, weight factory, call(x, w), reference(x, w)) of a dense shape."""
    rows = n * groups

    def ref_dense(x, w):
        if groups == 1:
            return x.float() @ w.float().T
        return torch.einsum("mgk,gnk->mgn", x.float(), w.float().view(groups, n, k))

    def ref_quant(x, w):
        return ref_dense(x, dequantize_weight_ref(w, torch.float32))

    def cublas(x, w):
        if groups == 1:
            return F.linear(x, w)
        return torch.bmm(x.transpose(0, 1), w.view(groups, n, k).transpose(1, 2)).transpose(0, 1)

    def bf16_triton(x, w):
        if groups == 1:
            return small_m_linear(x, w)
        return small_m_grouped_linear(x, w.view(groups, n, k))

    out = [
        ("bf16 triton", lambda: _bf16_random((rows, k), gen), bf16_triton, ref_dense),
        ("bf16 cuBLAS", lambda: _bf16_random((rows, k), gen), cublas, ref_dense),
    ]
    for fmt, group in FORMATS:
        make = lambda f=fmt, gr=group: quantize_random((rows, k), f, gr, gen)
        old = baseline_quantized_linear if groups == 1 else baseline_quantized_grouped_linear
        new = quantized_linear if groups == 1 else quantized_grouped_linear
        out.append((f"{_label(fmt, group)} old", make, old, ref_quant))
        out.append((f"{_label(fmt, group)} new", make, new, ref_quant))
    return out


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()


def bench_dense(
    m: int,
    name: str,
    n: int,
    k: int,
    groups: int,
    warm_only: bool = False,
    only: str | None = None,
) -> list[Row]:
    """Every dense variant (or only the one labelled `only`) of a shape at M rows."""
    gen = _generator(n + k + m)
    shape = (m, k) if groups == 1 else (m, groups, k)
    x = torch.randn(shape, generator=gen, device=SETUP.device).to(torch.bfloat16)
    act_bytes = 2 * groups * (m * k + m * n)
    out = []
    for variant, make, call, ref in _dense_variants(m, n, k, groups, gen):
        if only is not None and variant != only:
            continue
        w0 = make()
        got = call(x, w0)
        if warm_only:  # compiled: enough
            continue
        err = max_rel_err(got, ref(x, w0))
        weights = [w0] + [make() for _ in range(_copies(_nbytes(w0)) - 1)]
        us = time_us([lambda w=w, c=call: c(x, w) for w in weights], _reps(len(weights)))
        out.append(Row(name, m, variant, us, _nbytes(w0) + act_bytes, err))
        del weights
    return out


# ---------------------------------------------------------------------------------------------
# Routed experts


ROUTE_SETS = 8  # routings cycled per timing, so consecutive calls read other experts


def _moe_inputs(m: int, seed: int):
    """Token inputs and routes: `topk` distinct routed experts per token plus the folded shared
    expert (local id E) with weight 1, as the engine routes them."""
    s = SETUP
    gen = _generator(seed)
    x = torch.randn(m, s.hidden, generator=gen, device=s.device).to(torch.bfloat16)
    routed = torch.rand(m, s.experts, generator=gen, device=s.device).argsort(dim=1)[:, : s.topk]
    shared = torch.full((m, 1), s.experts, device=s.device, dtype=routed.dtype)
    ids = torch.cat((routed, shared), dim=1).to(torch.int32).contiguous()
    weights = torch.cat(
        (torch.rand(m, s.topk, generator=gen, device=s.device), torch.ones(m, 1, device=s.device)),
        dim=1,
    ).contiguous()
    return x, ids, weights


def _moe_weights(fmt: str | None, group: int, gen: torch.Generator):
    s, e = SETUP, SETUP.experts + 1
    if fmt is None:
        return _bf16_random((e, 2 * s.inter, s.hidden), gen), _bf16_random(
            (e, s.hidden, s.inter), gen
        )
    return (
        quantize_random((e, 2 * s.inter, s.hidden), fmt, group, gen),
        quantize_random((e, s.hidden, s.inter), fmt, group, gen),
    )


def bench_moe(m: int, warm_only: bool = False, only: int | None = None) -> list[Row]:
    """The experts in bf16 and each of MOE_FORMATS (or only the `only`-th of those) at M
    tokens."""
    s = SETUP
    inputs = [_moe_inputs(m, 1000 * m + i) for i in range(ROUTE_SETS)]
    mask = torch.ones(s.experts + 1, dtype=torch.int32, device=s.device)
    plan = prepare_moe_sort(mask)
    routes = s.topk + 1
    block = sort_block_size(m, routes, plan.num_local)
    distinct = sum(int(ids.unique().numel()) for _, ids, _ in inputs) / len(inputs)
    act_bytes = 2 * (m * s.hidden * 2 + m * routes * s.inter * 2)

    def sorted_path(w13, w2, x, ids, weights):
        sort = moe_sort(ids, weights, plan, 0, block_size=block)
        y = fused_moe(x, w13, w2, sort, routes, LIMIT, block_size=block)
        return moe_reduce(y, weights, ids, mask, 1.0)

    def token_path(w13, w2, x, ids, weights):
        h = moe_route_gate_up(x, w13, ids, plan.local_table, plan.num_local, LIMIT)
        return moe_token_down_reduce(h, w2, ids, weights, plan.local_table, plan.num_local)

    paths = [("sorted", sorted_path)] + ([("token", token_path)] if m <= 4 else [])
    gen = _generator(11)
    out = []
    variants = [(None, 0, False)] + [(f, g, False) for f, g in MOE_FORMATS]
    if s.moe_unsplit and not warm_only:  # each format's weights drawn again from its own seed
        variants += [(f, g, True) for f, g in MOE_FORMATS]
    for index, (fmt, group, unsplit) in enumerate(variants):
        if only is not None and index != only:
            continue
        if fmt is not None:
            gen = _generator(11 + MOE_FORMATS.index((fmt, group)) + 1)
        w13, w2 = _moe_weights(fmt, group, gen)
        label = "bf16 triton" if fmt is None else f"{_label(fmt, group)} new"
        label += " unsplit" if unsplit else ""
        _force_unsplit(unsplit)
        expert_bytes = (_nbytes(w13) + _nbytes(w2)) / (s.experts + 1)
        deq = None
        if fmt is not None and not warm_only:  # the same kernels on the dequantised experts
            deq = (
                dequantize_weight_ref(w13, torch.bfloat16),
                dequantize_weight_ref(w2, torch.bfloat16),
            )
        for path, fn in paths:
            got = fn(w13, w2, *inputs[0])
            if warm_only:  # compiled: enough
                continue
            err = float("nan") if deq is None else max_rel_err(got, fn(*deq, *inputs[0]))
            calls = [lambda fn=fn, a=w13, b=w2, i=i: fn(a, b, *i) for i in inputs]
            us = time_us(calls, 4)
            shape = f"MoE {path} {s.experts}+1x(2x{s.inter}+{s.inter})x{s.hidden} top-{s.topk}+1"
            out.append(Row(shape, m, label, us, int(distinct * expert_bytes) + act_bytes, err))
        del w13, w2, deq
    _force_unsplit(False)
    return out


_SPLIT_USERS = (grouped_gemm, token_gemm, token_down)
_LIBRARY_SPLIT = tuple(module.expert_split_k for module in _SPLIT_USERS)


def _force_unsplit(unsplit: bool) -> None:
    """The expert paths' K split: the library's, or none (the launchers read the name from
    their own modules, so each is replaced)."""
    for module, library in zip(_SPLIT_USERS, _LIBRARY_SPLIT):
        module.expert_split_k = (lambda *_: 1) if unsplit else library


# ---------------------------------------------------------------------------------------------
# Compilation in worker processes, then the timed sweep


def _jobs(m_values: list[int], moe: bool) -> list[tuple]:
    jobs: list[tuple] = []
    for m in m_values:
        jobs += [("dense", m, *shape) for shape in SETUP.dense]
        if moe:
            jobs.append(("moe", m))
    return jobs


def _run_job(job: tuple, warm_only: bool) -> list[Row]:
    if job[0] == "dense":
        return bench_dense(*job[1:], warm_only=warm_only)
    return bench_moe(job[1], warm_only=warm_only)


def _warm_tasks(jobs: list[tuple]) -> list[tuple]:
    """The jobs' kernel compilations as tasks of one variant each: a dense variant over every
    shape at the M values of one specialisation class (Triton compiles M = 1 and M divisible by
    16 apart), one expert format over every M. Split by variant, parallel workers rarely
    compile the same kernel twice."""
    dense = sorted({(j[1], j[2:]) for j in jobs if j[0] == "dense"})
    m_classes: dict[str, list[int]] = {}
    for m in sorted({m for m, _ in dense}):
        m_classes.setdefault("1" if m == 1 else ("16" if m % 16 == 0 else "other"), []).append(m)
    labels = ["bf16 triton", "bf16 cuBLAS"] + [
        f"{_label(f, g)} {age}" for f, g in FORMATS for age in ("old", "new")
    ]
    tasks: list[tuple] = []
    for ms in m_classes.values():
        tasks += [
            ("dense", label, tuple((m, shape) for m, shape in dense if m in ms)) for label in labels
        ]
    moe_ms = tuple(sorted({j[1] for j in jobs if j[0] == "moe"}))
    if moe_ms:
        tasks += [("moe", index, moe_ms) for index in range(1 + len(MOE_FORMATS))]
    return tasks


def _warm_worker(tasks: list[tuple]) -> int:
    for kind, what, items in tasks:
        for item in items:
            if kind == "dense":
                m, shape = item
                bench_dense(m, *shape, warm_only=True, only=what)
            else:
                bench_moe(item, warm_only=True, only=what)
    torch.cuda.synchronize()
    return len(tasks)


def compile_in_workers(jobs: list[tuple], workers: int) -> None:
    """Run the jobs' checked calls once in `workers` spawned processes (one GPU context each),
    so every kernel variant is in Triton's on-disk cache before the timed sweep."""
    tasks = _warm_tasks(jobs)
    parts: list[list[tuple]] = [[] for _ in range(min(workers, len(tasks)))]
    for i, task in enumerate(tasks):
        parts[i % len(parts)].append(task)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(parts), mp_context=ctx) as pool:
        done = sum(pool.map(_warm_worker, parts))
    print(f"compiled {done} variant tasks in {len(parts)} processes", flush=True)


def copy_bandwidth() -> float:
    if SETUP.device == "cpu":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=SETUP.device)
    y = torch.empty_like(x)
    us = time_us([lambda: y.copy_(x)], 10)
    return 2 * x.numel() / (us * 1e-6)


def launch_floor_us() -> float:
    x = torch.zeros(1, device=SETUP.device)
    return time_us([lambda: add_one(x)], 64)


# ---------------------------------------------------------------------------------------------
# Tables


def _fmt_us(us: float) -> str:
    return "-" if us != us else f"{us:.1f}"


def render(rows: list[Row], peak: float, copy_bw: float, floor_us: float) -> str:
    device = torch.cuda.get_device_name() if SETUP.device == "cuda" else SETUP.device
    lines = [
        f"{device}, torch {torch.__version__}; byte floor at {peak / 1e12:.2f} TB/s; measured "
        f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; launch floor (one-element kernel, same "
        f"harness) {_fmt_us(floor_us)} us",
        "",
        "| shape | M | variant | us | TB/s | x bf16 triton | x floor | max rel err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {(r.shape, r.m): r.us for r in rows if r.variant == "bf16 triton"}
    for r in rows:
        ref = base.get((r.shape, r.m))
        speedup = f"{ref / r.us:.2f}" if ref and r.us == r.us else "-"
        tbps = f"{r.moved / (r.us * 1e-6) / 1e12:.2f}" if r.us == r.us else "-"
        floor = f"{r.us / (r.moved / peak * 1e6):.2f}" if r.us == r.us else "-"
        lines.append(
            f"| {r.shape} | {r.m} | {r.variant} | {_fmt_us(r.us)} | {tbps} | {speedup} | "
            f"{floor} | {'-' if r.err != r.err else f'{r.err:.1e}'} |"
        )
    return "\n".join(lines) + "\n" + summary(rows)


def summary(rows: list[Row]) -> str:
    """Speedup over the bf16 Triton kernel per quantised variant (old -> new), against the
    goals."""
    variants = [_label(f, g) for f, g in FORMATS]
    head = "| shape | M | bf16 triton us | " + " | ".join(f"{v} old -> new" for v in variants)
    lines = ["", "Speedup over bf16 Triton (goal: W8A16 >= 1.8x, W4A16 >= 2.5x; * = met)", ""]
    lines += [head + " |", "|---|---|---|" + "---|" * len(variants)]
    by_key: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        by_key.setdefault((r.shape, r.m), {})[r.variant] = r.us
    for (shape, m), us in by_key.items():
        base = us.get("bf16 triton")
        if not base or base != base:
            continue
        cells = []
        for v in variants:
            old, new = us.get(f"{v} old"), us.get(f"{v} new")
            goal = GOALS[v.split()[0]]
            mark = "*" if new and base / new >= goal else ""
            cells.append(
                f"{base / old:.2f} -> {base / new:.2f}{mark}"
                if old and new
                else (f"{base / new:.2f}{mark}" if new else "-")
            )
        lines.append(f"| {shape} | {m} | {base:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _shrink() -> None:
    """Tiny shapes for the CPU interpreter: every code path once, in seconds."""
    global SETUP
    SETUP = Setup(
        device="cpu",
        dense=tuple(
            (name, max(n // 256, 40), max(k // 64, 96), g) for name, n, k, g in Setup.dense
        ),
        experts=6,
        topk=2,
        hidden=96,
        inter=64,
        working_set=1,
        max_copies=1,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,4,8,16")
    p.add_argument("--only", default="", help="substring of the shapes to run ('MoE': experts)")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument(
        "--moe-unsplit",
        action="store_true",
        help="also time the quantised experts with their products unsplit along K",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth of the byte floor")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument(
        "--budget-s",
        type=float,
        default=95.0,
        help="start no new shape after this many seconds (the table keeps what was measured)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="instead: the library's quantised linear at the SWEEP launch shapes (--only shapes)",
    )
    p.add_argument(
        "--sweep-formats",
        default="",
        help="with --sweep: comma-separated FORMAT/GROUP of FORMATS to sweep (default: all)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the script (TRITON_INTERPRET=1): tiny shapes, no timing",
    )
    a = p.parse_args()
    start = time.monotonic()
    if a.smoke:
        _shrink()
        a.m = "1,5" if a.m == p.get_default("m") else a.m
        a.budget_s = math.inf
    m_values = [int(v) for v in a.m.split(",")]
    SETUP.moe_unsplit = a.moe_unsplit
    SETUP.dense = tuple(s for s in SETUP.dense if a.only in s[0])
    moe = not a.no_moe and a.only in "MoE"
    peak = a.peak_tbps * 1e12
    if a.sweep:
        # Run as a script this module is __main__: the sweep's import of it must find this
        # instance (its SETUP, shrunk by --smoke), not load a second one.
        sys.modules.setdefault("benchmark.kernels.bench_quant_gemm", sys.modules[__name__])
        from benchmark.kernels.sweep_quant_linear import sweep_linear

        formats = FORMATS
        if a.sweep_formats:
            formats = tuple(
                (f, int(g)) for f, g in (v.split("/") for v in a.sweep_formats.split(","))
            )
            unknown = set(formats) - set(FORMATS)
            if unknown:
                p.error(f"--sweep-formats: {sorted(unknown)} not among {FORMATS}")
        copy_bw, floor_us = copy_bandwidth(), float("nan")
        rows: list[Row] = []
        for name, n, k, groups in SETUP.dense:
            rows += sweep_linear(m_values, name, n, k, formats, groups)
            if a.out:
                Path(a.out).write_text(render(rows, peak, copy_bw, floor_us))
        print(render(rows, peak, copy_bw, floor_us))
        return
    jobs = _jobs(m_values, moe)
    if SETUP.device == "cuda" and a.jobs > 1:
        try:
            compile_in_workers(jobs, a.jobs)
        except Exception as exc:  # noqa: BLE001 - the sweep below compiles what is missing
            print(
                f"parallel compilation failed ({type(exc).__name__}: {exc}); going on", flush=True
            )
    copy_bw, floor_us = copy_bandwidth(), launch_floor_us()
    rows = []
    for job in jobs:
        if time.monotonic() - start > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: stopped before {job}", flush=True)
            break
        new = _run_job(job, warm_only=False)
        rows += new
        for line in render(new, peak, copy_bw, floor_us).splitlines()[4 : 4 + len(new)]:
            print(line, flush=True)
        if a.out:  # rewritten after every job, so a run cut short keeps what it measured
            Path(a.out).write_text(render(rows, peak, copy_bw, floor_us))
    print(render(rows, peak, copy_bw, floor_us))
    print(f"total {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
