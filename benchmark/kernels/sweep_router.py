"""Sweep the router's launch shape and GEMV chain count on a GPU (DeepSeek-V4-Flash shapes).

    python3 benchmark/kernels/sweep_router.py --out sweep_router.md [--m 1,4,8] [--no-compile]

Launch shape: every `_RouteMeta` in `CANDIDATES` is patched in as `router._route_meta` (for
every M) and must give ids, weights and logits bit-identical to the default's (it changes no
numerics); then it is timed under CUDA graphs with `run_all.time_graph`, on the inputs of
bench_moe's "router_topk from x" case, next to `torch.compile(router_topk_ref)` on the same inputs.

GEMV shapes (`kernels/moe/router.py`'s `_GEMV_CHAINS`, `_GEMV_EXPERTS`, `_SPLIT_K`, `_GEMV_WARPS`,
see `GEMV_SHAPES`) may change the logits' rounding, so a shape must be one choice for every M: each
is checked against the reference with bench_moe's tolerance check, and for "logits independent of M"
(rows of x[:M] routed at every M give the logits of the same rows routed at the largest M, bit for
bit), then timed with the default launch shape at every M.

Most of the run is Triton and torch.compile compilation (one per M).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from sgl_dspark.kernels.moe import router as moe_route  # noqa: E402
from sgl_dspark.kernels.moe.reference import router_topk_ref
from sgl_dspark.kernels.moe.router import _RouteMeta, router_topk

from benchmark.kernels.bench_moe import _route_check, _route_x_inputs  # noqa: E402
from benchmark.kernels.run_all import time_graph  # noqa: E402

M_VALUES = (1, 4, 8, 24, 32, 128)
DEFAULT = "default"
# Fused (one launch, the last GEMV program routes `tail_rows` rows per step with its 4 warps) and
# two-launch (`rows` rows per routing program on `warps` warps) shapes, a few GEMV num_stages, the
# top-k slots unrolled or looped.
CANDIDATES: dict[str, _RouteMeta] = {
    "fused tail1": _RouteMeta(True, 1, 1, 1, 2, True),
    "fused tail4": _RouteMeta(True, 4, 1, 1, 2, True),
    "fused tail8": _RouteMeta(True, 8, 1, 1, 2, True),
    "fused tail4 loop": _RouteMeta(True, 4, 1, 1, 2, False),
    "fused tail4 st1": _RouteMeta(True, 4, 1, 1, 1, True),
    "2-launch r1w1": _RouteMeta(False, 4, 1, 1, 2, True),
    "2-launch r1w1 loop": _RouteMeta(False, 4, 1, 1, 2, False),
    "2-launch r2w1": _RouteMeta(False, 4, 2, 1, 2, True),
    "2-launch r1w2": _RouteMeta(False, 4, 1, 2, 2, True),
    "2-launch r2w2": _RouteMeta(False, 4, 2, 2, 2, True),
    "2-launch r4w4": _RouteMeta(False, 4, 4, 4, 2, True),
    "2-launch r1w4": _RouteMeta(False, 4, 1, 4, 2, True),
    "2-launch r1w1 st1": _RouteMeta(False, 4, 1, 1, 1, True),
}
# Module constants of the GEMV (tile experts, K split, MMA chains, warps), "default" = as is.
GEMV_SHAPES: dict[str, dict[str, int]] = {
    "default": {},
    "chains=2": {"_GEMV_CHAINS": 2},
    "experts=32": {"_GEMV_EXPERTS": 32},
    "split_k=256": {"_SPLIT_K": 256},
    "split_k=1024": {"_SPLIT_K": 1024},
    "split_k=1024 experts=32": {"_SPLIT_K": 1024, "_GEMV_EXPERTS": 32},
    "warps=2": {"_GEMV_WARPS": 2},
    "warps=8": {"_GEMV_WARPS": 8},
    "split_k=256 warps=2": {"_SPLIT_K": 256, "_GEMV_WARPS": 2},
}


@contextmanager
def patched(meta: _RouteMeta | None = None, gemv: dict[str, int] | None = None) -> Iterator[None]:
    """`moe_route._route_meta` returning `meta` for every M (None: the default) and/or other GEMV
    module constants (`GEMV_SHAPES`), restored on exit."""
    old_meta = moe_route._route_meta
    old_gemv = {k: getattr(moe_route, k) for k in (gemv or {})}
    if meta is not None:
        moe_route._route_meta = lambda num_rows, on_interpreter=False: meta
    for k, v in (gemv or {}).items():
        setattr(moe_route, k, v)
    try:
        yield
    finally:
        moe_route._route_meta = old_meta
        for k, v in old_gemv.items():
            setattr(moe_route, k, v)


def run_with_logits(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, weights, logits) of one router_topk call; the workspace is poisoned first, so every
    partial it reads was written by this call."""
    x, experts = inputs["x"], inputs["gate_weight"].shape[0]
    inputs["workspace"].partials.fill_(float("nan"))
    logits = torch.full((x.shape[0], experts), float("nan"), device=x.device)
    out = router_topk(**inputs, logits_out=logits)
    return out.ids, out.weights, logits


def same_outputs(want: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> bool:
    """Bit equality (NaN equal to NaN)."""
    return all(
        torch.equal(
            a.view(torch.int32) if a.is_floating_point() else a,
            b.view(torch.int32) if b.is_floating_point() else b,
        )
        for a, b in zip(want, got)
    )


def verify_candidates(inputs: dict[str, Any], names: list[str]) -> list[str]:
    """Names of the candidates whose outputs differ from the default launch shape's."""
    want = run_with_logits(inputs)
    bad = []
    for name in names:
        with patched(meta=CANDIDATES[name]):
            if not same_outputs(want, run_with_logits(inputs)):
                bad.append(name)
    return bad


def logits_invariant(
    make_inputs: Callable[[int, str], dict[str, Any]], m_values: tuple[int, ...], device: str
) -> bool:
    """Rows x[:M] routed at each M have the logits (and ids, weights) of the same rows routed at
    the largest M, bit for bit."""
    big = make_inputs(max(m_values), device)
    ids, weights, logits = run_with_logits(big)
    for m in m_values:
        sub = dict(big, x=big["x"][:m].contiguous(), n_valid=None)
        sub_ids, sub_weights, sub_logits = run_with_logits(sub)
        n_valid = int(big["n_valid"])  # rows past n_valid are padding in `big` only
        keep = min(m, n_valid)
        if not (
            same_outputs((logits[:m],), (sub_logits,))
            and same_outputs((ids[:keep], weights[:keep]), (sub_ids[:keep], sub_weights[:keep]))
        ):
            return False
    return True


def _timed(fn: Callable[[], Any], args: argparse.Namespace) -> float:
    return time_graph(fn, args.calls_per_graph, args.replays)[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="write the Markdown tables here")
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma list of M")
    p.add_argument("--calls-per-graph", type=int, default=20)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    p.add_argument(
        "--gemv-only",
        action="store_true",
        help="skip the launch-shape candidates (time the default shape only)",
    )
    args = p.parse_args()
    assert torch.cuda.is_available(), "sweep_router.py needs a GPU"
    m_values = tuple(int(v) for v in args.m.split(","))
    t0 = time.time()
    names = [DEFAULT] if args.gemv_only else [DEFAULT, *CANDIDATES]
    us: dict[tuple[str, int], float] = {}
    notes: list[str] = []
    compiled = torch.compile(router_topk_ref, dynamic=False)
    for m in m_values:
        inputs = _route_x_inputs(m, "cuda")
        _route_check(router_topk_ref(**inputs), router_topk(**inputs))
        bad = verify_candidates(inputs, names[1:])
        notes += [f"M={m}: `{name}` changed the outputs (a bug: excluded)" for name in bad]
        for name in names:
            if name in bad:
                continue
            with patched(meta=CANDIDATES.get(name)):
                us[name, m] = _timed(lambda x=inputs: router_topk(**x), args)
        if not args.no_compile:
            us["torch.compile(ref)", m] = _timed(lambda x=inputs: compiled(**x), args)
        print(f"M={m} done ({time.time() - t0:.0f} s)", flush=True)

    chain_us: dict[tuple[str, int], float] = {}
    chain_notes: list[str] = []
    for shape, consts in GEMV_SHAPES.items():
        with patched(gemv=consts):
            try:
                for m in m_values:
                    inputs = _route_x_inputs(m, "cuda")  # its workspace fits this K split
                    _route_check(router_topk_ref(**inputs), router_topk(**inputs))
                    chain_us[shape, m] = _timed(lambda x=inputs: router_topk(**x), args)
                if not logits_invariant(_route_x_inputs, m_values, "cuda"):
                    chain_notes.append(f"{shape}: logits depend on M (a bug)")
            except Exception as e:  # noqa: BLE001 - a shape that fails is reported, not fatal
                chain_notes.append(f"{shape}: failed: {type(e).__name__}: {str(e)[:120]}")
        print(f"GEMV {shape} done ({time.time() - t0:.0f} s)", flush=True)

    head = "| | " + " | ".join(f"M={m}" for m in m_values) + " |"
    rule = "|---" * (len(m_values) + 1) + "|"
    lines = [
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"default GEMV chains {moe_route._GEMV_CHAINS}; us per call (CUDA graph, median of "
        f"{args.replays} replays of {args.calls_per_graph} calls)",
        "",
        "## Launch shape (`_route_meta`, no numerics change)",
        "",
        head,
        rule,
    ]
    rows = names + ([] if args.no_compile else ["torch.compile(ref)"])
    for name in rows:
        label = f"{name} {tuple(CANDIDATES[name])}" if name in CANDIDATES else name
        lines.append(
            f"| {label} | "
            + " | ".join(f"{us[name, m]:.1f}" if (name, m) in us else "-" for m in m_values)
            + " |"
        )
    best = {m: min((n for n in names if (n, m) in us), key=lambda n: us[n, m]) for m in m_values}
    lines.append(
        "| **best** | " + " | ".join(f"{best[m]} {us[best[m], m]:.1f}" for m in m_values) + " |"
    )
    if not args.no_compile:
        lines.append(
            "| best / compile | "
            + " | ".join(f"{us[best[m], m] / us['torch.compile(ref)', m]:.2f}" for m in m_values)
            + " |"
        )
    defaults = ", ".join(f"M={m}: {tuple(moe_route._route_meta(m))}" for m in m_values)
    lines += [
        "",
        f"default = {defaults}",
        *notes,
        "",
        "## GEMV shapes (may change the logits' rounding: pick ONE for all M), default "
        "launch shape",
        "",
        head + " sum |",
        rule + "---|",
    ]
    for shape in GEMV_SHAPES:
        vals = [chain_us.get((shape, m), float("nan")) for m in m_values]
        lines.append(
            f"| {shape} | " + " | ".join(f"{v:.1f}" for v in vals) + f" | {sum(vals):.1f} |"
        )
    lines += [
        "",
        *(chain_notes or ["every GEMV shape: logits independent of M (checked)"]),
        "",
        f"(total {time.time() - t0:.0f} s)",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
