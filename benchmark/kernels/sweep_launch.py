"""Launch-parameter sweep for the kernels that sit at the launch floor (the route reduce, the
clamped SwiGLU, the index-key FP4 quant, the vocab argmax, RMSNorm).

    python3 benchmark/kernels/sweep_launch.py --out sweep.md [--only moe_reduce,rmsnorm,...]

Each launcher takes its meta-parameters (block sizes, rows per program, chunks per row,
num_warps) from one private function of its module (`_reduce_meta`, `_act_meta`,
`_k_quant_meta`, `_chunk_meta`, `_norm_meta`). For every candidate below, that function is
replaced by "the default, with these keys overridden", and the benchmark case of
`benchmark/kernels/bench_*.py` runs at M = 1/4/8/24/32/128 on its own inputs:

1. exactness first: at every M the candidate writes into poisoned output buffers and must give
   the default's bits; a candidate that differs anywhere is rejected (for RMSNorm, within a
   tolerance of its reference, whose summation tree follows the thread layout, rejected candidates
   are still timed and reported apart, never as the best);
2. timing: `run_all.time_graph` (CUDA graph of `--calls` calls, median of `--replays` replays,
   us per call); the default is timed before and after its candidates (the spread is the noise);
3. torch.compile of the reference is compiled once per M and timed once.

The Markdown report has one summary row per (case, M) and the full candidate x M matrix.
Extra keys: `silu_mul_clamp_fp8` (routed, fp8 groups), `rmsnorm_heads` (per-head weightless
norm), `compressor` (the block pooling).
`check_candidates` runs step 1 alone (any device, the CPU interpreter included).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

M_VALUES = (1, 4, 8, 24, 32, 128)
Meta = dict[str, Any]  # override values: ints, or callables of the default meta dict


@dataclass(frozen=True)
class SweepTarget:
    key: str
    module: str  # kernel module holding the meta function
    meta_fn: str
    bench: str  # benchmark module holding the cases
    cases: tuple[str, ...]
    candidates: tuple[Meta, ...]
    out_kwargs: Callable[[Any], dict[str, torch.Tensor]]  # poisoned output buffers
    bits_may_differ: bool = False  # candidates with other bits are timed, flagged


def _poison(t: torch.Tensor) -> torch.Tensor:
    """A buffer like t that no kernel output equals: 0xAB bytes, NaN, or -7."""
    if t.element_size() == 1:
        return torch.full_like(t.view(torch.uint8), 0xAB).view(t.dtype)
    if t.is_floating_point():
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, -7)


def _out(default: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"out": _poison(default)}


def _fp4_k_quant_out(default: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"out_codes": _poison(default[0]), "out_scales": _poison(default[1])}


def _no_out(default: Any) -> dict[str, torch.Tensor]:
    return {}  # the fp8 epilogue allocates its outputs (no out= to poison)


def _half(key: str) -> Callable[[Meta], int]:
    return lambda d: max(1, d[key] // 2)


def _double(key: str) -> Callable[[Meta], int]:
    return lambda d: d[key] * 2


def _times4(key: str) -> Callable[[Meta], int]:
    return lambda d: d[key] * 4


def _times16(key: str) -> Callable[[Meta], int]:
    return lambda d: d[key] * 16


def _pairs(a: str, b: str, *values: tuple[int, int]) -> tuple[Meta, ...]:
    return tuple({a: x, b: y} for x, y in values)


# Columns (or rows) per program x warps, around each default (listed in its meta function).
_MOE_REDUCE = _pairs(
    "BLOCK_H",
    "num_warps",
    (128, 1),
    (256, 1),
    (256, 2),
    (512, 1),
    (512, 2),
    (512, 4),
    (1024, 2),
    (1024, 4),
    (1024, 8),
    (2048, 4),
    (2048, 8),
    (4096, 8),
)
_SILU = _pairs(
    "BLOCK",
    "num_warps",
    (128, 1),
    (128, 2),
    (128, 4),
    (256, 1),
    (256, 2),
    (256, 4),
    (512, 1),
    (512, 2),
    (512, 8),
    (1024, 4),
    (1024, 8),
)
_SILU_FP8 = _pairs(
    "BLOCK",
    "num_warps",
    (128, 1),
    (128, 2),
    (256, 2),
    (256, 4),
    (512, 2),
    (512, 4),
    (1024, 2),
    (1024, 8),
    (2048, 4),
    (2048, 8),
)
_FP4_K_QUANT = _pairs(
    "BLOCK_ROWS",
    "num_warps",
    (1, 1),
    (2, 1),
    (2, 2),
    (4, 1),
    (4, 2),
    (4, 4),
    (8, 1),
    (8, 2),
    (16, 2),
    (16, 4),
    (32, 4),
    (32, 8),
)
_SHARD_ARGMAX = (
    {"num_warps": 2},
    {"num_warps": 8},
    {"max_block": 1024},
    {"max_block": 2048},
    {"per_row": _half("per_row")},
    {"per_row": _double("per_row")},
    {"per_row": _half("per_row"), "num_warps": 8},
    {"per_row": _double("per_row"), "max_block": 1024},
    {"per_row": 1, "num_warps": 8},
    {"per_row": 1, "num_warps": 16},
    {"per_row": 4, "num_warps": 8},
    {"per_row": 16, "max_block": 2048},
)
_NORM = (
    {"num_warps": 1},
    {"num_warps": 2},
    {"num_warps": 8},
    {"num_warps": 16},
    {"BLOCK_M": 1},
    {"BLOCK_M": 1, "num_warps": 1},
    {"BLOCK_M": 1, "num_warps": 2},
    {"BLOCK_M": 1, "num_warps": 8},
    {"BLOCK_M": 2},
    {"BLOCK_M": 2, "num_warps": 8},
    {"BLOCK_M": _double("BLOCK_M")},
    {"BLOCK_M": _double("BLOCK_M"), "num_warps": 8},
)

# Per-head rows (N 512, 64 x M rows): rows per program (the default packs 8) and warps.
_NORM_HEADS = (
    {"BLOCK_M": 1},
    {"BLOCK_M": 2},
    {"BLOCK_M": 4},
    {"BLOCK_M": 4, "num_warps": 2},
    {"BLOCK_M": 8, "num_warps": 2},
    {"BLOCK_M": 8, "num_warps": 8},
    {"BLOCK_M": 16},
    {"BLOCK_M": 16, "num_warps": 8},
    {"BLOCK_M": 32, "num_warps": 8},
)


# Compressor pooling: warps, and span slots per tile (SPAN_BLOCK >= span: the one-pass path).
def _quarter(key: str) -> Callable[[Meta], int]:
    return lambda d: max(1, d[key] // 4)


def _wider_channels(d: Meta) -> int:
    return min(d["BLOCK_D"], d["BLOCK_C"] * 2)  # a program's channels never exceed the row


# BLOCK_C below BLOCK_D splits a row's channels over programs; SPAN_BLOCK x BLOCK_C is one
# program's tile.
_POOL = (
    {"num_warps": 1},
    {"num_warps": 2},
    {"num_warps": 8},
    {"BLOCK_C": _half("BLOCK_C")},
    {"BLOCK_C": _quarter("BLOCK_C")},
    {"BLOCK_C": _half("BLOCK_C"), "num_warps": 2},
    {"BLOCK_C": _quarter("BLOCK_C"), "num_warps": 2},
    {"BLOCK_C": _half("BLOCK_C"), "SPAN_BLOCK": _double("SPAN_BLOCK")},
    {"BLOCK_C": _wider_channels, "SPAN_BLOCK": _half("SPAN_BLOCK")},
    {"SPAN_BLOCK": _half("SPAN_BLOCK")},
    {"SPAN_BLOCK": _half("SPAN_BLOCK"), "num_warps": 2},
)


def _pool_out(default: Any) -> dict[str, torch.Tensor]:
    return {"out": _poison(default.entries), "out_slots": _poison(default.slots)}


TARGETS: dict[str, SweepTarget] = {
    t.key: t
    for t in (
        SweepTarget(
            "moe_reduce",
            "moe.reduce",
            "_reduce_meta",
            "bench_moe",
            ("moe_reduce (slot-ordered)",),
            _MOE_REDUCE,
            _out,
        ),
        SweepTarget(
            "silu_mul_clamp",
            "moe.activation",
            "_act_meta",
            "bench_moe",
            ("silu_mul_clamp shared (I=512, bf16)",),
            _SILU,
            _out,
        ),
        SweepTarget(
            "silu_mul_clamp_fp8",
            "moe.activation",
            "_act_meta",
            "bench_moe",
            ("silu_mul_clamp routed (I=2048, fp8 group)",),
            _SILU_FP8,
            _no_out,
        ),
        SweepTarget(
            "fp4_index_k_quant",
            "indexer.fp4_k_quant",
            "_k_quant_meta",
            "bench_mhc_indexer",
            ("fp4_index_k_quant_128",),
            _FP4_K_QUANT,
            _fp4_k_quant_out,
        ),
        SweepTarget(
            "shard_argmax",
            "sampling.vocab_argmax",
            "_chunk_meta",
            "bench_spec",
            ("shard_argmax_pairs_rank",),
            _SHARD_ARGMAX,
            _out,
        ),
        SweepTarget(
            "rmsnorm",
            "norm.rmsnorm",
            "_norm_meta",
            "bench_norm",
            ("rmsnorm_hidden_d4096", "rmsnorm_q_lora_d1024"),
            _NORM,
            _out,
            bits_may_differ=True,
        ),
        SweepTarget(
            "rmsnorm_heads",
            "norm.rmsnorm",
            "_norm_meta",
            "bench_norm",
            ("rmsnorm_q_heads_64x512_weightless",),
            _NORM_HEADS,
            _out,
            bits_may_differ=True,
        ),
        # Other bits allowed: the span sums' order follows the tile split and the warps' layout.
        SweepTarget(
            "compressor",
            "compressor.pool",
            "_pool_meta",
            "bench_indexer",
            (
                "compressor_pool_csa_m4_dh512",
                "compressor_pool_hca_m128_dh512",
                "compressor_pool_csa_m4_dh128",
                "compressor_pool_csa_m4_dh64_indexer",
                "compressor_pool_hca_m128_dh128",
            ),
            _POOL,
            _pool_out,
            bits_may_differ=True,
        ),
    )
}
DEFAULT_KEYS = ("moe_reduce", "silu_mul_clamp", "fp4_index_k_quant", "shard_argmax", "rmsnorm")


def _kernel_module(target: SweepTarget) -> ModuleType:
    return importlib.import_module(f"sgl_dspark.kernels.{target.module}")


def _case(target: SweepTarget, name: str) -> dict[str, Any]:
    cases = importlib.import_module(f"benchmark.kernels.{target.bench}").CASES
    found = [c for c in cases if c["name"] == name]
    assert len(found) == 1, f"benchmark case {name!r} not found in {target.bench}"
    return found[0]


class _Patched:
    """Context manager: the target's meta function returns the default merged with
    `overrides` (callable values get the default dict); records the metas it returned."""

    def __init__(self, target: SweepTarget, overrides: Meta | None) -> None:
        self.mod = _kernel_module(target)
        self.name = target.meta_fn
        self.default_fn = getattr(self.mod, self.name)
        self.overrides = overrides or {}
        self.seen: list[Meta] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Meta:
        meta = dict(self.default_fn(*args, **kwargs))
        for key, value in self.overrides.items():
            assert key in meta, f"{self.name} has no meta-parameter {key!r} (has {sorted(meta)})"
            meta[key] = value(meta) if callable(value) else value
        self.seen.append(meta)
        return meta

    def __enter__(self) -> _Patched:
        setattr(self.mod, self.name, self)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.mod, self.name, self.default_fn)


def _bits_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_bits_equal, a, b))
    return a == b


def _label(overrides: Meta) -> str:
    def show(v: Any) -> str:
        return getattr(v, "__qualname__", "f").split(".")[0].strip("_") if callable(v) else str(v)

    return " ".join(f"{k}={show(v)}" for k, v in overrides.items()) or "default"


def _resolved(metas: list[Meta]) -> str:
    """The distinct metas a launcher used (one per M usually), compactly."""
    uniq = []
    for m in metas:
        text = " ".join(f"{k}={v}" for k, v in m.items())
        if text not in uniq:
            uniq.append(text)
    return "; ".join(uniq)


def check_candidates(
    keys: tuple[str, ...],
    device: str,
    m_values: tuple[int, ...],
) -> dict[tuple[str, str, int], str]:
    """Step 1 alone: {(case, candidate label, M): "ok" | "differs" | "error: ..."}."""
    results: dict[tuple[str, str, int], str] = {}
    for key in keys:
        target = TARGETS[key]
        for name in target.cases:
            case = _case(target, name)
            for m in m_values:
                inputs = case["make_inputs"](m, device)
                want = case["launcher"](**inputs)
                for overrides in target.candidates:
                    status, _ = _check_one(target, case, inputs, want, overrides)
                    results[(name, _label(overrides), m)] = status
    return results


def _check_one(
    target: SweepTarget, case: dict[str, Any], inputs: dict[str, Any], want: Any, overrides: Meta
) -> tuple[str, Meta | None]:
    """(status, the meta the launcher used) of one candidate on one input."""
    patched = _Patched(target, overrides)
    try:
        with patched:
            got = case["launcher"](**inputs, **target.out_kwargs(want))
    except Exception as e:  # noqa: BLE001 - a candidate the compiler or launcher refuses
        return f"error: {type(e).__name__}: {str(e)[:80]}", None
    meta = patched.seen[-1] if patched.seen else None
    return ("ok" if _bits_equal(want, got) else "differs"), meta


@dataclass
class _Row:
    label: str
    overrides: Meta
    metas: list[Meta]
    status: str = "ok"  # ok | differs at M=... | error: ... | same as ...
    us: dict[int, float] = field(default_factory=dict)


def _check_rows(
    target: SweepTarget,
    case: dict[str, Any],
    inputs: dict[int, dict[str, Any]],
    want: dict[int, Any],
    default_metas: list[Meta],
) -> list[_Row]:
    """Step 1 for every candidate at every M; duplicates of the default or of an earlier
    candidate (same meta at every M) are marked and not timed."""
    rows: list[_Row] = []
    for overrides in target.candidates:
        row = _Row(_label(overrides), overrides, [])
        for m in inputs:
            status, meta = _check_one(target, case, inputs[m], want[m], overrides)
            row.metas.append(meta or {})
            if status != "ok" and row.status == "ok":
                row.status = f"differs at M={m}" if status == "differs" else status
        if row.metas == default_metas:
            row.status = "same as default"
        for earlier in rows:
            if row.status == "ok" and earlier.metas == row.metas:
                row.status = f"same as {earlier.label}"
        rows.append(row)
    return rows


def _sweep_case(
    target: SweepTarget,
    name: str,
    m_values: tuple[int, ...],
    calls: int,
    replays: int,
    use_compile: bool,
    log: Callable[[str], None],
    device: str = "cuda",
) -> list[str]:
    """Summary rows of one benchmark case, then "", then its candidate x M matrix."""
    from benchmark.kernels import run_all

    time_graph = run_all.time_graph
    case = _case(target, name)
    inputs = {m: case["make_inputs"](m, device) for m in m_values}
    with _Patched(target, None) as default_meta:
        want = {m: case["launcher"](**inputs[m]) for m in m_values}
    default_metas = list(default_meta.seen)
    rows = _check_rows(target, case, inputs, want, default_metas)
    log(
        f"  checked {len(rows)} candidates: "
        f"{sum(r.status == 'ok' for r in rows)} exact and distinct"
    )
    timed = [
        r
        for r in rows
        if r.status == "ok" or (target.bits_may_differ and r.status.startswith("differs"))
    ]
    compiled = torch.compile(case["reference"], dynamic=False) if use_compile else None
    summary, default_us = [], {}
    for i, m in enumerate(m_values):
        launch = functools.partial(case["launcher"], **inputs[m])
        t_compile = float("nan")
        if compiled is not None:
            try:
                t_compile, _ = time_graph(functools.partial(compiled, **inputs[m]), calls, replays)
            except Exception as e:  # noqa: BLE001 - a reference inductor cannot handle
                log(f"  torch.compile failed at M={m}: {type(e).__name__}: {e}")
        before, _ = time_graph(launch, calls, replays)
        for row in timed:
            with _Patched(target, row.overrides):
                row.us[m], _ = time_graph(launch, calls, replays)
        after, _ = time_graph(launch, calls, replays)
        default_us[m] = (before, after)
        ref = statistics.median([before, after])
        best = min((r for r in timed if r.status == "ok"), key=lambda r: r.us[m], default=None)
        best_x2 = min((r for r in timed if r.status != "ok"), key=lambda r: r.us[m], default=None)
        cells = [
            name,
            str(m),
            f"{t_compile:.2f}" if t_compile == t_compile else "-",
            f"{before:.2f} / {after:.2f}",
            _meta_text(default_metas[i]),
        ]
        cells += (
            [_meta_text(best.metas[i]), f"{best.us[m]:.2f}", f"{best.us[m] / ref:.2f}"]
            if best
            else ["-", "-", "-"]
        )
        if target.bits_may_differ:
            cells.append(f"{_meta_text(best_x2.metas[i])}: {best_x2.us[m]:.2f}" if best_x2 else "-")
        summary.append("| " + " | ".join(cells) + " |")
        log(summary[-1])
    return summary + [""] + _matrix(name, rows, m_values, default_us)


def _meta_text(meta: Meta) -> str:
    return " ".join(f"{k}={v}" for k, v in meta.items())


def _matrix(
    name: str,
    rows: list[_Row],
    m_values: tuple[int, ...],
    default_us: dict[int, tuple[float, float]],
) -> list[str]:
    head = f"| {name}: candidate | " + " | ".join(f"M={m}" for m in m_values) + " | metas |"
    lines = [
        head,
        "|---" * (len(m_values) + 2) + "|",
        "| default | "
        + " | ".join(f"{statistics.median(default_us[m]):.2f}" for m in m_values)
        + " | |",
    ]
    fastest = {
        m: min((r.us[m] for r in rows if r.status == "ok" and m in r.us), default=float("inf"))
        for m in m_values
    }
    for row in rows:
        metas = _resolved(row.metas)
        if row.us:
            flag = "" if row.status == "ok" else " (other bits)"
            cells = [
                f"**{row.us[m]:.2f}**" if row.us[m] == fastest[m] else f"{row.us[m]:.2f}"
                for m in m_values
            ]
            lines.append(f"| {row.label}{flag} | " + " | ".join(cells) + f" | {metas} |")
        else:
            lines.append(
                f"| {row.label} | {row.status} |" + " |" * (len(m_values) - 1) + f" {metas} |"
            )
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the Markdown report here")
    p.add_argument(
        "--only", default=",".join(DEFAULT_KEYS), help=f"comma list of {sorted(TARGETS)}"
    )
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma list of M values")
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    a = p.parse_args()
    assert torch.cuda.is_available(), "sweep_launch.py needs a GPU"
    keys = tuple(k.strip() for k in a.only.split(",") if k.strip())
    unknown = [k for k in keys if k not in TARGETS]
    if unknown:
        p.error(f"unknown keys {unknown}; choose from {sorted(TARGETS)}")
    m_values = tuple(int(m) for m in a.m.split(","))
    # One compiled reference serves several cases (rms_norm_ref: two widths x six M): past
    # dynamo's default of 8 shapes per function it would silently time eager code.
    torch._dynamo.config.recompile_limit = 64
    t0 = time.time()

    def log(text: str) -> None:
        print(f"[{time.time() - t0:6.1f} s] {text}", file=sys.stderr, flush=True)

    lines = [
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
        f"{triton.__version__}  (graph of {a.calls} calls, median of {a.replays} replays, "
        "us per call)",
        "",
    ]
    for key in keys:
        target = TARGETS[key]
        lines += [f"## {key}: `{target.module}.{target.meta_fn}`", ""]
        head = [
            "case",
            "M",
            "compile us",
            "default us (before / after)",
            "default meta",
            "best exact candidate",
            "us",
            "best / default",
        ]
        if target.bits_may_differ:
            head.append("fastest with other bits")
        lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        matrices: list[str] = []
        for name in target.cases:
            log(f"{key}: {name}")
            out = _sweep_case(target, name, m_values, a.calls, a.replays, not a.no_compile, log)
            split = out.index("")
            lines += out[:split]
            matrices += out[split + 1 :]
        lines += [""] + matrices
    lines.append(f"(total {time.time() - t0:.0f} s)")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
