"""How the quantised GEMMs' kernels load a weight kept as stored (`QuantizedWeight`): the
host-side choices each launcher makes from the weight and the device before it launches a kernel
built on `dequant.py`'s tile loaders: the K step, the pipeline depth, whether the scale bytes
are loaded a step ahead and how their rows are aligned, whether MXFP4 rows are copied 16 bytes
at a time or read as words, and whether NVIDIA's inline decode is compiled."""

from __future__ import annotations

import torch
import triton

from sgl_dspark.kernels._triton_utils import nvidia_sm90_or_later
from sgl_dspark.kernels.linear.reference import QuantizedWeight

# Channels of one K step of the quantised expert GEMMs and wide linear blocks (a power of two,
# so it divides the scale group or is a multiple of it): 256 FP8 or 128 MXFP4 bytes per row.
QUANT_BLOCK_K = 256


def quantized_stages(fmt: str | None, stages: int) -> int:
    """Software-pipeline depth of a GEMM on a weight of format `fmt` (None: unquantised) that
    would take `stages`: at most three for MXFP4, whose K loop (two dots per step) Triton 3.6's
    AMD pipeliner fails to compile at four (gfx950); one launch shape on every target."""
    return min(stages, 3) if fmt == "mxfp4" else stages


def scales_loaded_ahead(weight: QuantizedWeight, columns: int, block_k: int, warps: int) -> bool:
    """`quantized_product`'s SCALES_AHEAD for a program of `columns` weight columns, K step
    `block_k` and `warps` warps: whether its scale bytes are loaded a step ahead.

    Triton's software pipeliner (3.6) copies a step's scale tile ([columns, block_k / group]
    bytes, spread over every thread) ahead asynchronously only when each thread gets at least
    4 contiguous bytes of it (the smallest asynchronous copy), no load is bounded along K
    (EVEN_K) and the rows are at least 4-byte aligned (SCALE_ALIGN); otherwise the tile is a
    plain load inside the K loop, whose latency the step waits for. Loaded ahead here: tiles of
    fewer than 4 bytes a thread with at least 8 groups a step, e.g. 16 columns of FP8 32 x 32
    or MXFP4 at 512-channel steps over 4 warps (the narrow linears: 2 bytes a thread). Not:
    steps of fewer than 8 groups (V4's FP8 128 x 128, 2 or 4 groups a step): carried from one
    iteration to the next, such a tile makes the compiler decode the weight in a layout the
    matrix unit cannot take from registers, a shared-memory round trip per step, and those
    loads stay in their step. `gpu_targets_check.py` compiles the quantised kernels for sm90
    and checks that a K loop never goes through shared memory, and never waits on a scale load
    of its own step unless a step holds fewer than 8 groups or a bound along K."""
    groups = block_k // weight.group
    return groups >= 8 and columns * groups < 4 * 32 * warps


def scale_alignment(weight: QuantizedWeight) -> int:
    """The kernels' SCALE_ALIGN: the largest power of two up to 16 that divides the scales'
    base address and every stride but the last, hence every scale row's address (base +
    expert x stride + row x stride), which the kernels tell the compiler (`tl.multiple_of` on
    the row pointers they form). Triton specialises only integers that are multiples of 16, so
    without it rows of 72 bytes (V4.1's expert down projection, K 2304) or 40 (its q_b, K 1280)
    would not be known 4-byte aligned, and their scale bytes could not be copied
    asynchronously."""
    scale = weight.scale
    align = 16
    for value in (scale.data_ptr(), *scale.stride()[:-1]):
        while value % align:
            align //= 2
    return align


def fp4_rows_aligned(weight: QuantizedWeight) -> bool:
    """Whether an MXFP4 weight's rows hold a multiple of 16 bytes (K a multiple of 32): the GEMMs'
    `ALIGNED` (16-byte copies of the code bytes)."""
    return weight.fmt == "mxfp4" and weight.data.shape[-1] % 16 == 0


def fp4_ptx_decode(device: torch.device) -> bool:
    """Whether the MXFP4 GEMMs on `device` decode their code bytes with inline PTX
    (`E2M1_SCALED_PTX`): compiled for an NVIDIA GPU of compute capability 9 or later (its
    packed bf16 multiply). The CPU interpreter, AMD and older GPUs take the portable decode,
    which gives the same bits."""
    return nvidia_sm90_or_later(device)


def quantized_block_k(fmt: str, k_dim: int, block_k: int = QUANT_BLOCK_K) -> int:
    """The K step of a quantised weight's tiles: `block_k` channels (a power of two), bounded by
    K's next power of two, at least one matrix-unit step (16 channels; for MXFP4 32, since the
    GEMMs multiply its even and odd channels in separate dots)."""
    least = 32 if fmt == "mxfp4" else 16
    return max(least, min(block_k, triton.next_power_of_2(max(k_dim, 1))))


def stored_rows(weight: QuantizedWeight) -> tuple[torch.Tensor, bool]:
    """The tensor a kernel reads the weight's rows from, and whether MXFP4 rows are read as
    uint32 words (`quantized_tile`'s WORDS): the packed bytes viewed as words when every row
    starts on a 4-byte boundary and holds a multiple of 16 bytes (K a multiple of 32), else the
    bytes (FP8: the data)."""
    data = weight.data
    if weight.fmt != "mxfp4":
        return data, False
    aligned = (
        data.shape[-1] % 16 == 0
        and data.stride(-1) == 1
        and all(s % 4 == 0 for s in data.stride()[:-1])
        and data.storage_offset() % 4 == 0
    )
    if not aligned:
        return data, False
    return data.view(torch.uint32), True


__all__ = [
    "QUANT_BLOCK_K",
    "fp4_ptx_decode",
    "fp4_rows_aligned",
    "quantized_block_k",
    "quantized_stages",
    "scale_alignment",
    "scales_loaded_ahead",
    "stored_rows",
]
