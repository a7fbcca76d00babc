"""Probe: where the mHC sublayer boundary's time goes, at DeepSeek-V4.1-Flash's shape (D 5120,
hc 4, 20 Sinkhorn iterations, bf16 streams, single pass: the collapse with the previous site's
pre), one device, one process.

The boundary is two launches of one kernel (`kernels/mhc/post_combine.py`): phase A (the stream
update over D slices, the partial sums of the next coefficients and, single pass, the collapse
with the given pre) and phase B (per row, the coefficients and Sinkhorn in one program, the norm
of x_in in chunks over others). Each variant is the library's launcher with something left
out or changed, so its time against the library's says what that part costs:

  collapse in phase B           `collapse_in_stream_pass` False: the collapse and the whole
                                row's norm in one phase-B program of 16 warps (at D 5120), the
                                coefficients in another (the two-pass boundary's layout);
  phase A only / phase B only   one of the two launches skipped (phase B then reads whatever its
                                scratch holds: the same instructions on other values);
  Sinkhorn 1 iteration          the coefficient program's loop cut to one pass;
  norm chunks of W columns      `_NORM_BLOCK` W instead of the library's;
  phase B at W warps            `_NORM_WARPS` W instead of the library's;
  no coefficients               `mhc_post_collapse`: phase A without the projection, phase B the
                                norm alone;
  phase A over T row tiles      `_TARGET_ROW_TILES` T instead of the library's (more tiles: fewer
                                rows a program, fn read by more programs);
  one row a phase-A program     `_MAX_BLOCK_M` 1 (the library's above `_MAX_TILED_ROWS` rows,
                                where the row-tile variants change nothing either);
  phase A without its cap       `_PHASE_A_MAX_REGISTERS` None (phase A at the registers it
                                compiles to: 180 at sm90 for V4.1's 8-row tiles).

Timed ABBA (library, variant, variant, library) in CUDA graphs of `--copies` boundaries, each
with its own hyper-connection parameters (fn is 2 MB in fp32 a boundary: the copies exceed the
L2 as a decode step's 83 boundaries do). Variants change results (a skipped phase, one Sinkhorn
pass): this probe times, it does not check; `test_mhc.py` checks the library.

Usage (device machine): python3 benchmark/kernels/probe_mhc_phases.py --out mhc_phases.md
    [--m 1,4,8,32 --copies 32]     (--device cpu: each variant run once, nothing timed)
    [--library-only]               (the library's boundary alone: with another tree's python/
                                    first on PYTHONPATH, an A/B across processes)
    [--two-pass --hidden 4096]     (V4's boundary; the variants but the post-collapse, which
                                    closes with a given pre)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_dspark.kernels.mhc import post_combine  # noqa: E402
from sgl_dspark.kernels.mhc.post_combine import mhc_post_collapse, mhc_post_combine  # noqa: E402

from benchmark.kernels.bench_mhc_indexer import HC, _mhc_inputs  # noqa: E402
from benchmark.kernels.bench_mhc_indexer import HC_SINKHORN_ITERS as SINKHORN_ITERS  # noqa: E402
from benchmark.kernels.graph_timing import graph_time_us  # noqa: E402

HIDDEN = 5120  # V4.1-Flash


class _PhaseFilter:
    """Stands in for the boundary kernel in `post_combine`: launches only the phases in `keep`;
    anything else is the kernel's."""

    def __init__(self, kernel: object, keep: tuple[int, ...]) -> None:
        self._kernel, self._keep = kernel, keep

    def __getattr__(self, name: str) -> object:
        return getattr(self._kernel, name)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **meta: object) -> None:
            if meta["PHASE"] in self._keep:
                self._kernel[grid](*args, **meta)  # type: ignore[index]

        return launch


@contextlib.contextmanager
def _variant(keep: tuple[int, ...] = (0, 1), **constants: object) -> Iterator[None]:
    """The library's launcher with only the phases in `keep`, and module constants (or rules)
    of `post_combine` replaced by `constants`."""
    with contextlib.ExitStack() as stack:
        if keep != (0, 1):
            kernel = _PhaseFilter(post_combine._mhc_post_combine_kernel, keep)
            stack.enter_context(mock.patch.object(post_combine, "_mhc_post_combine_kernel", kernel))
        for name, value in constants.items():
            stack.enter_context(mock.patch.object(post_combine, name, value))
        yield


def _boundaries(
    m: int, copies: int, device: str, hidden: int = HIDDEN, two_pass: bool = False
) -> list[dict]:
    """`copies` boundaries' inputs of width `hidden` (`bench_mhc_indexer`'s, the norm weight
    in bf16 as the model holds it): the first one's activations shared, each its own
    hyper-connection tensors; two pass (V4): no collapse pre."""
    out = [_mhc_inputs(m, device, hidden) for _ in range(copies)]
    gen = torch.Generator().manual_seed(97 + m)
    collapse_pre = None if two_pass else (torch.rand(m, HC, generator=gen) + 0.5).to(device)
    for b in out:
        b.update({k: out[0][k] for k in ("streams", "y", "post", "comb")})
        b["norm_weight"] = b["norm_weight"].to(torch.bfloat16)
        b["collapse_pre"] = collapse_pre
    return out


def _combine(b: dict, sinkhorn_iters: int) -> Callable[[], object]:
    return lambda: mhc_post_combine(
        b["streams"],
        b["y"],
        b["post"],
        b["comb"],
        b["fn"],
        b["base"],
        b["scale"],
        b["norm_weight"],
        hc_eps=1e-6,
        sinkhorn_iters=sinkhorn_iters,
        rms_eps=1e-6,
        collapse_pre=b["collapse_pre"],
    )


def _library(b: dict) -> Callable[[], object]:
    return _combine(b, SINKHORN_ITERS)


def _collapse(b: dict) -> Callable[[], object]:
    return lambda: mhc_post_collapse(
        b["streams"],
        b["y"],
        b["post"],
        b["comb"],
        b["collapse_pre"],
        b["norm_weight"],
        rms_eps=1e-6,
    )


# (label, variant context, boundary call factory)
VARIANTS: tuple[tuple[str, Callable[[], contextlib.AbstractContextManager], Callable], ...] = (
    (
        "collapse in phase B",
        lambda: _variant(collapse_in_stream_pass=lambda collapse_pre: False),
        _library,
    ),
    ("phase A only", lambda: _variant(keep=(0,)), _library),
    ("phase B only", lambda: _variant(keep=(1,)), _library),
    ("Sinkhorn 1 iteration", _variant, lambda b: _combine(b, 1)),
    ("norm chunks of 512 columns", lambda: _variant(_NORM_BLOCK=512), _library),
    ("norm chunks of 2048 columns", lambda: _variant(_NORM_BLOCK=2048), _library),
    ("phase B at 1 warp", lambda: _variant(_NORM_WARPS=1), _library),
    ("phase B at 2 warps", lambda: _variant(_NORM_WARPS=2), _library),
    ("no coefficients (post_collapse)", _variant, _collapse),
    ("phase A over 4 row tiles", lambda: _variant(_TARGET_ROW_TILES=4), _library),
    ("phase A over 8 row tiles", lambda: _variant(_TARGET_ROW_TILES=8), _library),
    ("phase A over 16 row tiles", lambda: _variant(_TARGET_ROW_TILES=16), _library),
    ("phase A over 32 row tiles", lambda: _variant(_TARGET_ROW_TILES=32), _library),
    ("one row a phase-A program", lambda: _variant(_MAX_BLOCK_M=1), _library),
    ("phase A over 2 row tiles", lambda: _variant(_TARGET_ROW_TILES=2), _library),
    ("phase A without its register cap", lambda: _variant(_PHASE_A_MAX_REGISTERS=None), _library),
)


def _time(calls: list[Callable[[], object]], device: str) -> float:
    if device == "cpu":
        for call in calls:
            call()
        return float("nan")
    return graph_time_us(calls, reps=max(2, 256 // len(calls)))


def _rows(m: int, a: argparse.Namespace) -> list[str]:
    device, library_only = a.device, a.library_only
    boundaries = _boundaries(m, a.copies, device, a.hidden, a.two_pass)
    library = [_library(b) for b in boundaries]
    if library_only:
        rows = [f"| {m} | {_time(library, device):.2f} |"]
        print(rows[-1], flush=True)
        return rows
    rows = []
    for label, context, factory in VARIANTS:
        if a.only not in label or (a.two_pass and factory is _collapse):
            continue  # the post-collapse closes with a given pre, which a two-pass site lacks
        calls = [factory(b) for b in boundaries]
        times: dict[bool, list[float]] = {False: [], True: []}
        for is_variant in (False, True, True, False):
            with context() if is_variant else contextlib.nullcontext():
                times[is_variant].append(_time(calls if is_variant else library, device))
        lib, alt = (sum(times[v]) / 2 for v in (False, True))
        rows.append(f"| {m} | {label} | {lib:.2f} | {alt:.2f} | {alt - lib:+.2f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--m", default="1,4,8,32")
    p.add_argument("--copies", type=int, default=32)
    p.add_argument("--only", default="", help="the variants whose label holds this substring")
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="D (V4-Flash: 4096)")
    p.add_argument(
        "--two-pass",
        action="store_true",
        help="V4's boundary: no collapse pre (the collapse with the new pre in phase B)",
    )
    p.add_argument(
        "--library-only",
        action="store_true",
        help="time the library's boundary alone (no variants: any tree's library, e.g. a base "
        "tree's on PYTHONPATH, for an A/B across processes)",
    )
    a = p.parse_args()
    name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    lines = [
        f"device: {name}; library: {Path(post_combine.__file__).parents[3]}; D {a.hidden}, hc "
        f"{HC}, {SINKHORN_ITERS} Sinkhorn iterations, bf16, {'two' if a.two_pass else 'single'} "
        f"pass; {a.copies} boundaries "
        "a graph round",
        "",
    ]
    if a.library_only:
        lines += ["| M | library us |", "|---|---|"]
    else:
        lines += [
            "| M | variant | library us | variant us | variant - library |",
            "|---|---|---|---|---|",
        ]
    for m in (int(v) for v in a.m.split(",")):
        lines += _rows(m, a)
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
