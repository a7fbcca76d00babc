"""Triton helpers shared by several kernel modules."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as _cuda_language
from triton.runtime.interpreter import InterpretedFunction

from sgl_dspark.kernels._checks import require


class _ProgrammaticLaunchSwitch:
    allowed = True  # process-wide; `set_programmatic_launch` flips it (no `global` statement)
    only: frozenset[str] | None = None  # kernel names allowed, None = all
    max_graph_batch: int | None = None  # graphs of larger batches launch plainly; None = all


def interpreted(kernel: object) -> bool:
    """True when `kernel` runs in the CPU interpreter (TRITON_INTERPRET=1). Its fp32 -> bf16
    cast truncates instead of rounding to nearest even, so kernels round on the bits there
    (`round_to_bf16`); compiled, the native cast already rounds to nearest even (one
    instruction instead of six integer ops per element). Launchers pick the interpreter's
    variants (bits rounded by hand, dots in fp32) by this test, never by the tensors' device:
    `gpu_targets_check.py` records launches on CPU tensors and must compile the variants a GPU
    runs."""
    return isinstance(kernel, InterpretedFunction)


@functools.cache
def _nvidia_sm90_or_later(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def nvidia_sm90_or_later(device: torch.device) -> bool:
    """Whether `device` is an NVIDIA GPU of compute capability 9 or later (HIP builds are not):
    programmatic dependent launch, the MXFP4 decode's packed bf16 multiply."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _nvidia_sm90_or_later(index)


# Multiprocessors assumed where the device has none to report (the CPU interpreter): an H100's
# or H200's, so launch shapes chosen by the SM count are the ones the GPU would run.
DEFAULT_SM_COUNT = 132


@functools.cache
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (streaming multiprocessors / compute units), for launch
    shapes sized to a wave; `DEFAULT_SM_COUNT` off a GPU."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else 0)
    return DEFAULT_SM_COUNT


def set_programmatic_launch(
    allowed: bool, only: set[str] | None = None, max_graph_batch: int | None = None
) -> None:
    """Allow (the default) or forbid programmatic dependent launch, process-wide. It changes no
    result bit, only when a kernel's launch may start. `only` limits it to the kernels of these
    names (a bisection aid); `max_graph_batch` to graphs captured for at most that many requests
    (see `programmatic_launch_for_batch`)."""
    require(
        max_graph_batch is None or max_graph_batch >= 0,
        f"max_graph_batch must be >= 0 or None, got {max_graph_batch}",
    )
    _ProgrammaticLaunchSwitch.allowed = allowed
    _ProgrammaticLaunchSwitch.only = frozenset(only) if only is not None else None
    _ProgrammaticLaunchSwitch.max_graph_batch = max_graph_batch


@contextlib.contextmanager
def programmatic_launch_for_batch(batch_size: int) -> Iterator[None]:
    """Scope of a graph capture for `batch_size` requests: launches inside it are programmatic
    only if allowed and the batch is at most `max_graph_batch`. The launch overlap pays at small
    batches and can cost at large ones (`benchmark/results/engine.md`): a dependent grid's
    programs wait resident on the SMs, which the wide grids of a large batch may need."""
    switch = _ProgrammaticLaunchSwitch
    saved = switch.allowed
    limit = switch.max_graph_batch
    switch.allowed = saved and (limit is None or batch_size <= limit)
    try:
        yield
    finally:
        switch.allowed = saved


def programmatic_launch(kernel: object, device: torch.device) -> dict[str, Any]:
    """Launch options of a kernel that takes a `PDL` constexpr (see `wait_for_producers`).

    With programmatic dependent launch (compiled, CUDA compute capability 9 and later) the GPU may
    start the kernel while its predecessor on the stream still runs, hiding the launch latency of
    each kernel, also inside CUDA graphs (capture keeps the programmatic edge). The kernel must then
    call `wait_for_producers` before its first load of data another kernel wrote and before its
    first store."""
    only = _ProgrammaticLaunchSwitch.only
    pdl = (
        _ProgrammaticLaunchSwitch.allowed
        and not interpreted(kernel)
        and (only is None or getattr(kernel, "__name__", None) in only)
        and nvidia_sm90_or_later(device)
    )
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def register_cap(device: torch.device, registers: int | None) -> dict[str, Any]:
    """Launch options capping a kernel's registers a thread at `registers` (None: no cap) where
    the backend takes a cap (NVIDIA's `maxnreg`; caps are chosen from sm90 compilations, so
    `nvidia_sm90_or_later` decides): so that a known number of programs share a
    multiprocessor and a grid sized for one wave runs in one. The cap moves no result bit (the
    same instructions, other registers); a cap below what the kernel needs spills, which the
    caller's choice must avoid (`gpu_targets_check` compiles the capped launches)."""
    if registers is None or not nvidia_sm90_or_later(device):
        return {}
    return {"maxnreg": registers}


def arrival_counters(
    counters: torch.Tensor | None,
    needed: int,
    split: bool,
    placeholder: torch.Tensor,
    name: str = "counters",
) -> torch.Tensor:
    """The int32 arrival counters of a launch whose outputs are split over several programs,
    the last to arrive finishing them (the kernel leaves the counters zero, so a caller keeps
    one tensor for its launches; zeroed here, one memset, when it keeps none). `counters`, when
    given, is checked (ValueError naming `name`); `placeholder` when the launch does not split
    (the kernel then never reads them)."""
    if counters is not None:
        require(
            counters.dtype == torch.int32
            and counters.dim() == 1
            and counters.is_contiguous()
            and counters.numel() >= needed
            and counters.device == placeholder.device,
            f"{name} must be contiguous int32 [>= {needed}] on {placeholder.device}, got "
            f"{counters.dtype} {tuple(counters.shape)} on {counters.device}",
        )
    if not split:
        return placeholder
    if counters is None:
        return torch.zeros(needed, dtype=torch.int32, device=placeholder.device)
    return counters


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Block until the kernels before this one on the stream have finished and their writes are
    visible, then let the next kernel's launch begin (it still waits for this one's completion
    in its own call). A no-op unless launched programmatically. Every load of another kernel's
    output and every store must come after it."""
    if PDL:
        _cuda_language.gdc_wait()
        _cuda_language.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    # A hint with no result and no ordering, so no later load changes.
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_tile_l2(ptr, rows, row_stride, col0, col_end, WIDTH: tl.constexpr):
    """Pull the lines of a weight tile into L2: `rows` (row indices, in bounds) x columns
    [col0, col0 + WIDTH), one address per 128-byte line, clamped below `col_end`. Called before
    `wait_for_producers` so a weight's first tile streams in while the previous kernel finishes.
    A prefetch and not a load: a real load before the wait lets the compiler (the software
    pipeliner of a following loop) move activation loads above the wait with it. NVIDIA PTX:
    call it only under `PDL`."""
    line: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth
    cols = tl.minimum(col0 + tl.arange(0, (WIDTH + line - 1) // line) * line, col_end - 1)
    _prefetch_l2(ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :])


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, kept in fp32 (NaN passes through). Portable: the CPU
    interpreter's own fp32 -> bf16 cast truncates, and the later store of an exact bf16 value
    is lossless."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


# Storage dtype codes of the rounding helpers (`round_to_storage`, `round_to_dtype`).
DTYPE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def round_to_storage(x, KIND: tl.constexpr):
    """fp32 -> the nearest-even value of a storage dtype, kept in fp32 (exact on store):
    KIND 0 fp32 (identity), 1 bf16 (on the bits, `round_to_bf16`), 2 fp16 (whose cast rounds to
    nearest-even on every backend)."""
    if KIND == 1:
        x = round_to_bf16(x)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def round_bf16_native_or_bits(x, ON_BITS: tl.constexpr):
    """fp32 -> nearest-even bf16 value, kept in fp32: on the bits in the interpreter
    (`ON_BITS`, see `interpreted`), else through the native round-to-nearest-even cast. Both
    give the same bits (NaN stays NaN)."""
    if ON_BITS:
        x = round_to_bf16(x)
    else:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def round_to_dtype(x, KIND: tl.constexpr, ON_BITS: tl.constexpr):
    """fp32 -> the nearest-even value of a storage dtype (`DTYPE_KIND`: 0 fp32, 1 bf16,
    2 fp16), kept in fp32 (exact on store): bf16 on the bits only where `ON_BITS` (the
    interpreter, see `interpreted`), else through the native cast."""
    if KIND == 1:
        x = round_bf16_native_or_bits(x, ON_BITS)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x
