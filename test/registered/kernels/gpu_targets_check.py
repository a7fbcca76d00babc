"""Ahead-of-time compilation of kernels for the GPU targets, on a machine without a GPU.

Run by `test_gpu_targets.py` in a subprocess without `TRITON_INTERPRET` (under the interpreter
`@triton.jit` yields interpreter objects that cannot be compiled); also runnable by hand:
`python test/registered/kernels/gpu_targets_check.py [case ...]`, or `--all`: every kernel the
hand-written cases and the launchers of `benchmark/kernels` (DeepSeek-V4-Flash shapes, M = 1 and
32) launch.

The CPU interpreter runs a kernel's semantics but never its GPU compilation, so a kernel can pass
every CPU test and still fail on a device: a construct the backend rejects, or a tile whose
pipeline needs more shared memory than an SM has (Triton raises that only when loading the
binary on the device). Each case calls a launcher exactly as the runtime does, with CPU tensors
and the kernel object replaced by a recorder, then compiles every recorded launch with Triton's
own toolchain for the two GPU targets, NVIDIA sm90 and AMD gfx950, and checks its shared memory
against the device's per-block limit. The launches themselves are not run here (the CPU tests
and the compiled device tests do that)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

# Per-block shared memory limits: sm90 227 KB opt-in, gfx950 160 KB of LDS.
TARGETS = {
    "sm90": (GPUTarget("cuda", 90, 32), 232448),
    "gfx950": (GPUTarget("hip", "gfx950", 64), 163840),
}
# Targets compiled only for the instruction checks that name them (Blackwell: 228 KB).
INSTRUCTION_TARGETS = {"sm100": (GPUTarget("cuda", 100, 32), 232448)}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
# Constexprs a launcher sets from the device it runs on: a launch recorded with CPU tensors
# compiles for each target with the value that target's device gets (`PTX`:
# `linear.weight_loads.fp4_ptx_decode`, the inline-PTX MXFP4 decode on NVIDIA only).
_TARGET_CONSTEXPRS = {"PTX": lambda target: target.backend == "cuda"}


def on_target(kwargs: dict, target: GPUTarget) -> dict:
    """A recorded launch's arguments with the constexprs its launcher sets per device taken as
    `target`'s device would set them."""
    return {
        k: _TARGET_CONSTEXPRS[k](target) if k in _TARGET_CONSTEXPRS else v
        for k, v in kwargs.items()
    }


_KERNEL_MODULES = (
    "moe.activation",
    "compressor.pool",
    "compressor.entry_rows",
    "compressor.pair_pool",
    "attention.draft",
    "spec.draft_inputs",
    "indexer.fp4_q_rope",
    "moe.grouped_gemm",
    "indexer.topk",
    "indexer.logits",
    "spec.markov",
    "mhc.post_combine",
    "moe.reduce",
    "moe.router",
    "moe.hash_gemv",
    "moe.sort",
    "moe.token_gemm",
    "moe.token_down",
    "norm.rmsnorm",
    "rope.tail",
    "rope.q_kv",
    "linear.small_m",
    "linear.quantized",
    "linear.dequantize",
    "attention.window_sparse",
    "spec.accept",
    "sampling.vocab_argmax",
    "indexer.fp4_k_quant",
    "quant.store",
    "quant.load",
    "engram.gather",
    "engram.gate",
    "indexer.v41_logits",
    "fp8.act_quant",
    "fp8.w8a8",
    "fp8.mx_moe",
)
# Benchmark cases whose CPU inputs are too large for CI (the fused MoE holds 96 DSV4-Flash
# experts, ~5 GB); their kernels are covered by the small direct cases below.
_HEAVY_BENCH_CASES = ("fused_moe stage 1", "moe_token_down_reduce")


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn) -> None:
        # A recorder may stand in for another one (`--all` records every kernel, then the
        # instruction checks record their cases again): keep the JIT function.
        self.fn = fn.fn if isinstance(fn, _Recorder) else fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))

        return launch


def _kernel_modules() -> list:
    return [importlib.import_module(f"sgl_dspark.kernels.{m}") for m in _KERNEL_MODULES]


def record_launches(module: str, kernel: str, run: Callable[[], object]) -> _Recorder:
    """The launches of `module.kernel` that `run` makes (`benchmark/kernels/probe_quant_sass.py`
    disassembles them too)."""
    mod = importlib.import_module(module)
    real = getattr(mod, kernel)
    rec = _Recorder(real)
    setattr(mod, kernel, rec)
    # The launcher may launch other kernels too (the hash GEMV, then the routing launch): they
    # record into throwaway recorders, so nothing runs on the CPU tensors.
    others = {
        m: {
            n: o
            for n, o in vars(m).items()
            if n.endswith("_kernel") and o is not rec and type(o).__name__ == "JITFunction"
        }
        for m in _kernel_modules()
    }
    for m, kernels in others.items():
        for n, o in kernels.items():
            setattr(m, n, _Recorder(o))
    try:
        run()
    finally:
        setattr(mod, kernel, real)
        for m, kernels in others.items():
            for n, o in kernels.items():
                setattr(m, n, o)
    assert rec.calls, f"{module}.{kernel} was not launched"
    return rec


def launch_source(fn, args: tuple, kwargs: dict, target: GPUTarget) -> tuple[ASTSource, dict]:
    """The compilation a launch of `fn` with these arguments gets on `target`, specialised as
    Triton's launcher specialises it: pointers 16-byte aligned and integers divisible by 16
    marked so, integers equal to 1 made constants (what decides vector widths, and through
    them the software pipeline's shared memory). The CPU tensors stand in for device ones of
    the same offsets (device allocations are aligned at least as well)."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    call = {k: v for k, v in kwargs.items() if k in fn.arg_names or k in _OPTIONS}
    bound, specialization, options = binder(*args, **call)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, call, bound, specialization, options
    )
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return src, {k: v for k, v in kwargs.items() if k in _OPTIONS}


def _compile_all(rec: _Recorder, instructions: dict[str, str] | None = None) -> list[str]:
    """Compile every distinct recorded launch for every target; returns report lines.
    `instructions`: per target, a regular expression the assembly (PTX / AMDGCN) must match
    (the matrix instruction a kernel exists to use); such kernels compile with the run-time
    specialisation (`launch_source`)."""
    report = []
    seen = set()
    for args, kwargs in rec.calls:
        # A launch compiles anew for other constexprs or other argument types (an FP8 pool).
        src, options = launch_source(rec.fn, args, kwargs, TARGETS["sm90"][0])
        key = (src.hash(), tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        extra = {k: v for k, v in INSTRUCTION_TARGETS.items() if k in (instructions or {})}
        for name, (target, smem_limit) in {**TARGETS, **extra}.items():
            src, options = launch_source(rec.fn, args, on_target(kwargs, target), target)
            compiled = triton.compile(src, target=target, options=options)
            shared = compiled.metadata.shared
            assert shared <= smem_limit, (name, kwargs, shared)
            want = (instructions or {}).get(name)
            if want is not None:
                asm = compiled.asm["ptx" if target.backend == "cuda" else "amdgcn"]
                assert re.search(want, asm), (name, "no instruction matching", want)
            report.append(f"{name} shared={shared}")
    return report


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def _small_m_linear(n: int, k: int, dtype: torch.dtype) -> Callable[[], object]:
    from sgl_dspark.kernels.linear.small_m import small_m_linear

    return lambda: small_m_linear(torch.randn(3, k).to(dtype), torch.randn(n, k).to(dtype))


def _router_from_x(hidden: int, dtype: torch.dtype) -> Callable[[], object]:
    from sgl_dspark.kernels.moe.reference import RouterConfig
    from sgl_dspark.kernels.moe.router import router_topk

    # H < 512: the GEMV's K loop runs several times and is software-pipelined (the tiny model).
    return lambda: router_topk(
        RouterConfig(2),
        x=torch.randn(3, hidden).to(dtype),
        gate_weight=torch.randn(16, hidden).to(dtype),
    )


def _hash_router_from_x(hidden: int) -> Callable[[], object]:
    from sgl_dspark.kernels.moe.reference import RouterConfig
    from sgl_dspark.kernels.moe.router import router_topk

    # The mid model's hash layers: top-6 of 64 experts, H 1024, a shared column.
    return lambda: router_topk(
        RouterConfig(6, num_shared=1),
        x=_bf16(3, hidden),
        gate_weight=_bf16(64, hidden),
        tid2eid=torch.zeros(50, 6, dtype=torch.int32),
        input_ids=torch.tensor([4, 9, 1]),
    )


def _compressor_decode(head_dim: int, ratio: int, overlap: bool) -> Callable[[], object]:
    from sgl_dspark.kernels.compressor.decode import compressor_decode

    width = 2 * head_dim if overlap else head_dim
    span = 2 * ratio if overlap else ratio
    ring = triton.next_power_of_2(span + 16)

    def run() -> None:
        t = 2
        compressor_decode(
            _bf16(t, width),
            _bf16(t, width),
            _bf16(3, ring, width),
            _bf16(3, ring, width),
            torch.randn(ratio, width),
            torch.ones(head_dim),
            torch.tensor([7, 8]),
            torch.tensor([1, 1]),
            torch.tensor([7, 7]),
            torch.zeros(3, 256, dtype=torch.int64),
            ratio,
            overlap,
            1e-6,
            torch.ones(t, head_dim // 4),
            torch.zeros(t, head_dim // 4),
            _bf16(64, head_dim),
        )

    return run


_MHC_STREAMS = 4  # V4's and V4.1's hc


def _mhc_inputs(m: int, d: int) -> tuple[tuple, tuple]:
    """An mHC boundary's inputs at m rows of width d over `_MHC_STREAMS` streams: (the stream
    update's residual, sublayer output, post and comb; the heads' fn, base, scale and norm
    weight). A pre (`collapse_pre`) is shaped as post."""
    n, r = _MHC_STREAMS, 24
    update = (_bf16(m, n, d), _bf16(m, d), torch.rand(m, n), torch.rand(m, n, n))
    heads = (torch.randn(r, n * d), torch.randn(r), torch.ones(3), torch.ones(d))
    return update, heads


def _mhc(d: int, opening: bool) -> Callable[[], object]:
    from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine, mhc_pre

    def run() -> None:
        update, heads = _mhc_inputs(2, d)
        kw = dict(hc_eps=1e-6, sinkhorn_iters=20, rms_eps=1e-6)
        if opening:
            mhc_pre(update[0], *heads, **kw)
        else:
            mhc_post_combine(*update, *heads, **kw)

    return run


def _index_topk(width: int, k: int) -> Callable[[], object]:
    from sgl_dspark.kernels.indexer.topk import index_topk

    return lambda: index_topk(torch.randn(2, width), torch.tensor([width, width // 2]), k)


def _markov(vocab: int, rank: int, batch: int) -> Callable[[], object]:
    from sgl_dspark.kernels.spec.markov import markov_greedy

    return lambda: markov_greedy(
        torch.randn(batch, 7, vocab),
        _bf16(vocab, rank),
        _bf16(vocab, rank),
        torch.zeros(batch, dtype=torch.int64),
    )


def _rope_store() -> Callable[[], object]:
    from sgl_dspark.kernels.rope.tail import rope_tail

    return lambda: rope_tail(
        _bf16(3, 1, 128),
        torch.ones(3, 32),
        torch.zeros(3, 32),
        out=_bf16(50, 1, 128),
        out_rows=torch.tensor([4, 9, 1]),
    )


def _rope_q_store_kv_v41() -> Callable[[], object]:
    from sgl_dspark.kernels.rope.q_kv import rope_q_quant_store_kv

    # DeepSeek-V4.1-Flash: 64 query heads of 512 (weightless head norm), the KV row of 512 into
    # the FP8 window cache (one exponent byte per 32), a rope tail of 64.
    cs = torch.zeros(2, 32)
    return lambda: rope_q_quant_store_kv(
        _bf16(2, 64, 512),
        cs,
        cs,
        _bf16(2, 512),
        torch.tensor([3, 9]),
        torch.zeros(20, 512, dtype=torch.uint8),
        torch.zeros(20, 16, dtype=torch.uint8),
        "fp8_window",
        q_norm_eps=1e-6,
    )


def _rope_q_kv_store() -> Callable[[], object]:
    from sgl_dspark.kernels.rope.q_kv import rope_q_kv

    # The mid model's layer: 16 q heads of 128 (weightless norm), the KV row normed and stored.
    return lambda: rope_q_kv(
        _bf16(3, 16, 128),
        _bf16(3, 128),
        torch.ones(3, 32),
        torch.zeros(3, 32),
        q_norm_eps=1e-6,
        kv_norm_eps=1e-6,
        kv_norm_weight=torch.ones(128),
        kv_out=_bf16(50, 128),
        kv_rows=torch.tensor([4, 9, 1]),
    )


def _rms_norm_strided() -> Callable[[], object]:
    from sgl_dspark.kernels.norm.rmsnorm import rms_norm

    return lambda: rms_norm(_bf16(4, 1500)[:, 100:1124], torch.ones(1024), 1e-6)


def _rms_norm_pair() -> Callable[[], object]:
    from sgl_dspark.kernels.norm.rmsnorm import rms_norm_pair

    # DeepSeek-V4.1-Flash's q_a (1024) and kv (512) norms, column blocks of the x projection.
    joint = _bf16(2, 4096)
    return lambda: rms_norm_pair(
        (joint[:, :1024], torch.ones(1024), 1e-6), (joint[:, 1024:1536], torch.ones(512), 1e-6)
    )


def _silu_mul_clamp() -> Callable[[], object]:
    from sgl_dspark.kernels.moe.activation import silu_mul_clamp

    return lambda: silu_mul_clamp(_bf16(6, 2 * 2048), 10.0)


def _draft_attention(batch: int, heads: int, rope: bool = False) -> Callable[[], object]:
    from sgl_dspark.kernels.attention.draft import draft_attention

    # The mid model's draft stage: 16 heads of 128, a block of 8 queries, 128 context rows.
    tables = torch.zeros(batch * 8, 64).split(32, dim=1) if rope else None
    return lambda: draft_attention(
        _bf16(batch, 8, heads, 128),
        _bf16(300, 128),
        torch.zeros(batch, 128, dtype=torch.int64),
        torch.ones(batch, 128, dtype=torch.bool),
        _bf16(batch, 8, 128),
        torch.zeros(heads),
        128**-0.5,
        inverse_rope=tables,
    )


def _split_attention_inverse_rope() -> Callable[[], object]:
    from sgl_dspark.kernels.attention.window_sparse import window_sparse_attention

    # One decode token of the mid model (16 heads of 128, rd 64), split-K: both launches carry
    # the epilogue's variant (the single pass when the merge is off).
    cos, sin = torch.zeros(1, 64).split(32, dim=1)
    return lambda: window_sparse_attention(
        _bf16(1, 16, 128),
        _bf16(300, 128),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(2, 256, dtype=torch.int64),
        128,
        torch.zeros(16),
        128**-0.5,
        None,
        None,
        num_splits=4,
        inverse_rope=(cos, sin),
    )


def _fp8_window_attention() -> Callable[[], object]:
    from sgl_dspark.kernels.attention.window_sparse import window_sparse_attention

    # DeepSeek-V4-Flash decode (64 heads of 512, window 128) on an FP8 window cache
    # (--kv-cache-dtype fp8_e4m3), with selected compressed entries.
    window = torch.zeros(300, 512, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return lambda: window_sparse_attention(
        _bf16(2, 64, 512),
        window,
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, 256, dtype=torch.int64),
        128,
        torch.zeros(64),
        512**-0.5,
        _bf16(64, 512),
        torch.ones(2, 16, dtype=torch.bool),
        extra_slots=torch.zeros(2, 16, dtype=torch.int64),
    )


def _grouped_gemm() -> Callable[[], object]:
    from sgl_dspark.kernels.moe.grouped_gemm import moe_grouped_gemm

    # Tiles depend on (N, K) only: N, K >= the largest tiles give the production variant.
    return lambda: moe_grouped_gemm(
        _bf16(4, 256),
        _bf16(3, 64, 256),
        torch.zeros(64, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        6,
    )


def _token_gemms() -> Callable[[], object]:
    from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
    from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up

    # The mid model's experts (D 1024, I 512), two of them local; tiles depend on (D, I) only.
    table = torch.tensor([0, 1, 2], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 2, 0, 1, 1]], dtype=torch.int32)

    def run() -> object:
        h = moe_route_gate_up(_bf16(1, 1024), _bf16(2, 1024, 1024), ids, table, 2, 10.0)
        return moe_token_down_reduce(
            h, _bf16(2, 1024, 512), ids, torch.ones(1, 6), table, 2, 1.0, _bf16(1, 1024)
        )

    return run


def _quantized(fmt: str, shape: tuple[int, ...], block: int):
    """A random `QuantizedWeight` of logical `shape` (scales of 2^0; compiling needs no values)."""
    from sgl_dspark.kernels.linear.reference import QuantizedWeight

    *lead, n, k = shape
    rows = block if fmt == "fp8" else 1
    if fmt == "fp8":
        data = torch.zeros(*lead, n, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    else:
        data = torch.zeros(*lead, n, k // 2, dtype=torch.uint8)
    scale = torch.full((*lead, -(-n // rows), -(-k // block)), 127, dtype=torch.uint8)
    return QuantizedWeight(data, scale, fmt, block, rows)


def quantized_linear_case(
    fmt: str, n: int, k: int, block: int, m: int = 3, dtype: torch.dtype = torch.bfloat16
) -> Callable[[], object]:
    from sgl_dspark.kernels.linear.quantized import quantized_linear

    return lambda: quantized_linear(_bf16(m, k).to(dtype), _quantized(fmt, (n, k), block))


def _quantized_grouped_linear(fmt: str, block: int) -> Callable[[], object]:
    from sgl_dspark.kernels.linear.quantized import quantized_grouped_linear

    # DeepSeek-V4-Flash's o_a: 8 groups of 1024 rows over 4096 channels.
    return lambda: quantized_grouped_linear(_bf16(2, 8, 4096), _quantized(fmt, (8192, 4096), block))


def _dequantize(fmt: str, shape: tuple[int, int], block: int) -> Callable[[], object]:
    from sgl_dspark.kernels.linear.dequantize import dequantize_weight

    return lambda: dequantize_weight(_quantized(fmt, shape, block), torch.bfloat16)


def quantized_moe_case(fmt: str, block: int, block_size: int = 32) -> Callable[[], object]:
    from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
    from sgl_dspark.kernels.moe.reference import MoeSortOutput

    # V4-Flash expert shapes (D 4096, I 2048) at two local experts: tiles depend on (N, K);
    # 16-row sort blocks are the decode sizes' (`sort_block_size`).
    sort = MoeSortOutput(
        torch.zeros(64, dtype=torch.int32),
        torch.zeros(64),
        torch.zeros(64 // block_size, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(4, 4096),
    )
    return lambda: fused_moe(
        _bf16(4, 4096),
        _quantized(fmt, (2, 4096, 4096), block),
        _quantized(fmt, (2, 4096, 2048), block),
        sort,
        6,
        10.0,
        block_size=block_size,
    )


def quantized_token_gemms_case(fmt: str, block: int) -> Callable[[], object]:
    from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
    from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up

    table = torch.tensor([0, 1, 2], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 2, 0, 1, 1]], dtype=torch.int32)

    def run() -> object:
        h = moe_route_gate_up(
            _bf16(1, 4096), _quantized(fmt, (2, 4096, 4096), block), ids, table, 2, 10.0
        )
        down = _quantized(fmt, (2, 4096, 2048), block)
        return moe_token_down_reduce(h, down, ids, torch.ones(1, 6), table, 2, 1.0, _bf16(1, 4096))

    return run


def _mixed_experts(shape: tuple[int, int, int]):
    """DeepSeek-V4.1's folded expert stacks: two MXFP4 routed experts of logical `shape` and the
    shared expert FP8 32 x 32 as the extra (local id 2)."""
    from sgl_dspark.kernels.moe.reference import MixedExperts

    return MixedExperts(_quantized("mxfp4", (2, *shape), 32), _quantized("fp8", (1, *shape), 32))


def mixed_moe_case() -> Callable[[], object]:
    from sgl_dspark.kernels.moe.grouped_gemm import fused_moe
    from sgl_dspark.kernels.moe.reference import MoeSortOutput

    sort = MoeSortOutput(
        torch.zeros(64, dtype=torch.int32),
        torch.zeros(64),
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(4, 4096),
    )
    return lambda: fused_moe(
        _bf16(4, 4096),
        _mixed_experts((4096, 4096)),
        _mixed_experts((4096, 2048)),
        sort,
        7,
        10.0,
        block_size=16,
        weight_before_down=True,
    )


def mixed_token_gemms_case(d: int = 4096, inter: int = 2048) -> Callable[[], object]:
    from sgl_dspark.kernels.moe.token_down import moe_token_down_reduce
    from sgl_dspark.kernels.moe.token_gemm import moe_route_gate_up

    table = torch.tensor([0, 1, 2], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 0, 1, 0, 1, 2]], dtype=torch.int32)  # the shared expert last

    def run() -> object:
        weights = torch.ones(1, 7)
        h = moe_route_gate_up(
            _bf16(1, d), _mixed_experts((2 * inter, d)), ids, table, 3, 10.0, None, weights
        )
        down = _mixed_experts((d, inter))
        return moe_token_down_reduce(h, down, ids, None, table, 3)

    return run


def _quant_store(fmt: str, d: int, rope_half: int) -> Callable[[], object]:
    from sgl_dspark.kernels.quant.store import quant_store

    # DeepSeek-V4.1-Flash rows: the window KV and latents of 512 (rope 64), index keys of 128.
    width = d if fmt == "fp8_window" else d // 2
    block = 16 if fmt == "fp4_latent" else 32
    return lambda: quant_store(
        _bf16(3, d),
        torch.tensor([4, 9, 1]),
        torch.zeros(50, width, dtype=torch.uint8),
        torch.zeros(50, d // block, dtype=torch.uint8),
        fmt,
        torch.ones(3, rope_half),
        torch.zeros(3, rope_half),
    )


def _quant_store_values() -> Callable[[], object]:
    from sgl_dspark.kernels.quant.store import quant_store_values

    # The DSpark draft's window rows (V4.1-Flash: 512 channels, rope 64) in the bf16 cache.
    return lambda: quant_store_values(
        _bf16(3, 512),
        torch.tensor([4, 9, 1]),
        _bf16(50, 512),
        torch.ones(3, 32),
        torch.zeros(3, 32),
    )


def _index_queries() -> Callable[[], object]:
    from sgl_dspark.kernels.quant.store import fake_quant_rows

    # DeepSeek-V4.1-Flash index queries: 32 heads of 128 (rope 64), a column slice of the joint
    # q_b output (q's 64 x 512 columns first), rotated and FP4-quantised in one launch.
    fused = _bf16(3, 64 * 512 + 32 * 128)
    return lambda: fake_quant_rows(
        fused[:, 64 * 512 :].view(3, 32, 128),
        "fp4_index",
        torch.ones(3, 32),
        torch.zeros(3, 32),
    )


def _quant_load_into_keys() -> Callable[[], object]:
    from sgl_dspark.kernels.quant.load import quant_load

    # The attended latents (top-512 of 512 channels) decoded into their columns of the keys
    # tensor, after the window's 128.
    keys = _bf16(2, 128 + 512, 512)
    return lambda: quant_load(
        torch.zeros(50, 256, dtype=torch.uint8),
        torch.full((50, 32), 56, dtype=torch.uint8),
        torch.randint(0, 50, (2, 512)),
        "fp4_latent",
        torch.bfloat16,
        out=keys[:, 128:],
    )


def _quant_load_pair_into_keys() -> Callable[[], object]:
    from sgl_dspark.kernels.quant.load import quant_load_pair

    # The window's 128 FP8 keys and the attended top-512 FP4 latents into one keys tensor.
    keys = _bf16(2, 128 + 512, 512)
    return lambda: quant_load_pair(
        (
            torch.zeros(60, 512, dtype=torch.uint8),
            torch.full((60, 16), 127, dtype=torch.uint8),
            torch.randint(0, 60, (2, 128)),
            "fp8_window",
            keys[:, :128],
        ),
        (
            torch.zeros(50, 256, dtype=torch.uint8),
            torch.full((50, 32), 56, dtype=torch.uint8),
            torch.randint(0, 50, (2, 512)),
            "fp4_latent",
            keys[:, 128:],
        ),
        torch.bfloat16,
    )


def _picked_entry_rows() -> Callable[[], object]:
    from sgl_dspark.kernels.compressor.entry_rows import picked_entry_rows

    # DeepSeek-V4.1-Flash's top-512 of a sorted row of 2048 entries, ratio 2.
    ranked = torch.zeros(3, 2048)
    order = torch.zeros(3, 2048, dtype=torch.int64)
    return lambda: picked_entry_rows(
        ranked[:, :512],
        order[:, :512],
        torch.zeros(4, 8192, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int64),
        2,
    )


def _csa2_pair_pool() -> Callable[[], object]:
    from sgl_dspark.kernels.compressor.pair_pool import csa2_pair_pool

    # DeepSeek-V4.1-Flash's ratio-2 kv source: latents of 512, a verify of 4 rows, a ring of 8.
    ring = torch.zeros(3, 8, 512)
    rows = torch.zeros(4, dtype=torch.int64)
    return lambda: csa2_pair_pool(
        _bf16(4, 512),
        _bf16(4, 512),
        ring,
        ring.clone(),
        rows,
        rows,
        rows,
        torch.zeros(3, 8192, dtype=torch.int32),
    )


def _topk_entry_rows(width: int) -> Callable[[], object]:
    from sgl_dspark.kernels.compressor.entry_rows import topk_entry_rows

    # DeepSeek-V4.1-Flash's top-512 of an index source's scores, ratio 2: a short context and
    # the longest row sorted in registers.
    return lambda: topk_entry_rows(
        torch.zeros(3, width),
        512,
        torch.zeros(4, 2 * width, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int64),
        2,
    )


def _quant_load(fmt: str, d: int, shape: tuple[int, ...]) -> Callable[[], object]:
    from sgl_dspark.kernels.quant.load import quant_load

    # DeepSeek-V4.1-Flash rows: window KV and latents of 512, index keys of 128; rows indexed
    # [T, W] (a window read) or [T, k] (a top-k read).
    width = d if fmt == "fp8_window" else d // 2
    block = 16 if fmt == "fp4_latent" else 32
    return lambda: quant_load(
        torch.zeros(50, width, dtype=torch.uint8),
        torch.full((50, d // block), 127, dtype=torch.uint8),
        torch.randint(0, 50, shape),
        fmt,
        torch.bfloat16,
    )


def _engram_gather() -> Callable[[], object]:
    from sgl_dspark.kernels.engram.gather import engram_gather

    # V4.1-Flash: 24 ids per token (3 n-gram orders x 8 heads), rows of 256.
    return lambda: engram_gather(_bf16(1000, 256), torch.zeros(3, 24, dtype=torch.int64))


def _engram_gather_fp8() -> Callable[[], object]:
    from sgl_dspark.kernels.engram.gather import engram_gather
    from sgl_dspark.kernels.linear.reference import QuantizedWeight

    # The released tables: FP8 rows of 256 with one exponent byte per 32, decoded to bf16.
    data = torch.zeros(1000, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    table = QuantizedWeight(data, torch.full((1000, 8), 127, dtype=torch.uint8), "fp8", 32)
    return lambda: engram_gather(table, torch.zeros(3, 24, dtype=torch.int64))


def _engram_gather_hashed() -> Callable[[], object]:
    from sgl_dspark.kernels.engram.gather import engram_gather_hashed
    from sgl_dspark.kernels.linear.reference import QuantizedWeight

    # V4.1-Flash's hashing (n-grams of 2..4 ids, 8 heads: 24 ids) into the released FP8 table.
    data = torch.zeros(1000, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    table = QuantizedWeight(data, torch.full((1000, 8), 127, dtype=torch.uint8), "fp8", 32)
    return lambda: engram_gather_hashed(
        table,
        torch.zeros(3, 4, dtype=torch.int64),
        torch.ones(4, dtype=torch.int64),
        torch.full((3, 8), 31, dtype=torch.int64),
        torch.zeros(24, dtype=torch.int64),
    )


def _engram_gate(dtype: torch.dtype) -> Callable[[], object]:
    from sgl_dspark.kernels.engram.gate import engram_gate

    # V4.1-Flash: 4 streams of 5120 (a row of 8192 lanes, 16 warps), the wkv output in bf16.
    return lambda: engram_gate(
        torch.randn(3, 4, 5120).to(dtype),
        _bf16(3, 5 * 5120),
        torch.ones(4, 5120),
        torch.ones(4, 5120),
        1e-20,
    )


def _v41_index_scores() -> Callable[[], object]:
    from sgl_dspark.kernels.indexer.v41_logits import v41_index_scores

    def run() -> None:
        # V4.1-Flash: 32 index heads of 128, candidate blocks of 8; bf16 queries (the engine's:
        # bf16 dots) and fp32 ones (IEEE dots), 300 entries (16 a program) and 5000 (64).
        for dtype, n in ((torch.bfloat16, 300), (torch.float32, 300), (torch.bfloat16, 5000)):
            v41_index_scores(
                torch.randn(2, 32, 128).to(dtype),
                _bf16(2, 32),
                torch.zeros(100, 64, dtype=torch.uint8),
                torch.zeros(100, 4, dtype=torch.uint8),
                torch.zeros(2, n, dtype=torch.int64),
                torch.tensor([n, 17]),
                weight_scale=32**-0.5,
                keep_blocks=torch.ones(2, -(-n // 8), dtype=torch.bool),
                block=8,
            )

    return run


def _candidate_block_max() -> Callable[[], object]:
    from sgl_dspark.kernels.indexer.v41_logits import candidate_block_max

    return lambda: candidate_block_max(torch.randn(2, 16384), torch.tensor([16384, 9]), 8)


def _greedy_logprobs(rows: int, vocab: int) -> Callable[[], object]:
    """The argmax launches with the logprob's sums (one chunk per row when vocab is small)."""
    from sgl_dspark.kernels.sampling.vocab_argmax import vocab_greedy_logprobs

    return lambda: vocab_greedy_logprobs(torch.randn(rows, vocab))


def _mhc_single_pass(d: int, close_only: bool, apart: bool = False) -> Callable[[], object]:
    """apart: the coefficients' program in a launch of its own (`coeffs_scope`)."""
    import contextlib

    from sgl_dspark.kernels.mhc.post_combine import mhc_post_collapse, mhc_post_combine

    def run() -> None:
        update, heads = _mhc_inputs(2, d)
        pre = torch.rand(update[2].shape)
        if close_only:
            mhc_post_collapse(*update, pre, heads[3], rms_eps=1e-20)
        else:
            mhc_post_combine(
                *update,
                *heads,
                hc_eps=1e-6,
                sinkhorn_iters=20,
                rms_eps=1e-20,
                collapse_pre=pre,
                coeffs_scope=contextlib.nullcontext if apart else None,
            )

    return run


def _fp8_act(m: int, k: int, group: int, lead: tuple[int, ...] = ()):
    from sgl_dspark.kernels.fp8.reference import Fp8Activation

    q = torch.zeros(m, *lead, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return Fp8Activation(q, torch.ones(m, *lead, -(-k // group)))


def _w8a8_linear(m: int, n: int, k: int, block: int, group: int) -> Callable[[], object]:
    from sgl_dspark.kernels.fp8.w8a8 import w8a8_linear

    return lambda: w8a8_linear(_fp8_act(m, k, group), _quantized("fp8", (n, k), block), group)


def _w8a8_grouped_linear() -> Callable[[], object]:
    from sgl_dspark.kernels.fp8.w8a8 import w8a8_grouped_linear

    # DeepSeek-V4-Flash's o_a at a prefill chunk: 8 groups of 1024 rows over 4096 channels.
    act = _fp8_act(512, 4096, 128, (8,))
    return lambda: w8a8_grouped_linear(act, _quantized("fp8", (8192, 4096), 128), 128)


def _w8a8_split_k(m: int, block: int, group: int) -> Callable[[], object]:
    from sgl_dspark.kernels.fp8.reference import Fp8ActFormat
    from sgl_dspark.kernels.fp8.w8a8 import w8a8_split_k_linear

    # The DSpark main projection of V4-Flash: 3 tapped layers of 4096 into 4096.
    fmt = Fp8ActFormat(group, True)
    return lambda: w8a8_split_k_linear(
        _bf16(m, 12288), _quantized("fp8", (4096, 12288), block), fmt
    )


def _act_quant(group: int, mx: bool) -> Callable[[], object]:
    from sgl_dspark.kernels.fp8.act_quant import quantize_act_fp8, quantize_act_mxfp8

    if mx:
        return lambda: quantize_act_mxfp8(_bf16(64, 4096))
    return lambda: quantize_act_fp8(_bf16(64, 4096), group, True)


def _silu_fp8_group(group: int) -> Callable[[], object]:
    from sgl_dspark.kernels.moe.activation import silu_mul_clamp

    return lambda: silu_mul_clamp(_bf16(64, 2 * 2048), 10.0, "fp8_group", True, group=group)


def _mx_moe(block: int) -> Callable[[], object]:
    from sgl_dspark.kernels.fp8.mx_moe import mx_fused_moe
    from sgl_dspark.kernels.moe.reference import MoeSortOutput

    # V4-Flash expert shapes (D 4096, I 2048), two local experts; tiles depend on (N, K) and
    # the sort's block (the target's scaled-MMA rows: 32 on gfx950, 128 on Blackwell).
    sort = MoeSortOutput(
        torch.zeros(2 * block, dtype=torch.int32),
        torch.zeros(2 * block),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(4, 4096),
    )
    return lambda: mx_fused_moe(
        _bf16(4, 4096),
        _quantized("mxfp4", (2, 4096, 4096), 32),
        _quantized("mxfp4", (2, 4096, 2048), 32),
        sort,
        6,
        10.0,
        block_size=block,
    )


def _mhc_fp8(d: int, group: int, single_pass: bool = False) -> Callable[[], object]:
    """The boundary writing its normed input's FP8 form; single pass: the collapse in phase A,
    the norm (and the quantiser) in chunks."""
    from sgl_dspark.kernels.fp8.reference import Fp8ActFormat
    from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine

    def run() -> None:
        update, heads = _mhc_inputs(2, d)
        mhc_post_combine(
            *update,
            *heads,
            hc_eps=1e-6,
            sinkhorn_iters=20,
            rms_eps=1e-6,
            fp8_out=Fp8ActFormat(group, True),
            collapse_pre=torch.rand(update[2].shape) if single_pass else None,
        )

    return run


# The matrix instruction each FP8 kernel exists to use, per target: NVIDIA's FP8 wgmma and
# gfx950's FP8 MFMA for the W8A8 GEMMs, gfx950's scaled MFMA and Blackwell's block-scaled MMA
# (128-row tiles) for the MX MoE (sm90 has no MX MMA: Triton upcasts `dot_scaled` to bf16
# there, which is why the engine never selects it on sm90).
_W8A8_INSTRUCTIONS = {
    "sm90": r"wgmma\.mma_async\S*\.e4m3\.e4m3",
    "gfx950": r"v_mfma_f32_\w+_(f8f6f4|fp8_fp8)",
}
_FP4_PTX_DECODE = {"sm90": r"prmt\.b32"}
INSTRUCTIONS = {
    "w8a8_linear_prefill_128": _W8A8_INSTRUCTIONS,
    "w8a8_linear_prefill_v41_32": _W8A8_INSTRUCTIONS,
    "w8a8_linear_m32": _W8A8_INSTRUCTIONS,
    "w8a8_grouped_linear_o_a": _W8A8_INSTRUCTIONS,
    "w8a8_split_k_main_proj": _W8A8_INSTRUCTIONS,
    "mx_moe_gfx950": {"gfx950": r"v_mfma_scale_f32_\w+_f8f6f4"},
    "mx_moe_blackwell": {"sm100": r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale"},
    # The MXFP4 GEMMs decode code bytes with inline PTX on NVIDIA (`dequant.E2M1_SCALED_PTX`,
    # its byte permutes); gfx950 compiles the portable decode.
    "quantized_linear_mxfp4": _FP4_PTX_DECODE,
    "quantized_linear_mxfp4_wide_m1": _FP4_PTX_DECODE,
    "quantized_linear_mxfp4_m32": _FP4_PTX_DECODE,
    "quantized_moe_grouped_mxfp4": _FP4_PTX_DECODE,
    "quantized_moe_route_gate_up_mxfp4": _FP4_PTX_DECODE,
    "quantized_moe_token_down_mxfp4": _FP4_PTX_DECODE,
    "mixed_moe_route_gate_up": _FP4_PTX_DECODE,
    "mixed_moe_token_down": _FP4_PTX_DECODE,
}

CASES = {
    # FP8 activations: the W8A8 GEMMs at prefill and verify sizes (V4-Flash q_a/kv 4096 x
    # 4096 with 128 x 128 blocks; V4.1's 32 x 32 blocks), the split-K main projection and its
    # reduce, the quantisers (their own launch, the SiLU epilogue, the mHC boundary) and the MX
    # MoE stages.
    "w8a8_linear_prefill_128": (
        "fp8.w8a8",
        "_w8a8_gemm_kernel",
        _w8a8_linear(512, 4096, 4096, 128, 128),
    ),
    "w8a8_linear_prefill_v41_32": (
        "fp8.w8a8",
        "_w8a8_gemm_kernel",
        _w8a8_linear(512, 4096, 4096, 32, 32),
    ),
    "w8a8_linear_m32": ("fp8.w8a8", "_w8a8_gemm_kernel", _w8a8_linear(32, 4096, 4096, 128, 128)),
    "w8a8_grouped_linear_o_a": ("fp8.w8a8", "_w8a8_gemm_kernel", _w8a8_grouped_linear()),
    "w8a8_split_k_main_proj": ("fp8.w8a8", "_w8a8_gemm_kernel", _w8a8_split_k(32, 128, 128)),
    "w8a8_split_k_reduce": ("fp8.w8a8", "_split_k_reduce_kernel", _w8a8_split_k(32, 32, 32)),
    "act_quant_fp8_128": ("fp8.act_quant", "_act_quant_kernel", _act_quant(128, False)),
    "act_quant_mxfp8": ("fp8.act_quant", "_act_quant_kernel", _act_quant(32, True)),
    "silu_mul_clamp_fp8_group_32": (
        "moe.activation",
        "_silu_mul_clamp_kernel",
        _silu_fp8_group(32),
    ),
    "mhc_boundary_fp8_d4096": ("mhc.post_combine", "_mhc_post_combine_kernel", _mhc_fp8(4096, 128)),
    "mhc_boundary_fp8_d7168_32": (
        "mhc.post_combine",
        "_mhc_post_combine_kernel",
        _mhc_fp8(7168, 32),
    ),
    "mhc_single_pass_fp8_d5120_32": (
        "mhc.post_combine",
        "_mhc_post_combine_kernel",
        _mhc_fp8(5120, 32, single_pass=True),
    ),
    "mx_moe_gfx950": ("fp8.mx_moe", "_mx_moe_gemm_kernel", _mx_moe(32)),
    "mx_moe_blackwell": ("fp8.mx_moe", "_mx_moe_gemm_kernel", _mx_moe(128)),
    # Weights kept as stored at DeepSeek-V4(.1)-Flash shapes: FP8 128 x 128 (V4), 32 x 32
    # (V4.1), MXFP4; an lm_head-wide N takes the wide column blocks.
    "quantized_linear_fp8_o_b": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 4096, 8192, 128),
    ),
    "quantized_linear_fp8_o_b_m1": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 4096, 8192, 128, m=1),
    ),
    "quantized_linear_fp8_32_q_b": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 32768, 1280, 32, m=16),
    ),
    # More than 16 rows (decode at 32 requests, a DSpark verify): two row blocks a program.
    "quantized_linear_fp8_32_o_b_m32": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 5120, 8192, 32, m=32),
    ),
    "quantized_linear_mxfp4_m32": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("mxfp4", 4096, 4096, 32, m=32),
    ),
    "quantized_linear_fp8_32_q_b_m32": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 32768, 1280, 32, m=32),
    ),
    # fp32 activations (fp32 serving of a quantised checkpoint): wider activation tiles
    "quantized_linear_fp8_fp32": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 4096, 4096, 128, m=16, dtype=torch.float32),
    ),
    "quantized_linear_mxfp4_fp32": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("mxfp4", 4096, 4096, 32, m=16, dtype=torch.float32),
    ),
    "quantized_linear_mxfp4": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("mxfp4", 4096, 4096, 32),
    ),
    "quantized_linear_mxfp4_wide_m1": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("mxfp4", 32768, 4096, 32, m=1),
    ),
    # K not a multiple of 32: MXFP4 rows read byte by byte.
    "quantized_linear_mxfp4_bytes": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("mxfp4", 1024, 4040, 32),
    ),
    # The one-pass dequantisation above the kernel's rows (V4.1's 32 x 32 q_b, MXFP4 words and
    # bytes).
    "dequantize_fp8_32_q_b": (
        "linear.dequantize",
        "_dequantize_kernel",
        _dequantize("fp8", (32768, 1280), 32),
    ),
    "dequantize_mxfp4": (
        "linear.dequantize",
        "_dequantize_kernel",
        _dequantize("mxfp4", (4096, 4096), 32),
    ),
    "dequantize_mxfp4_bytes": (
        "linear.dequantize",
        "_dequantize_kernel",
        _dequantize("mxfp4", (1024, 4040), 32),
    ),
    "quantized_grouped_linear_fp8": (
        "linear.quantized",
        "_quantized_linear_kernel",
        _quantized_grouped_linear("fp8", 128),
    ),
    "quantized_grouped_linear_mxfp4": (
        "linear.quantized",
        "_quantized_linear_kernel",
        _quantized_grouped_linear("mxfp4", 32),
    ),
    "quantized_moe_grouped_mxfp4": (
        "moe.grouped_gemm",
        "_moe_grouped_gemm_kernel",
        quantized_moe_case("mxfp4", 32),
    ),
    "quantized_moe_grouped_mxfp4_block16": (
        "moe.grouped_gemm",
        "_moe_grouped_gemm_kernel",
        quantized_moe_case("mxfp4", 32, block_size=16),
    ),
    "quantized_moe_grouped_fp8": (
        "moe.grouped_gemm",
        "_moe_grouped_gemm_kernel",
        quantized_moe_case("fp8", 128),
    ),
    "quantized_moe_grouped_fp8_block16": (
        "moe.grouped_gemm",
        "_moe_grouped_gemm_kernel",
        quantized_moe_case("fp8", 128, block_size=16),
    ),
    "quantized_moe_route_gate_up_mxfp4": (
        "moe.token_gemm",
        "_moe_route_gate_up_kernel",
        quantized_token_gemms_case("mxfp4", 32),
    ),
    "quantized_moe_route_gate_up_fp8": (
        "moe.token_gemm",
        "_moe_route_gate_up_kernel",
        quantized_token_gemms_case("fp8", 128),
    ),
    "quantized_moe_token_down_mxfp4": (
        "moe.token_down",
        "_moe_token_down_kernel",
        quantized_token_gemms_case("mxfp4", 32),
    ),
    "quantized_moe_token_down_fp8_32": (
        "moe.token_down",
        "_moe_token_down_kernel",
        quantized_token_gemms_case("fp8", 32),
    ),
    # V4.1's shared expert (FP8) folded beside MXFP4 routed experts: the per-token kernels hold
    # both formats' products; the grouped stages launch the MXFP4 stack and the FP8 extra apart.
    "mixed_moe_grouped": ("moe.grouped_gemm", "_moe_grouped_gemm_kernel", mixed_moe_case()),
    "mixed_moe_route_gate_up": (
        "moe.token_gemm",
        "_moe_route_gate_up_kernel",
        mixed_token_gemms_case(),
    ),
    "mixed_moe_token_down": (
        "moe.token_down",
        "_moe_token_down_kernel",
        mixed_token_gemms_case(),
    ),
    # DeepSeek-V4.1-Flash's experts (D 5120, I 2304): the down projection's scale rows hold
    # 72 bytes, a stride Triton does not specialise; the kernels tell it they are 8-aligned.
    "mixed_moe_token_down_v41": (
        "moe.token_down",
        "_moe_token_down_kernel",
        mixed_token_gemms_case(5120, 2304),
    ),
    # V4.1-Flash's o_b and x projection (FP8 32 x 32) at M 1.
    "quantized_linear_fp8_32_o_b_v41": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 5120, 8192, 32, m=1),
    ),
    "quantized_linear_fp8_32_x_proj_v41": (
        "linear.quantized",
        "_quantized_linear_kernel",
        quantized_linear_case("fp8", 1792, 5120, 32, m=1),
    ),
    "quant_store_window_fp8": (
        "quant.store",
        "_quant_store_kernel",
        _quant_store("fp8_window", 512, 32),
    ),
    "quant_store_latent_fp4": (
        "quant.store",
        "_quant_store_kernel",
        _quant_store("fp4_latent", 512, 32),
    ),
    "quant_store_index_fp4": (
        "quant.store",
        "_quant_store_kernel",
        _quant_store("fp4_index", 128, 32),
    ),
    "quant_store_values_draft": (
        "quant.store",
        "_quant_store_kernel",
        _quant_store_values(),
    ),
    "quant_index_queries_fp4": (
        "quant.store",
        "_quant_store_kernel",
        _index_queries(),
    ),
    "quant_load_latents_into_keys": (
        "quant.load",
        "_quant_load_kernel",
        _quant_load_into_keys(),
    ),
    "quant_load_pair_into_keys": (
        "quant.load",
        "_quant_load_pair_kernel",
        _quant_load_pair_into_keys(),
    ),
    "csa2_pair_pool_flash": (
        "compressor.pair_pool",
        "_csa2_pair_pool_kernel",
        _csa2_pair_pool(),
    ),
    "topk_entry_rows_flash_1k": (
        "compressor.entry_rows",
        "_topk_entry_rows_kernel",
        _topk_entry_rows(1024),
    ),
    "topk_entry_rows_flash_4k": (
        "compressor.entry_rows",
        "_topk_entry_rows_kernel",
        _topk_entry_rows(4096),
    ),
    "picked_entry_rows_flash": (
        "compressor.entry_rows",
        "_picked_entry_rows_kernel",
        _picked_entry_rows(),
    ),
    "quant_load_window_fp8": (
        "quant.load",
        "_quant_load_kernel",
        _quant_load("fp8_window", 512, (2, 128)),
    ),
    "quant_load_latent_fp4": (
        "quant.load",
        "_quant_load_kernel",
        _quant_load("fp4_latent", 512, (2, 64)),
    ),
    "quant_load_index_fp4": (
        "quant.load",
        "_quant_load_kernel",
        _quant_load("fp4_index", 128, (3, 5)),
    ),
    "engram_gather_flash": ("engram.gather", "_engram_gather_kernel", _engram_gather()),
    "engram_gather_hashed_flash": (
        "engram.gather",
        "_engram_gather_kernel",
        _engram_gather_hashed(),
    ),
    "engram_gather_flash_fp8": (
        "engram.gather",
        "_engram_gather_kernel",
        _engram_gather_fp8(),
    ),
    "engram_gate_flash": ("engram.gate", "_engram_gate_kernel", _engram_gate(torch.bfloat16)),
    "engram_gate_flash_fp32": (
        "engram.gate",
        "_engram_gate_kernel",
        _engram_gate(torch.float32),
    ),
    "v41_index_scores_flash": (
        "indexer.v41_logits",
        "_v41_index_scores_kernel",
        _v41_index_scores(),
    ),
    "candidate_block_max_flash": (
        "indexer.v41_logits",
        "_candidate_block_max_kernel",
        _candidate_block_max(),
    ),
    "greedy_logprobs_chunks": (
        "sampling.vocab_argmax",
        "_chunk_argmax_kernel",
        _greedy_logprobs(2, 129280),
    ),
    "greedy_logprobs_combine": (
        "sampling.vocab_argmax",
        "_combine_pairs_kernel",
        _greedy_logprobs(2, 129280),
    ),
    "greedy_logprobs_one_chunk": (
        "sampling.vocab_argmax",
        "_chunk_argmax_kernel",
        _greedy_logprobs(3, 300),
    ),
    "mhc_single_pass_d5120": (
        "mhc.post_combine",
        "_mhc_post_combine_kernel",
        _mhc_single_pass(5120, False),
    ),
    "mhc_single_pass_coeffs_apart_d5120": (
        "mhc.post_combine",
        "_mhc_post_combine_kernel",
        _mhc_single_pass(5120, False, apart=True),
    ),
    "mhc_post_collapse_d5120": (
        "mhc.post_combine",
        "_mhc_post_combine_kernel",
        _mhc_single_pass(5120, True),
    ),
    "moe_route_gate_up": ("moe.token_gemm", "_moe_route_gate_up_kernel", _token_gemms()),
    "moe_token_down_reduce": ("moe.token_down", "_moe_token_down_kernel", _token_gemms()),
    "router_from_x_h128_fp32": (
        "moe.router",
        "_router_topk_kernel",
        _router_from_x(128, torch.float32),
    ),
    "router_from_x_h128_bf16": (
        "moe.router",
        "_router_topk_kernel",
        _router_from_x(128, torch.bfloat16),
    ),
    "draft_attention_b1": ("attention.draft", "_draft_attention_kernel", _draft_attention(1, 16)),
    "draft_attention_inverse_rope": (
        "attention.draft",
        "_draft_attention_kernel",
        _draft_attention(1, 16, rope=True),
    ),
    "attention_split_inverse_rope": (
        "attention.window_sparse",
        "_merge_attention_splits_kernel",
        _split_attention_inverse_rope(),
    ),
    "attention_fp8_window": (
        "attention.window_sparse",
        "_window_sparse_attention_kernel",
        _fp8_window_attention(),
    ),
    "draft_attention_b32": ("attention.draft", "_draft_attention_kernel", _draft_attention(32, 64)),
    "moe_grouped_gemm": ("moe.grouped_gemm", "_moe_grouped_gemm_kernel", _grouped_gemm()),
    "rope_tail_scatter": ("rope.tail", "_rope_tail_kernel", _rope_store()),
    "rope_q_kv_store": ("rope.q_kv", "_rope_q_kv_kernel", _rope_q_kv_store()),
    "rope_q_store_kv_v41": ("rope.q_kv", "_rope_q_store_kv_kernel", _rope_q_store_kv_v41()),
    "hash_router_from_x_h1024": (
        "moe.hash_gemv",
        "_hash_gemv_partials_kernel",
        _hash_router_from_x(1024),
    ),
    "rms_norm_strided_rows": ("norm.rmsnorm", "_rms_norm_kernel", _rms_norm_strided()),
    "rms_norm_pair_v41": ("norm.rmsnorm", "_rms_norm_pair_kernel", _rms_norm_pair()),
    "silu_mul_clamp_i2048": ("moe.activation", "_silu_mul_clamp_kernel", _silu_mul_clamp()),
    "small_m_linear_mid_x_proj": (
        "linear.small_m",
        "_small_m_linear_kernel",
        _small_m_linear(1160, 1024, torch.bfloat16),
    ),
    "small_m_linear_lm_head": (
        "linear.small_m",
        "_small_m_linear_kernel",
        _small_m_linear(32000, 1024, torch.bfloat16),
    ),
    "small_m_linear_fp32_wide": (
        "linear.small_m",
        "_small_m_linear_kernel",
        _small_m_linear(9000, 40, torch.float32),
    ),
    "compressor_decode_csa": (
        "compressor.pool",
        "_compressor_pool_kernel",
        _compressor_decode(128, 4, True),
    ),
    "compressor_decode_hca": (
        "compressor.pool",
        "_compressor_pool_kernel",
        _compressor_decode(128, 128, False),
    ),
    "mhc_pre_d4096": ("mhc.post_combine", "_mhc_post_combine_kernel", _mhc(4096, True)),
    "mhc_post_combine_d1024": ("mhc.post_combine", "_mhc_post_combine_kernel", _mhc(1024, False)),
    "index_topk_flash": ("indexer.topk", "_index_topk_kernel", _index_topk(16384, 512)),
    "index_topk_mid": ("indexer.topk", "_index_topk_kernel", _index_topk(160, 64)),
    "markov_mid_b1": ("spec.markov", "_markov_step_kernel", _markov(32000, 64, 1)),
    "markov_flash_b32": ("spec.markov", "_markov_step_kernel", _markov(129280, 256, 32)),
}


def record_all_kernels() -> dict[str, _Recorder]:
    """Replace every `*_kernel` JIT function of the kernel modules by a recorder."""
    recs: dict[str, _Recorder] = {}
    for m in _KERNEL_MODULES:
        _record_module(importlib.import_module(f"sgl_dspark.kernels.{m}"), m, recs)
    return recs


def _record_module(mod, label: str, recs: dict[str, _Recorder]) -> None:
    """Swap the module's `*_kernel` JIT functions for recorders, added to `recs`."""
    from triton.runtime.jit import JITFunction

    for name, obj in list(vars(mod).items()):
        if isinstance(obj, JITFunction) and name.endswith("_kernel"):
            recs[f"{label}.{name}"] = _Recorder(obj)
            setattr(mod, name, recs[f"{label}.{name}"])


def bench_launches(recs: dict[str, _Recorder], m_values: tuple[int, ...] = (1, 32)) -> list[str]:
    """Call every launcher of `benchmark/kernels` (DeepSeek-V4-Flash shapes) at these M, with
    the kernels recording (a benchmark module's own kernels too, added to `recs`); returns the
    case names that ran."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from benchmark.kernels.run_all import MODULES

    ran = []
    for modname in MODULES:
        mod = importlib.import_module(modname)
        _record_module(mod, modname.rsplit(".", 1)[-1], recs)
        for case in mod.CASES:
            if any(case["name"].startswith(h) for h in _HEAVY_BENCH_CASES):
                continue
            for m in m_values:
                case["launcher"](**case["make_inputs"](m, "cpu"))
                ran.append(f"{case['name']} M={m}")
    return ran


# Kernels that take a `PDL` constexpr (programmatic dependent launch, `_triton_utils`). None
# loads anything before its wait, weights included: a weight tile is prefetched into L2 instead
# (`prefetch_l2`), because a real load next to a loop lets the software pipeliner hoist the
# loop's first activation load above the wait with it (the router's GEMV does at H < 512: a
# race that changes the engine's tokens under CUDA graphs).
PDL_KERNELS = (
    "moe.activation._silu_mul_clamp_kernel",
    "moe.reduce._moe_reduce_kernel",
    "moe.router._router_topk_kernel",
    "sampling.vocab_argmax._chunk_argmax_kernel",
    "norm.rmsnorm._rms_norm_kernel",
    "norm.rmsnorm._rms_norm_pair_kernel",
    "sampling.vocab_argmax._combine_pairs_kernel",
    "spec.accept._spec_accept_kernel",
    "spec.draft_inputs._prepare_draft_inputs_kernel",
    "rope.tail._rope_tail_kernel",
    "indexer.fp4_k_quant._fp4_index_k_quant_kernel",
    "indexer.fp4_q_rope._index_q_rope_fp4_kernel",
    "mhc.post_combine._mhc_post_combine_kernel",
    "linear.small_m._small_m_linear_kernel",
    "linear.quantized._quantized_linear_kernel",
    "moe.grouped_gemm._moe_grouped_gemm_kernel",
    "moe.sort._moe_sort_kernel",
    "attention.window_sparse._window_sparse_attention_kernel",
    "attention.window_sparse._merge_attention_splits_kernel",
    "indexer.logits._indexer_logits_kernel",
    "indexer.topk._index_topk_kernel",
    "compressor.pool._compressor_pool_kernel",
    "compressor.pair_pool._csa2_pair_pool_kernel",
    "compressor.entry_rows._topk_entry_rows_kernel",
    "spec.markov._markov_step_kernel",
    "attention.draft._draft_attention_kernel",
    "rope.q_kv._rope_q_kv_kernel",
    "rope.q_kv._rope_q_store_kv_kernel",
    "moe.hash_gemv._hash_gemv_partials_kernel",
    "moe.token_gemm._moe_route_gate_up_kernel",
    "moe.token_down._moe_token_down_kernel",
    "quant.store._quant_store_kernel",
    "quant.load._quant_load_kernel",
    "quant.load._quant_load_pair_kernel",
    "engram.gather._engram_gather_kernel",
    "engram.gate._engram_gate_kernel",
    "indexer.v41_logits._v41_index_scores_kernel",
    "indexer.v41_logits._candidate_block_max_kernel",
    "fp8.act_quant._act_quant_kernel",
    "fp8.w8a8._w8a8_gemm_kernel",
    "fp8.w8a8._split_k_reduce_kernel",
    "fp8.mx_moe._mx_moe_gemm_kernel",
)


def check_programmatic_launch(
    recs: dict[str, _Recorder], kernels: tuple[str, ...] = PDL_KERNELS
) -> list[str]:
    """Recompile each PDL kernel's recorded launch variants for sm90 with PDL on and off: on, the
    PTX must wait on the grid dependency before every global load, store and atomic, and release
    dependents; off, neither instruction may appear (the CPU-recorded launches are off, as on
    gfx950)."""
    target = TARGETS["sm90"][0]
    report = []
    for key in kernels:
        rec = recs[key]
        assert rec.calls, (key, "not launched")
        seen = set()
        for args, kwargs in rec.calls:
            assert kwargs["PDL"] is False, (key, "a CPU launch must not ask for PDL")
            variant = (
                tuple(
                    sorted(
                        (k, v)
                        for k, v in kwargs.items()
                        if isinstance(v, (bool, int, str)) and k.isupper()
                    )
                ),
                tuple(
                    str(t.dtype) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
                ),
            )
            if variant in seen:
                continue
            seen.add(variant)
            for pdl in (False, True):
                src, options = launch_source(rec.fn, args, {**kwargs, "PDL": pdl}, target)
                ptx = triton.compile(src, target=target, options=options).asm["ptx"]
                waits = ptx.count("griddepcontrol.wait")
                releases = ptx.count("griddepcontrol.launch_dependents")
                assert (waits > 0 and releases > 0) if pdl else (waits == releases == 0), (
                    key,
                    pdl,
                    waits,
                    releases,
                )
                if pdl:
                    first_wait = ptx.index("griddepcontrol.wait")
                    for op in ("ld.global", "st.global", "atom.global", "red.global", "cp.async"):
                        assert op not in ptx or first_wait < ptx.index(op), (key, op)
        report.append(f"ok pdl {key}: {len(seen)} variants")
    return report


# The quantised GEMMs' K loops (`linear.dequant.quantized_product`): each step's scale bytes are
# either copied ahead asynchronously or loaded a step ahead (`weight_loads.scales_loaded_ahead`).
K_LOOP_KERNELS = (
    "linear.quantized._quantized_linear_kernel",
    "moe.grouped_gemm._moe_grouped_gemm_kernel",
    "moe.token_gemm._moe_route_gate_up_kernel",
    "moe.token_down._moe_token_down_kernel",
)


# Kernels whose scale loads stay in their step by choice (`grouped_gemm._launch_grouped`).
SCALES_IN_STEP_KERNELS = ("moe.grouped_gemm._moe_grouped_gemm_kernel",)


def _loop_bodies(ttgir: str) -> tuple[list[str], dict[int, int], dict[int, int]]:
    """The TTGIR's lines, the innermost `scf.for` enclosing each line (by the loop's first
    line) and each loop's last line (regions nest by braces, balanced within attribute
    dictionaries on one line)."""
    lines = ttgir.splitlines()
    owner: dict[int, int] = {}
    last: dict[int, int] = {}
    open_loops: list[tuple[int, int]] = []
    depth = 0
    for i, line in enumerate(lines):
        if open_loops:
            owner[i] = open_loops[-1][1]
        net = line.count("{") - line.count("}")
        if "scf.for" in line and net > 0:
            open_loops.append((depth, i))
        depth += net
        while open_loops and depth <= open_loops[-1][0]:
            last[open_loops.pop()[1]] = i
    return lines, owner, last


def loads_waited_on_in_their_iteration(ttgir: str) -> list[str]:
    """Plain loads (`tt.load`, not an asynchronous copy) inside a loop whose value the same
    iteration uses: the iteration waits for the load's whole latency. A value used only by
    the loop's `scf.yield` is carried to the next iteration, loaded a step ahead."""
    lines, owner, last = _loop_bodies(ttgir)
    found = []
    for i, line in enumerate(lines):
        m = re.match(r"\s*(%[\w]+) = tt\.load ", line)
        if not m or i not in owner:
            continue
        use = re.compile(re.escape(m[1]) + r"(?![\w#])")
        for j in range(i + 1, last[owner[i]] + 1):
            if use.search(lines[j]) and not (owner.get(j) == owner[i] and "scf.yield" in lines[j]):
                found.append(f"{m[1]} used at: {lines[j].strip()[:100]}")
                break
    return found


def tiles_through_shared_memory(ttgir: str) -> list[str]:
    """Register tensors stored to shared memory inside a loop (`ttg.local_alloc` of a value):
    a tile whose layout the matrix unit cannot take from registers, a round trip per step."""
    lines, owner, _ = _loop_bodies(ttgir)
    return [
        line.strip()[:100]
        for i, line in enumerate(lines)
        if i in owner and re.search(r"= ttg\.local_alloc %", line)
    ]


def _scale_tiles(kwargs: dict) -> list[tuple[bool, bool, int]]:
    """Per quantised product of a launch (the stack's, a `MixedExperts`' extra's): whether its
    scale tile is loaded ahead, whether the pipeliner copies it asynchronously (4 or more
    bytes a thread, 4-byte aligned rows; `weight_loads.scales_loaded_ahead`), and its groups a
    step."""
    warps = kwargs["num_warps"]
    tiles = []
    if kwargs.get("QUANT", True):
        columns = kwargs["BLOCK_N"] * kwargs.get("SLOTS", 1)
        tiles.append((columns, kwargs["BLOCK_K"] // kwargs["GROUP"], "SCALES_AHEAD", "SCALE_ALIGN"))
    if kwargs.get("X_QUANT", False):
        columns = kwargs.get("X_BLOCK_N", kwargs["BLOCK_N"])
        tiles.append(
            (columns, kwargs["X_BLOCK_K"] // kwargs["X_GROUP"], "X_SCALES_AHEAD", "X_SCALE_ALIGN")
        )
    return [
        (
            kwargs[ahead],
            groups >= 4 and columns * groups >= 4 * 32 * warps and kwargs[align] >= 4,
            groups,
        )
        for columns, groups, ahead, align in tiles
    ]


def check_k_loops(
    recs: dict[str, _Recorder], kernels: tuple[str, ...] = K_LOOP_KERNELS
) -> list[str]:
    """Compile each quantised GEMM's recorded launch variants (bf16 activations, K a multiple
    of the K step) for sm90 and check their K loops: no dequantised tile goes through shared
    memory, and no iteration waits on a load it issued where every product's scale tile is
    loaded ahead or copied asynchronously (`weight_loads.scales_loaded_ahead`). A tile that is
    neither must have fewer than 8 groups a step (V4's FP8 128 x 128, whose scale loads stay
    in their step), but in SCALES_IN_STEP_KERNELS; the report counts those variants."""
    target = TARGETS["sm90"][0]
    report = []
    for key in kernels:
        rec = recs[key]
        assert rec.calls, (key, "not launched")
        seen = set()
        waiting = 0
        for args, kwargs in rec.calls:
            if not kwargs.get("QUANT", True) and not kwargs.get("X_QUANT", False):
                continue
            if kwargs["DOT_FP32"] or not kwargs["EVEN_K"]:
                continue  # fp32 tiles take shared memory; bounded K steps are plain loads
            variant = tuple(
                sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, str)))
            )
            if variant in seen:
                continue
            seen.add(variant)
            src, options = launch_source(rec.fn, args, on_target(kwargs, target), target)
            ttgir = triton.compile(src, target=target, options=options).asm["ttgir"]
            assert not tiles_through_shared_memory(ttgir), (key, variant)
            tiles = _scale_tiles(kwargs)
            in_step = [groups for ahead, copied, groups in tiles if not (ahead or copied)]
            if key not in SCALES_IN_STEP_KERNELS:
                assert all(groups < 8 for groups in in_step), (key, variant, tiles)
            waits = loads_waited_on_in_their_iteration(ttgir)
            assert in_step or not waits, (key, variant, waits)
            waiting += bool(in_step)
        assert seen, (key, "no quantised bf16 launch with K a multiple of its step")
        report.append(
            f"ok loops {key}: {len(seen)} variants, {waiting} with scale loads in their step"
        )
    return report


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack and local memory of a compiled kernel (`cuobjdump` as Triton ships it)."""
    import subprocess
    import tempfile
    from pathlib import Path

    tool = Path(importlib.import_module("triton.backends.nvidia").__file__).parent / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [str(tool / "cuobjdump"), "--dump-resource-usage", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}


def check_register_caps() -> list[str]:
    """The mHC boundary's phase A on NVIDIA at every row tile (1 to `_MAX_BLOCK_M` rows),
    single pass (V4.1's D) and two pass (V4's): launched with the register cap `post_combine.
    _phase_a_registers` gives, it stays within the cap and spills nothing (a spill would put
    local-memory traffic in every row); the capped tiles, compiled without the cap, need more
    (else the cap would be there for nothing)."""
    from sgl_dspark.kernels.mhc import post_combine

    target = TARGETS["sm90"][0]
    report = []
    for d, single_pass in ((5120, True), (4096, False)):
        block_m = 1
        while block_m <= post_combine._MAX_BLOCK_M:
            m = block_m * post_combine._TARGET_ROW_TILES
            cap = post_combine._phase_a_registers(block_m, single_pass, _MHC_STREAMS)

            def run(m: int = m, d: int = d, single_pass: bool = single_pass) -> None:
                update, heads = _mhc_inputs(m, d)
                post_combine.mhc_post_combine(
                    *update,
                    *heads,
                    hc_eps=1e-6,
                    sinkhorn_iters=20,
                    rms_eps=1e-6,
                    collapse_pre=torch.rand(update[2].shape) if single_pass else None,
                )

            rec = record_launches(
                "sgl_dspark.kernels.mhc.post_combine", "_mhc_post_combine_kernel", run
            )
            args, kwargs = next((a, k) for a, k in rec.calls if k["PHASE"] == 0)
            assert kwargs["BLOCK_M"] == block_m, (d, m, kwargs["BLOCK_M"])
            src, options = launch_source(rec.fn, args, on_target(kwargs, target), target)
            if cap is not None:
                free = triton.compile(src, target=target, options=options)
                assert resource_usage(free.asm["cubin"])["REG"] > cap, (d, m, "cap unneeded")
                options = {**options, "maxnreg": cap}
            compiled = triton.compile(src, target=target, options=options)
            usage = resource_usage(compiled.asm["cubin"])
            assert usage["REG"] <= (cap or 255), (d, m, usage)
            assert cap is None or usage["STACK"] == usage["LOCAL"] == 0, (d, m, usage)
            report.append(f"ok regs mhc phase A D {d} {block_m} rows: {usage['REG']} (cap {cap})")
            block_m *= 2
    return report


def check_instructions() -> list[str]:
    """Compile the cases of `INSTRUCTIONS` and check their matrix instructions."""
    report = []
    for case, wanted in sorted(INSTRUCTIONS.items()):
        module, kernel, run = CASES[case]
        _compile_all(record_launches(f"sgl_dspark.kernels.{module}", kernel, run), wanted)
        report.append(f"ok asm {case}: {', '.join(f'{t} {r}' for t, r in sorted(wanted.items()))}")
    return report


def main(names: list[str]) -> int:
    if names == ["--all"]:
        recs = record_all_kernels()
        for case in sorted(CASES):
            CASES[case][2]()
        print(f"ran {len(bench_launches(recs))} benchmark launches", flush=True)
        failed = 0
        try:
            print("\n".join(check_programmatic_launch(recs)), flush=True)
        except Exception as exc:
            failed += 1
            print(f"FAIL pdl: {type(exc).__name__}: {exc}", flush=True)
        try:
            print("\n".join(check_k_loops(recs)), flush=True)
        except Exception as exc:
            failed += 1
            print(f"FAIL loops: {type(exc).__name__}: {exc}", flush=True)
        try:
            print("\n".join(check_instructions()), flush=True)
        except Exception as exc:
            failed += 1
            print(f"FAIL asm: {type(exc).__name__}: {exc}", flush=True)
        try:
            print("\n".join(check_register_caps()), flush=True)
        except Exception as exc:
            failed += 1
            print(f"FAIL regs: {type(exc).__name__}: {exc}", flush=True)
        for key, rec in sorted(recs.items()):
            if not rec.calls:
                continue
            try:
                print(f"ok {key}: {len(_compile_all(rec))} compilations", flush=True)
            except Exception as exc:
                failed += 1
                print(f"FAIL {key}: {type(exc).__name__}: {exc}", flush=True)
        return 1 if failed else 0

    failed = 0
    for case in names or sorted(CASES):
        module, kernel, run = CASES[case]
        try:
            rec = record_launches(f"sgl_dspark.kernels.{module}", kernel, run)
            report = _compile_all(rec, INSTRUCTIONS.get(case))
            print(f"ok {case}: {'; '.join(report)}", flush=True)
        except Exception as exc:  # report every case, fail at the end
            failed += 1
            print(f"FAIL {case}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
