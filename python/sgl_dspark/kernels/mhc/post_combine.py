"""mHC sublayer boundary in two launches of one kernel (`boundary_kernel.py`; `mhc_post_combine_ref`
and `mhc_pre_ref` are the spec, `reference.py` gives the math); this module launches it.

One call closes a sublayer and opens the next one, no atomics, no host reads:
  A. grid (row tiles, D slices): Rs' on the slice, and per row the slice's partial fn projection
     and sum of squares, into an fp32 scratch [M, slices, RP] (`stream_update.py`). The streams
     are separate vectors and their coefficients scalars, so the update runs in each thread
     without reductions across streams.
  B. grid (M, 2): (row, 0) sums the row's partials into pre', then collapses and norms the whole
     row; (row, 1) forms post' and comb', keeping Sinkhorn off the collapse's critical path
     (`coefficients.py`).
`mhc_pre` opens the first sublayer: the same launches without the stream update.

Single-pass mHC (DeepSeek-V4.1): a site collapses its sublayer input with the PREVIOUS site's
pre. `collapse_pre` (both launchers) takes that pre in and the new pre' still comes out. Known
before the launch, it lets phase A collapse its slice too (`collapse_in_stream_pass`): x_in
and its partial sum of squares come out of phase A, and phase B is (row, 0) forming pre',
post' and comb' and (row, 1 + c) norming x_in's chunk c, one warp each (a phase B of one
16-warp program per row reading the n streams was slower at every batch size timed:
`benchmark/results/kernels.md`). `mhc_post_collapse` closes a sublayer and collapses with a
given pre without computing any coefficients (before an Engram layer, and the final norm):
phase A without the projection, phase B the norm chunks only.

The coefficients apart (`coeffs_scope`): in a single-pass boundary nothing the next sublayer
reads waits for pre', post' and comb' (its input was collapsed with the previous pre), yet in
one phase-B launch the norm's consumer waits for the whole grid, the coefficients' Sinkhorn
chain included. With a scope, the coefficients' program is a launch of its own inside it (the
model's boundaries fork it to a side stream while a CUDA graph is captured) and the norm chunks
are the current stream's phase B: the Sinkhorn chain then runs beside the next sublayer's
GEMMs, and only the next boundary, which reads the coefficients, waits for it.

Exactness: ``Rs'`` is bit-exact against the reference on any backend (elementwise, fixed operand
order, FMA contraction off, bf16 rounding on the bits), and so is ``x_in`` collapsed with a given
``collapse_pre``. The coefficients, ``x_in`` collapsed with pre' and the normed input go through
split reductions and ``exp``/``sigmoid`` whose order and lowering differ from
torch: within a tolerance. Every tree is fixed by (n, D) (slice width, partial layout and warp
counts depend on n and D only; phase A runs the same unrolled code for each row of a tile), so
a row's result never depends on M, on its position in the batch or on the grid.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import triton

from sgl_dspark.kernels._checks import check_tensor, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, register_cap
from sgl_dspark.kernels.fp8.act_quant import check_group
from sgl_dspark.kernels.fp8.reference import Fp8ActFormat, Fp8Activation
from sgl_dspark.kernels.mhc.boundary_kernel import _mhc_post_combine_kernel
from sgl_dspark.kernels.mhc.reference import MhcPostCollapseOutput, MhcPostCombineOutput

# Phase A D-slice width, the same for every D: a model of D = 4096 spreads a one-row boundary
# over 64 programs. Smaller models take fewer slices rather than narrower ones: a slice pays
# its row's scalar loads (post, comb, pre) whatever its width, and the Triton interpreter
# (CPU tests) pays per program. A constant, it fixes the split reductions' trees.
_BLOCK_D = 64
# Phase A rows per program: up to _MAX_TILED_ROWS rows in the batch, grows with M so that fn
# (r·n·D fp32, 1.5 MB at D = 4096) is read by about _TARGET_ROW_TILES row tiles, at most
# _MAX_BLOCK_M rows a program. Above, one row a program: the rows alone give the grid enough
# programs (M x slices), and the lightest programs, the most an SM, were the fastest there; a
# 16-row tile (two programs an SM, each its rows in sequence) took about twice as long at 48 to
# 128 rows, 8- and 4-row tiles up to half as long again (`benchmark/results/kernels.md`).
_TARGET_ROW_TILES = 4
_MAX_TILED_ROWS = 32
_MAX_BLOCK_M = triton.next_power_of_2(triton.cdiv(_MAX_TILED_ROWS, _TARGET_ROW_TILES))  # 8
# Phase A warps: at sm90, 1 warp holds the n fn tiles in too few threads (spills at 8 rows a
# program) and 2 warps take more barriers than 4 (probe_quant_sass-style SASS counts).
_PHASE_A_WARPS = 4
# Phase A's registers a thread on NVIDIA for the single-pass row tile of _CAPPED_BLOCK_M rows of
# _CAPPED_STREAMS streams (V4.1's): three programs of four warps an SM. Uncapped, 8 rows a
# program with the collapse (V4.1) compile to 180 at sm90, two programs an SM, so 32 rows over
# 80 slices (320 programs) ran in 1.2 waves; at 168 they compile without spilling and fit one
# (timed in
# `benchmark/results/kernels.md`). Nowhere else: smaller tiles and V4's two-pass tiles already
# fit three an SM, and the cap only reschedules them (2 rows were slower under it).
_PHASE_A_MAX_REGISTERS = 168
_CAPPED_BLOCK_M = 8
_CAPPED_STREAMS = 4


def _phase_a_registers(block_m: int, collapse_in_a: bool, n: int) -> int | None:
    """Phase A's register cap (None: the compiler's choice) for a row tile of `block_m` rows of
    n streams (more streams need more registers: a cap set for four could make them spill)."""
    capped = collapse_in_a and block_m == _CAPPED_BLOCK_M and n == _CAPPED_STREAMS
    return _PHASE_A_MAX_REGISTERS if capped else None


# Phase B: rows up to this width stay in registers; wider ones are chunked (norm re-reads x_in).
_MAX_FINISH_BLOCK = 8192
# Phase B after phase A collapsed: columns a norm program takes (at least an FP8 group), and
# the launch's warps: one, so that the coefficients' reductions (Sinkhorn's chain of them, on
# the critical path) stay within a warp; a norm program then holds 32 columns a thread.
_NORM_BLOCK = 1024
_NORM_WARPS = 1

# A scope the coefficients' launch is issued in (`coeffs_scope` of the launchers), called with
# the scratch that launch reads (phase A's partials), which the scope keeps alive until its work
# is done (e.g. until the stream it forked is joined).
CoefficientsScope = Callable[[torch.Tensor], AbstractContextManager[object]]


def collapse_in_stream_pass(collapse_pre: torch.Tensor | None) -> bool:
    """Whether phase A collapses x_in (possible only with the collapse pre given: single-pass
    mHC). Phase B then reads x_in (D values a row) instead of Rs' (n·D), and its norm spreads
    over several programs of few warps, which also shortens the coefficients' Sinkhorn chain
    (its reductions cross fewer warps) instead of one program of 16 warps holding the row."""
    return collapse_pre is not None


def _rows_per_program(m: int) -> int:
    """Phase-A rows per program: 1 at small M (most programs), more up to _MAX_TILED_ROWS rows
    (fewer fn reads), 1 again above (the constants' comment). Free to depend on M: a row's
    arithmetic is the same whatever the tile size."""
    if m > _MAX_TILED_ROWS:
        return 1
    return min(_MAX_BLOCK_M, triton.next_power_of_2(triton.cdiv(m, _TARGET_ROW_TILES)))


def mhc_post_combine(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    out: MhcPostCombineOutput | None = None,
    collapse_pre: torch.Tensor | None = None,
    fp8_out: Fp8ActFormat | None = None,
    coeffs_scope: CoefficientsScope | None = None,
) -> MhcPostCombineOutput:
    """`mhc_post_combine_ref` in two launches of one kernel, no host sync.

    Args:
        streams: [M, n, D] fp32 or bf16, contiguous: this sublayer's input streams Rs.
        y: [M, D], streams' dtype: this sublayer's output.
        post, comb: [M, n] / [M, n, n] fp32: this sublayer's expand weights and mixing matrix.
        fn, base, scale: fp32 [(2+n)·n, n·D] / [(2+n)·n] / [3]: the NEXT hyper-connection.
        norm_weight: [D] fp32 or bf16: the NEXT sublayer's RMSNorm weight.
        hc_eps, sinkhorn_iters (>= 1), rms_eps: the hyper-connection's constants.
        out: optional preallocated outputs (shapes/dtypes as returned).
        collapse_pre: [M, n] fp32, single-pass mHC: x_in collapses Rs' with it (the closed
            site's pre) instead of pre'.
        fp8_out: also write the normed input's per-token-group FP8 form (the next sublayer's
            W8A8 GEMMs read it): `quantize_act_fp8_ref(x_normed, *fp8_out)`, bit-exact (the
            quantiser runs on the stored values in phase B; nothing else changes).
        coeffs_scope: single pass only (collapse_pre given): phase B's coefficient programs
            (pre', post', comb') run as a launch of their own, issued inside this scope (e.g.
            a side stream forked from the current one), and only the norm's programs follow on
            the current stream: the next sublayer, which reads x_normed, no longer waits for
            the Sinkhorn chain. The same programs run, so the same bits come out. The scope is
            called with the partials the launch reads and keeps them alive until its work is
            done; the caller keeps pre', post' and comb' and orders every read of them (and
            their release) after that work.
    Returns:
        MhcPostCombineOutput(streams', pre', post', comb', x_in, x_normed, x_fp8).
    """
    return _launch(
        streams,
        (y, post, comb),
        (fn, base, scale),
        norm_weight,
        hc_eps=hc_eps,
        sinkhorn_iters=sinkhorn_iters,
        rms_eps=rms_eps,
        out=out,
        collapse_pre=collapse_pre,
        fp8_out=fp8_out,
        coeffs_scope=coeffs_scope,
    )


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    out: MhcPostCombineOutput | None = None,
    collapse_pre: torch.Tensor | None = None,
    fp8_out: Fp8ActFormat | None = None,
    coeffs_scope: CoefficientsScope | None = None,
) -> MhcPostCombineOutput:
    """`mhc_pre_ref` (open the first sublayer): `mhc_post_combine`'s launches without the
    stream update, so bit-identical to it with post = 0 and comb = I. The result's ``streams``
    is the input itself (``out.streams`` is not written). Arguments as mhc_post_combine."""
    return _launch(
        streams,
        None,
        (fn, base, scale),
        norm_weight,
        hc_eps=hc_eps,
        sinkhorn_iters=sinkhorn_iters,
        rms_eps=rms_eps,
        out=out,
        collapse_pre=collapse_pre,
        fp8_out=fp8_out,
        coeffs_scope=coeffs_scope,
    )


def mhc_post_collapse(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    collapse_pre: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    rms_eps: float,
) -> MhcPostCollapseOutput:
    """`mhc_post_collapse_ref`: close a sublayer (Rs'), collapse Rs' with `collapse_pre`
    [M, n] fp32 and apply the weighted RMSNorm, computing no coefficients (single-pass mHC
    before an Engram layer, and into the final norm). Two launches; other arguments as
    mhc_post_combine. Returns MhcPostCollapseOutput(streams', x_in, x_normed)."""
    out = _launch(
        streams,
        (y, post, comb),
        None,
        norm_weight,
        hc_eps=0.0,
        sinkhorn_iters=1,
        rms_eps=rms_eps,
        out=None,
        collapse_pre=collapse_pre,
        fp8_out=None,
    )
    return MhcPostCollapseOutput(out.streams, out.x_in, out.x_normed)


def _launch(
    streams: torch.Tensor,
    update: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    coeffs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    rms_eps: float,
    out: MhcPostCombineOutput | None,
    collapse_pre: torch.Tensor | None,
    fp8_out: Fp8ActFormat | None,
    coeffs_scope: CoefficientsScope | None = None,
) -> MhcPostCombineOutput:
    require(streams.dim() == 3, f"streams: expected [M, n, D], got shape {tuple(streams.shape)}")
    m, n, d = streams.shape
    dev, act = streams.device, streams.dtype
    require(act in (torch.float32, torch.bfloat16), f"streams: dtype must be fp32/bf16, got {act}")
    require(n >= 1 and d >= 1, f"streams: n and D must be positive, got n={n}, D={d}")
    require(sinkhorn_iters >= 1, f"sinkhorn_iters: must be >= 1, got {sinkhorn_iters}")
    r = (2 + n) * n
    f32 = (torch.float32,)
    check_tensor("streams", streams, (m, n, d), (act,), dev)
    if update is not None:
        y, post, comb = update
        check_tensor("y", y, (m, d), (act,), dev)
        check_tensor("post", post, (m, n), f32, dev)
        check_tensor("comb", comb, (m, n, n), f32, dev)
    else:  # never read by the kernel (HAS_UPDATE false)
        y = post = comb = streams
    if coeffs is not None:
        fn, base, scale = coeffs
        check_tensor("fn", fn, (r, n * d), f32, dev)
        check_tensor("base", base, (r,), f32, dev)
        check_tensor("scale", scale, (3,), f32, dev)
    else:  # never read by the kernel (HAS_COEFFS false)
        require(collapse_pre is not None, "a boundary without coefficients needs collapse_pre")
        fn = base = scale = norm_weight
    if collapse_pre is not None:
        check_tensor("collapse_pre", collapse_pre, (m, n), f32, dev)
    check_tensor("norm_weight", norm_weight, (d,), (torch.float32, torch.bfloat16), dev)
    require(
        coeffs_scope is None or (coeffs is not None and collapse_in_stream_pass(collapse_pre)),
        "coeffs_scope: only a single-pass boundary (collapse_pre given) that forms coefficients "
        "launches them apart",
    )

    out_shapes = [(m, n, d), (m, n), (m, n), (m, n, n), (m, d), (m, d)]
    out_dtypes = [act, torch.float32, torch.float32, torch.float32, act, act]
    if out is None:
        streams_out, pre_out, post_out, comb_out, x_in_out, x_normed_out = (
            torch.empty(shape, dtype=dt, device=dev) for shape, dt in zip(out_shapes, out_dtypes)
        )
        out = MhcPostCombineOutput(streams_out, pre_out, post_out, comb_out, x_in_out, x_normed_out)
    for name, t, shape, dt in zip(out._fields, out[:6], out_shapes, out_dtypes):
        assert isinstance(t, torch.Tensor)
        check_tensor(f"out.{name}", t, shape, (dt,), dev)
    if update is None:
        out = out._replace(streams=streams)
    if fp8_out is not None:
        check_group(fp8_out.group)
        out = out._replace(
            x_fp8=Fp8Activation(
                torch.empty(m, d, dtype=torch.float8_e4m3fn, device=dev),
                torch.empty(m, triton.cdiv(d, fp8_out.group), dtype=torch.float32, device=dev),
            )
        )
    if m == 0:
        return out

    block_d, block_m = _BLOCK_D, _rows_per_program(m)
    num_slices = triton.cdiv(d, block_d)
    collapse_in_a = collapse_in_stream_pass(collapse_pre)
    # fn projection columns, then the sums of squares of Rs' and of x_in
    rp = triton.next_power_of_2(r + 2)
    finish_block = min(_MAX_FINISH_BLOCK, triton.next_power_of_2(d))
    fp8_group = fp8_out.group if fp8_out is not None else 1
    norm_block = min(triton.next_power_of_2(d), max(_NORM_BLOCK, fp8_group))
    partials = torch.empty(
        m if coeffs is not None or collapse_in_a else 0,
        num_slices,
        rp,
        dtype=torch.float32,
        device=dev,
    )
    args = (
        streams,
        y,
        post,
        comb,
        fn,
        base,
        scale,
        norm_weight,
        *out[:6],
        partials,
        collapse_pre if collapse_pre is not None else post,
        out.x_fp8.q.view(torch.uint8) if out.x_fp8 is not None else post,  # E4M3 bit patterns
        out.x_fp8.scale if out.x_fp8 is not None else post,
        m,
        float(hc_eps),
        float(rms_eps),
    )
    meta = dict(
        D=d,
        NUM_SLICES=num_slices,
        SINKHORN_ITERS=int(sinkhorn_iters),
        N=n,
        NP=triton.next_power_of_2(n),
        RP=rp,
        SP=triton.next_power_of_2(num_slices),
        BLOCK_D=block_d,
        FINISH_BLOCK=finish_block,
        ROUND_BF16=act == torch.bfloat16,
        HAS_UPDATE=update is not None,
        HAS_COEFFS=coeffs is not None,
        PREV_PRE=collapse_pre is not None,
        FP8_OUT=fp8_out is not None,
        FP8_GROUP=fp8_group,
        UE8M0=fp8_out is not None and fp8_out.ue8m0,
        COLLAPSE_IN_A=collapse_in_a,
        NORM_BLOCK=norm_block,
        enable_fp_fusion=False,
        **programmatic_launch(_mhc_post_combine_kernel, dev),
    )
    _mhc_post_combine_kernel[(triton.cdiv(m, block_m), num_slices)](
        *args,
        PHASE=0,
        BLOCK_M=block_m,
        FIRST_PART=0,
        num_warps=_PHASE_A_WARPS,
        **register_cap(dev, _phase_a_registers(block_m, collapse_in_a, n)),
        **meta,
    )
    # BLOCK_M is unused by phase B: a fixed value keeps one compiled variant for every M.
    if collapse_in_a:
        norm_chunks = triton.cdiv(d, norm_block)
        if coeffs_scope is not None:
            # The coefficients' programs apart (the same programs, so the same bits), inside
            # the caller's scope, which holds the partials they read (`record_stream` would,
            # during a graph capture, keep every boundary's partials from reuse until the
            # capture ends); only the norm chunks stay before the next sublayer.
            with coeffs_scope(partials):
                _mhc_post_combine_kernel[(m, 1)](
                    *args, PHASE=1, BLOCK_M=1, FIRST_PART=0, num_warps=_NORM_WARPS, **meta
                )
            _mhc_post_combine_kernel[(m, norm_chunks)](
                *args, PHASE=1, BLOCK_M=1, FIRST_PART=1, num_warps=_NORM_WARPS, **meta
            )
            return out
        grid_b = (m, int(coeffs is not None) + norm_chunks)
        warps_b = _NORM_WARPS
    else:
        # About 512 row elements per warp, i.e. n fp32 stream values of 16 columns per thread.
        grid_b = (m, 2 if coeffs is not None else 1)
        warps_b = min(16, max(4, finish_block // 512))
    _mhc_post_combine_kernel[grid_b](
        *args, PHASE=1, BLOCK_M=1, FIRST_PART=0, num_warps=warps_b, **meta
    )
    return out
