"""Probe: routed experts + route reduce at decode sizes, sorted path vs the per-token path, on one
device.

  sorted:    `moe_sort` -> `fused_moe` (grouped stage 1 with the activation, grouped stage 2)
             -> `moe_reduce` (4 launches);
  per-token: `moe_route_gate_up` -> `moe_token_down_reduce` (2 launches).

For each shape and M, both are first checked BIT-EQUAL (the engine picks one by M, so they must
agree), then timed ABBA in CUDA graphs whose `--calls` launches use as many routings (the
experts' weights then come from HBM as in a decode step). `--down-metas` also times stage 2
launch shapes (each one bit-checked too). This picks `experts.TOKEN_PATH_MAX_M` and
`moe_token_down._down_meta`. `--format fp8 | mxfp4` runs the experts kept as stored (random
codes and scales, `bench_quant_gemm.quantize_random`); shapes with a shared expert fold it as
the engine does (one more local expert, appended to every token's routes with weight 1), in
the format the checkpoint stores it: V4.1's FP8 32 x 32 beside MXFP4 routed experts is a
`MixedExperts` stack, as the rank model runs it.

Usage (device machine): python3 benchmark/kernels/probe_moe_token.py --out probe.md
    [--format mxfp4 --shapes dsv41_flash_ep4 --m 1,2,3,4,6,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_dspark.kernels.moe import grouped_gemm as moe_grouped_gemm  # noqa: E402
from sgl_dspark.kernels.moe import token_down as moe_token_down  # noqa: E402
from sgl_dspark.kernels.moe import token_gemm as moe_token_gemm  # noqa: E402
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import MixedExperts
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort, sort_block_size

from benchmark.kernels.bench_quant_gemm import quantize_random  # noqa: E402
from benchmark.kernels.run_all import time_graph  # noqa: E402

SHAPES = {  # name: (hidden D, routed I, local experts, experts, top-k, shared expert folded)
    "mid_910m": (1024, 512, 64, 64, 6, False),
    "dsv4_flash_ep4": (4096, 2048, 96, 384, 6, False),
    # the rank model's MoE: 96 local routed experts, top-6 among them, + the folded shared one
    "dsv41_flash_ep4": (5120, 2304, 96, 96, 6, True),
}
# The stored format of a folded shared expert beside routed experts kept as stored (V4.1: FP8
# with 32 x 32 blocks); a shape not named here stores it as its routed experts.
SHARED_FORMATS = {"dsv41_flash_ep4": ("fp8", 32)}
FORMAT_GROUPS = {"fp8": 128, "mxfp4": 32}
DOWN_METAS = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
    (16, 128, 4, 3),
    (16, 64, 4, 4),
    (16, 256, 4, 2),
    (8, 128, 4, 3),
    (16, 128, 8, 3),
    (32, 64, 4, 3),
]


def _experts(shape: str, fmt: str, gen: torch.Generator):
    d, inter, local, _, _, folded = SHAPES[shape]
    stacks = local + int(folded)
    shared = SHARED_FORMATS.get(shape)
    if fmt != "bf16" and folded and shared is not None and shared[0] != fmt:
        routed = _experts_stored((local, d, inter), fmt, FORMAT_GROUPS[fmt], gen)
        extra = _experts_stored((1, d, inter), *shared, gen)
        return tuple(MixedExperts(stack, one) for stack, one in zip(routed, extra))
    if fmt != "bf16":
        return _experts_stored((stacks, d, inter), fmt, FORMAT_GROUPS[fmt], gen)
    gate_up = torch.randn(
        stacks, 2 * inter, d, generator=gen, device="cuda", dtype=torch.bfloat16
    ) * (3 * d**-0.5)
    down = (
        torch.randn(stacks, d, inter, generator=gen, device="cuda", dtype=torch.bfloat16)
        * inter**-0.5
    )
    return gate_up, down


def _experts_stored(experts_d_i: tuple[int, int, int], fmt: str, group: int, gen):
    """(gate_up [E, 2I, D], down [E, D, I]) kept as stored, random."""
    experts, d, inter = experts_d_i
    return (
        quantize_random((experts, 2 * inter, d), fmt, group, gen),
        quantize_random((experts, d, inter), fmt, group, gen),
    )


# Launch shapes of the per-token stages that change no bit (BLOCK_N, pipeline depth, stage 2's
# slot groups), timed against the library's own (`_gate_up_meta`,
# `_down_meta`): each entry replaces those keys of the library's shape. Stage 2 with
# GROUP_SLOTS 8 holds all of V4.1's 6 + 1 slots in one program (the shape before slot groups).
STAGE_METAS = {
    "gate_up": [
        {"BLOCK_N": 32, "num_stages": 3},
        {"BLOCK_N": 64, "num_stages": 4},
        {"BLOCK_N": 64, "num_stages": 2},
        {"BLOCK_N": 128, "num_stages": 3},
        {"BLOCK_N": 128, "num_stages": 2},
    ],
    "down": [
        {"GROUP_SLOTS": 8, "BLOCK_N": 8, "num_stages": 3},
        {"GROUP_SLOTS": 1, "BLOCK_N": 32, "num_stages": 3},
        {"GROUP_SLOTS": 1, "BLOCK_N": 128, "num_stages": 3},
        {"GROUP_SLOTS": 1, "BLOCK_N": 64, "num_stages": 4},
        {"GROUP_SLOTS": 2, "BLOCK_N": 32, "num_stages": 3},
        {"GROUP_SLOTS": 2, "BLOCK_N": 16, "num_stages": 3},
    ],
    # The sorted path's grouped GEMMs (both stages, the stack's and the extra expert's
    # launches): `grouped_gemm._grouped_meta`.
    "sorted": [
        {"BLOCK_N": 32},
        {"BLOCK_N": 128},
        {"BLOCK_N": 16},
        {"num_stages": 2},
        {"BLOCK_N": 64, "num_stages": 2},
    ],
}
# Timed, rejected and no longer swept (benchmark/results/kernels.md): a 128-register cap for
# stage 2 (four programs an SM), eight warps for either stage (each its own slice of a dot),
# either stage dispatching the folded shared expert's programs (twice a routed slot's bytes)
# before the routed ones (the slot the grid's slowest dimension).
# stage: (module, name) of its launch-shape function
_META_NAMES = {
    "gate_up": (moe_token_gemm, "_gate_up_meta"),
    "down": (moe_token_down, "_down_meta"),
    "sorted": (moe_grouped_gemm, "_grouped_meta"),
}


def _with_shape(library, overrides: dict[str, int]):
    """The library's launch-shape function with some of its keys replaced."""
    return lambda *args: {**library(*args), **overrides}


def _stage_sweep(
    shape: str,
    m: int,
    paths: dict,
    calls: int,
    replays: int,
    stages: list[str],
    only: str | None = None,
) -> list[str]:
    """Each per-token stage of `stages` alone (or the whole sorted path, `sorted`): the
    library's launch shape, then each STAGE_METAS one (those whose label holds `only`, if
    given; bits against the library's, timed ABBA against it in CUDA graphs)."""
    paths["gate_up"]()  # stage 2's inputs
    rows = []
    for stage in stages:
        fn = paths[stage]
        module, name = _META_NAMES[stage]
        library = getattr(module, name)
        want = [t.clone() for t in fn()]
        for overrides in STAGE_METAS[stage]:
            variant = f"{stage} " + ", ".join(f"{k} {v}" for k, v in overrides.items())
            if only is not None and only not in variant:
                continue
            shaped = _with_shape(library, overrides)
            try:
                with mock.patch.object(module, name, shaped):
                    equal = _same_bits(want, fn())
                    v1 = time_graph(fn, 1, replays)[0]
                d1, d2 = (time_graph(fn, 1, replays)[0] for _ in range(2))
                with mock.patch.object(module, name, shaped):
                    v2 = time_graph(fn, 1, replays)[0]
                lib, var = (d1 + d2) / 2 / calls, (v1 + v2) / 2 / calls
                row = [shape, str(m), variant, str(equal), f"{lib:.1f}", f"{var:.1f}"]
                row.append(f"{lib / var:.2f}")
            except Exception as exc:  # noqa: BLE001
                row = [shape, str(m), variant, f"FAIL {type(exc).__name__}: {exc}"[:90], "", "", ""]
            rows.append("| " + " | ".join(row) + " |")
    return rows


def _setup(shape: str, m: int, calls: int, fmt: str = "bf16"):
    d, inter, local, experts, topk, folded = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(11 + m)
    gate_up, down = _experts(shape, fmt, gen)
    mask = torch.zeros(experts + int(folded), dtype=torch.int32)
    mask[:local] = 1
    mask[experts:] = 1  # the folded shared expert, local id `local`
    mask = mask.to("cuda")
    plan = prepare_moe_sort(mask)
    x = torch.randn(m, d, generator=gen, device="cuda").to(torch.bfloat16)
    shared = torch.randn(m, d, generator=gen, device="cuda").to(torch.bfloat16)
    routings = []
    for _ in range(calls):
        ids = torch.rand(m, experts, generator=gen, device="cuda").argsort(1)[:, :topk]
        w = torch.rand(m, topk, device="cuda")
        if folded:
            ids = torch.cat((ids, torch.full_like(ids[:, :1], experts)), dim=1)
            w = torch.cat((w, torch.ones_like(w[:, :1])), dim=1)
        routings.append((ids.to(torch.int32).contiguous(), w.contiguous()))
    topk += int(folded)
    block = sort_block_size(m, topk, plan.num_local)  # the engine's M tile
    outs = [torch.empty(m, d, dtype=torch.bfloat16, device="cuda") for _ in routings]
    # Stage 2's arrival counters as the engine keeps them (left zero by every launch): enough
    # for any launch shape timed here (a counter per column at most).
    arrivals = torch.zeros(m * d, dtype=torch.int32, device="cuda")
    hs = [torch.empty(m * topk, inter, dtype=torch.bfloat16, device="cuda") for _ in routings]

    def sorted_path() -> list[torch.Tensor]:
        for (ids, w), out in zip(routings, outs):
            sort = moe_sort(ids, w, plan, 0, block_size=block)
            y = fused_moe(x, gate_up, down, sort, topk, 10.0, block_size=block)
            moe_reduce(y, w, ids, mask, 1.0, shared, out=out)
        return outs

    def gate_up_stage() -> list[torch.Tensor]:
        for (ids, _), h in zip(routings, hs):
            moe_token_gemm.moe_route_gate_up(
                x, gate_up, ids, plan.local_table, plan.num_local, 10.0, h=h
            )
        return hs

    def down_stage() -> list[torch.Tensor]:
        for (ids, w), h, out in zip(routings, hs, outs):
            moe_token_down.moe_token_down_reduce(
                h,
                down,
                ids,
                w,
                plan.local_table,
                plan.num_local,
                1.0,
                shared,
                out=out,
                arrivals=arrivals,
            )
        return outs

    def token_path() -> list[torch.Tensor]:
        gate_up_stage()
        return down_stage()

    return {
        "sorted": sorted_path,
        "token": token_path,
        "gate_up": gate_up_stage,
        "down": down_stage,
    }


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(u.view(torch.int16), v.view(torch.int16)) for u, v in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--m", default="1,2,4,7,8,12,16,32")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--down-metas", action="store_true")
    p.add_argument(
        "--stage-metas",
        action="store_true",
        help="instead: each per-token stage alone at the STAGE_METAS launch shapes",
    )
    p.add_argument(
        "--stages", default="gate_up,down", help="the stages --stage-metas sweeps (comma list)"
    )
    p.add_argument(
        "--only", default=None, help="--stage-metas: only the variants whose label holds this"
    )
    p.add_argument("--format", default="bf16", choices=("bf16", *FORMAT_GROUPS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    lines = [
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  experts {a.format}",
        "",
        (
            "| shape | M | variant | bits equal library | library us | variant us | ratio |"
            if a.stage_metas
            else "| shape | M | variant | bits equal sorted | sorted us | per-token us | ratio |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    default_meta = moe_token_down._down_meta
    metas = DOWN_METAS if a.down_metas else [None]
    for shape in a.shapes.split(","):
        for m in (int(v) for v in a.m.split(",")):
            paths = _setup(shape, m, a.calls, a.format)
            if a.stage_metas:
                stages = a.stages.split(",")
                sweep = _stage_sweep(shape, m, paths, a.calls, a.replays, stages, a.only)
                for line in sweep:
                    lines.append(line)
                    print(line, flush=True)
                    if a.out:
                        Path(a.out).write_text("\n".join(lines) + "\n")
                continue
            sorted_path, token_path = paths["sorted"], paths["token"]
            want = [t.clone() for t in sorted_path()]
            for meta in metas:
                if meta is not None:
                    bn, bk, warps, stages = meta
                    moe_token_down._down_meta = lambda k, w_, n, bn=bn, bk=bk, w=warps, s=stages: {
                        **default_meta(k, w_, n),  # its slot groups
                        "BLOCK_N": bn,
                        "BLOCK_K": bk,
                        # the library's K split where the warps allow it (one slice each)
                        "SPLIT_K": moe_token_down.expert_split_k(bk, w_) if w == 4 else 1,
                        "num_warps": w,
                        "num_stages": s,
                    }
                try:
                    equal = _same_bits(want, token_path())
                    s1, t1 = (time_graph(f, 1, a.replays)[0] for f in (sorted_path, token_path))
                    t2, s2 = (time_graph(f, 1, a.replays)[0] for f in (token_path, sorted_path))
                    srt, tok = (s1 + s2) / 2 / a.calls, (t1 + t2) / 2 / a.calls
                    row = [
                        shape,
                        str(m),
                        str(meta or "default"),
                        str(equal),
                        f"{srt:.1f}",
                        f"{tok:.1f}",
                        f"{srt / tok:.2f}",
                    ]
                except Exception as exc:  # noqa: BLE001
                    row = [
                        shape,
                        str(m),
                        str(meta),
                        f"FAIL {type(exc).__name__}: {exc}"[:90],
                        "",
                        "",
                        "",
                    ]
                finally:
                    moe_token_down._down_meta = default_meta
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
                if a.out:
                    Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
