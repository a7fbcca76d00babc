"""Greedy Markov-head draft loop in gamma + 1 launches instead of ~8 per position
(`markov_greedy_ref` is the spec; `reference.py` gives the loop).

Launch plan (graph-safe, no host sync): one launch of ``_markov_step_kernel`` per position over
the grid (row blocks, vocab chunks), then one tiny resolve launch. A program of position k
  1. resolves its rows' ``prev`` (k = 0: the anchors; k > 0: the winner of position k - 1, by
     reducing the previous launch's per-chunk (max, first argmax) partials -- a small redundant
     reduction in every program instead of a separate combine launch); chunk 0 stores it as
     ``drafts[:, k - 1]``;
  2. gathers ``e = W1[prev]`` (chunk 0 stores it as ``embeds[:, k]``), rounds it to W2's dtype;
  3. computes its vocab chunk of ``z`` (fp32 accumulation, then rounded to W2's dtype like
     torch's 16-bit matmul output, then added in fp32 to the base logits), stores it to
     ``step_logits[:, k]`` and its (max, first argmax index) to the workspace.
The last launch (grid = row blocks) only runs step 1 for k = gamma, writing ``drafts[:, -1]``.
W2 is read once per position for a whole row block (B = 1 uses a broadcast GEMV, B >= 2 a
``tl.dot`` with the rows padded to 16 or 32), so the traffic is about
``gamma * (V * r * elem(W2) + B * V * (elem(U) + 4))``.

Exactness: drafts are bit-exact with respect to the kernel's own ``step_logits``
(``drafts[b, k] == torch.argmax(step_logits[b, k])`` including ties and NaN) and ``embeds`` is an
exact copy of ``W1[prev]``. ``step_logits`` is within a tolerance of the reference: the dot
product's summation order differs from the BLAS, so a 16-bit W2 may put the bias one ulp of W2's
dtype apart (fp32 W2: a few fp32 ulps of the dot). A different ``z`` can flip a near-tie, after
which the chains of kernel and reference diverge; drafts equal the reference whenever the top-1
margin exceeds that rounding. The 16-bit roundings are nearest-even on the bits (bf16) and the
hardware cast (fp16), so they match torch on GPU and in the interpreter. On GPU the B >= 2 path
uses the native 16-bit MMA (fp32 accumulation; fp32 W2 uses an IEEE fp32 dot); on CPU tensors
(the interpreter, whose bf16 ``tl.dot`` is not a float product) it upcasts the operands to fp32
first, which is the same math because products of 16-bit values are exact in fp32.

Argmax order = ``torch.argmax``: NaN beats every number (first NaN wins), equal maxima -> the
smallest index (``-0.0 == +0.0``), a row of ``-inf`` -> index 0.

Caller contract (not checked on the device): ``0 <= anchors < V``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    prefetch_tile_l2,
    programmatic_launch,
    round_to_storage,
    wait_for_producers,
)
from sgl_dspark.kernels.spec.reference import MarkovGreedyOutput

_MAX_RANK = 1024
# Workspace index of "no candidate": above every vocab index (int32 workspace).
_NO_INDEX = (1 << 31) - 1
# ~2 programs per SM on a GPU of ~130 SMs (1 per CU on one of ~256 CUs) at B <= 32.
_TARGET_CHUNKS = 256
# A program streams at least this many bytes of W2; smaller chunks only add partials.
_MIN_CHUNK_BYTES = 16384
# Elements of one W2 tile [BLOCK_V, BLOCK_R] (16 KB in bf16), of one z tile [BLOCK_B, BLOCK_V]
# on the tl.dot path, and of one partials tile [BLOCK_B, BLOCK_P]: with 8 warps these stay
# within ~130 registers a thread without spills for r <= 256.
_TILE_ELEMS = 8192
_Z_TILE_ELEMS = 1024
_NUM_WARPS = 8
_MAX_CHUNKS = 65535  # grid axis 1 limit


@triton.jit
def _fold_argmax(best_val, best_idx, vals, idx, valid, NO_INDEX: tl.constexpr):
    """Fold candidates ``vals``/``idx`` [R, N] (``valid`` mask) into the per-row best [R] under
    torch.argmax order: NaN first, then larger value, then smaller index. Order-independent, so
    blocks, chunks and partials can be folded in any order. The best is NaN iff a NaN was seen."""
    is_nan = (vals != vals) & valid
    nan_idx = tl.min(tl.where(is_nan, idx, NO_INDEX), axis=1)
    has_nan = nan_idx < NO_INDEX
    finite = tl.where(is_nan | (valid == 0), float("-inf"), vals)
    block_max = tl.max(finite, axis=1)
    max_idx = tl.min(tl.where((finite == block_max[:, None]) & valid, idx, NO_INDEX), axis=1)
    cand_val = tl.where(has_nan, float("nan"), block_max)
    cand_idx = tl.where(has_nan, nan_idx, max_idx)
    best_nan = best_val != best_val
    earlier = cand_idx < best_idx
    better_nan = has_nan & ((best_nan == 0) | earlier)
    better_num = (
        (has_nan == 0)
        & (best_nan == 0)
        & ((block_max > best_val) | ((block_max == best_val) & earlier))
    )
    better = better_nan | better_num
    return tl.where(better, cand_val, best_val), tl.where(better, cand_idx, best_idx)


@triton.jit(do_not_specialize=["k"])
def _markov_step_kernel(
    base_ptr,
    w1_ptr,
    w2_ptr,
    anchors_ptr,
    drafts_ptr,
    logits_ptr,
    embeds_ptr,
    part_val_ptr,
    part_idx_ptr,
    k,
    batch,
    gamma,
    vocab,
    rank,
    chunk,
    num_chunks,
    stride_base_b,
    stride_base_g,
    stride_w1,
    stride_w2,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    RESOLVE_PREV: tl.constexpr,
    COMPUTE: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    ROUND_KIND: tl.constexpr,
    NO_INDEX: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row block, chunk) of position k; see the module docstring for the three steps."""
    pid_c = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < batch
    rows = rows.to(tl.int64)
    if COMPUTE and PDL:
        # W2 is a parameter and dominates the bytes: the chunk's first tile streams into L2
        # while the previous kernel finishes. A prefetch, not a load held in registers: peeling
        # the first tile out of the loop would cost ~60 registers a thread (one resident
        # program per SM instead of two). Rows clamped into the chunk (< end <= V).
        first_cols = tl.minimum(
            pid_c * chunk + tl.arange(0, BLOCK_V), tl.minimum(pid_c * chunk + chunk, vocab) - 1
        )
        prefetch_tile_l2(w2_ptr, first_cols, stride_w2, 0, rank, BLOCK_R)
    # The partials / anchors and U come from earlier kernels, and every output may still be read.
    wait_for_producers(PDL)
    if RESOLVE_PREV:
        best_val = tl.full((BLOCK_B,), float("-inf"), tl.float32)
        best_idx = tl.full((BLOCK_B,), NO_INDEX, tl.int32)
        part_row = (rows * gamma + (k - 1)) * num_chunks
        parts = tl.arange(0, BLOCK_P)
        for p0 in range(0, num_chunks, BLOCK_P):
            ok = row_ok[:, None] & (p0 + parts < num_chunks)[None, :]
            offs = part_row[:, None] + (p0 + parts)[None, :]
            vals = tl.load(part_val_ptr + offs, mask=ok, other=float("-inf"))
            idx = tl.load(part_idx_ptr + offs, mask=ok, other=NO_INDEX)
            best_val, best_idx = _fold_argmax(best_val, best_idx, vals, idx, ok, NO_INDEX)
        prev = tl.where(row_ok, best_idx, 0).to(tl.int64)
        tl.store(drafts_ptr + rows * gamma + (k - 1), prev, mask=row_ok & (pid_c == 0))
    else:
        prev = tl.load(anchors_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if COMPUTE:
        rk = tl.arange(0, BLOCK_R)
        er_ok = row_ok[:, None] & (rk < rank)[None, :]
        e = tl.load(w1_ptr + prev[:, None] * stride_w1 + rk[None, :], mask=er_ok, other=0.0)
        emb_offs = (rows * gamma + k)[:, None] * rank + rk[None, :]
        tl.store(embeds_ptr + emb_offs, e, mask=er_ok & (pid_c == 0))
        # e.to(W2 dtype): exact when the dtypes agree, RNE otherwise.
        e_w = round_to_storage(e.to(tl.float32), ROUND_KIND).to(w2_ptr.dtype.element_ty)
        best_val = tl.full((BLOCK_B,), float("-inf"), tl.float32)
        best_idx = tl.full((BLOCK_B,), NO_INDEX, tl.int32)
        start = pid_c * chunk
        end = tl.minimum(start + chunk, vocab)
        cols_in_block = tl.arange(0, BLOCK_V)
        base_row = base_ptr + rows[:, None] * stride_base_b + k * stride_base_g
        out_row = logits_ptr + (rows * gamma + k)[:, None] * vocab
        for v0 in range(start, end, BLOCK_V):
            cols = v0 + cols_in_block
            col_ok = cols < end
            w = tl.load(
                w2_ptr + cols.to(tl.int64)[:, None] * stride_w2 + rk[None, :],
                mask=col_ok[:, None] & (rk < rank)[None, :],
                other=0.0,
            )
            if USE_DOT:
                if DOT_IN_FP32:  # fp32 W2, or the interpreter (no bf16 dot there)
                    acc = tl.dot(
                        e_w.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee"
                    )
                else:
                    acc = tl.dot(e_w, tl.trans(w), out_dtype=tl.float32)
            else:  # one row: broadcast GEMV, no padding of the rows to the MMA minimum
                prod = e_w.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
                acc = tl.sum(prod, axis=2)
            bias = round_to_storage(acc, ROUND_KIND)
            ok = row_ok[:, None] & col_ok[None, :]
            u = tl.load(base_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            z = u + bias
            tl.store(out_row + cols[None, :], z, mask=ok)
            cand_idx = tl.broadcast_to(cols[None, :], (BLOCK_B, BLOCK_V))
            best_val, best_idx = _fold_argmax(best_val, best_idx, z, cand_idx, ok, NO_INDEX)
        part_offs = (rows * gamma + k) * num_chunks + pid_c
        tl.store(part_val_ptr + part_offs, best_val, mask=row_ok)
        tl.store(part_idx_ptr + part_offs, best_idx, mask=row_ok)


class _Plan(NamedTuple):
    block_b: int
    use_dot: bool
    block_r: int
    block_v: int
    chunk: int
    num_chunks: int
    block_p: int


def _plan(batch: int, vocab: int, rank: int, w2_elem: int, num_chunks: int | None) -> _Plan:
    """Tiling from the shapes only (graph-safe). ``num_chunks`` forces the chunk count (tests)."""
    # tl.dot needs >= 16 rows; B = 1 pads to 16 too: the matrix-unit path streams W2 faster
    # than a broadcast GEMV (`benchmark/kernels/bench_markov.py` measures it).
    block_b = 16 if batch <= 16 else 32
    block_r = max(16, triton.next_power_of_2(rank))
    block_v = max(16, min(128, _TILE_ELEMS // block_r, _Z_TILE_ELEMS // block_b))
    if num_chunks is not None:
        require(
            1 <= num_chunks <= _MAX_CHUNKS,
            f"num_chunks must lie in [1, {_MAX_CHUNKS}], got {num_chunks}",
        )
        chunk = triton.cdiv(vocab, num_chunks)
    else:
        chunk = max(
            triton.cdiv(vocab, _TARGET_CHUNKS), triton.cdiv(_MIN_CHUNK_BYTES, rank * w2_elem)
        )
        chunk = triton.cdiv(chunk, block_v) * block_v
    parts = triton.cdiv(vocab, chunk)
    if parts > _MAX_CHUNKS:  # only for V beyond any real vocabulary
        chunk = triton.cdiv(vocab, _MAX_CHUNKS)
        parts = triton.cdiv(vocab, chunk)
    block_p = max(2, min(128, _Z_TILE_ELEMS // block_b, triton.next_power_of_2(parts)))
    return _Plan(block_b, True, block_r, block_v, chunk, parts, block_p)


def _check_out(out: MarkovGreedyOutput, shapes: MarkovGreedyOutput, device: torch.device) -> None:
    for name, got, want in zip(MarkovGreedyOutput._fields, out, shapes):
        require(
            got.shape == want.shape and got.dtype == want.dtype and (got.device == device),
            f"out.{name} must be {want.dtype} {tuple(want.shape)} on {device}, "
            f"got {got.dtype} {tuple(got.shape)} on {got.device}",
        )
        require(got.is_contiguous(), f"out.{name} must be contiguous")


def _check_inputs(
    base_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, anchors: torch.Tensor
) -> None:
    require(
        base_logits.dim() == 3,
        f"base_logits must be 3-D [B, G, V], got shape {tuple(base_logits.shape)}",
    )
    for name, t in (("base_logits", base_logits), ("w1", w1), ("w2", w2)):
        require(t.dtype in FLOAT_DTYPES, f"{name} dtype must be fp32/bf16/fp16, got {t.dtype}")
        require(
            t.device == base_logits.device,
            f"{name} is on {t.device}, base_logits on {base_logits.device}",
        )
    batch, _, vocab = base_logits.shape
    require(1 <= vocab < _NO_INDEX, f"base_logits: vocab V must lie in [1, 2**31 - 1), got {vocab}")
    require(
        w1.dim() == 2 and w2.dim() == 2 and (w1.shape == w2.shape) and (w1.shape[0] == vocab),
        f"w1 and w2 must both be [V={vocab}, r], got {tuple(w1.shape)} and {tuple(w2.shape)}",
    )
    require(
        1 <= w1.shape[1] <= _MAX_RANK,
        f"w1/w2: markov rank r must lie in [1, {_MAX_RANK}], got {w1.shape[1]}",
    )
    require(
        w1.stride(1) == 1 and w2.stride(1) == 1 and (base_logits.stride(2) == 1),
        "base_logits, w1 and w2 must have unit stride in their last dim",
    )
    require(
        anchors.shape == (batch,) and anchors.dtype in INDEX_DTYPES,
        f"anchors must be int64/int32 [{batch}], got {anchors.dtype} {tuple(anchors.shape)}",
    )
    require(
        anchors.device == base_logits.device,
        f"anchors is on {anchors.device}, base_logits on {base_logits.device}",
    )


def markov_greedy(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    anchors: torch.Tensor,
    *,
    out: MarkovGreedyOutput | None = None,
    num_chunks: int | None = None,
) -> MarkovGreedyOutput:
    """Greedy Markov-head drafts for all rows: G + 1 launches, no host sync (graph-capturable).

    Args:
        base_logits: U [B, G, V] fp32/bf16/fp16, unit stride along V (other strides free).
        w1: [V, r] Markov embedding table, w2: [V, r] Markov output weight (fp32/bf16/fp16,
            unit stride along r, 1 <= r <= 1024; their dtypes may differ).
        anchors: [B] int64/int32 in [0, V) -- the caller's contract, not checked on device.
        out: optional preallocated contiguous outputs (drafts int64 [B, G], step_logits fp32
            [B, G, V], embeds w1.dtype [B, G, r]).
        num_chunks: force this many vocab chunks per launch (tests); default from the shapes.
    Returns:
        ``MarkovGreedyOutput(drafts, step_logits, embeds)`` as ``markov_greedy_ref`` (see the
        module docstring for the exactness).
    """
    _check_inputs(base_logits, w1, w2, anchors)
    batch, gamma, vocab = base_logits.shape
    rank = w1.shape[1]
    device = base_logits.device
    if out is None:
        out = MarkovGreedyOutput(
            torch.empty((batch, gamma), dtype=torch.int64, device=device),
            torch.empty((batch, gamma, vocab), dtype=torch.float32, device=device),
            torch.empty((batch, gamma, rank), dtype=w1.dtype, device=device),
        )
    else:
        want = MarkovGreedyOutput(
            torch.empty((batch, gamma), dtype=torch.int64, device="meta"),
            torch.empty((batch, gamma, vocab), dtype=torch.float32, device="meta"),
            torch.empty((batch, gamma, rank), dtype=w1.dtype, device="meta"),
        )
        _check_out(out, want, device)
    if batch == 0 or gamma == 0:
        return out
    plan = _plan(batch, vocab, rank, w2.element_size(), num_chunks)
    part_val = torch.empty((batch, gamma, plan.num_chunks), dtype=torch.float32, device=device)
    part_idx = torch.empty((batch, gamma, plan.num_chunks), dtype=torch.int32, device=device)
    row_blocks = triton.cdiv(batch, plan.block_b)
    # Row blocks on the fast grid axis: the blocks sharing a W2 chunk run together (L2 reuse).
    # On CPU tensors the kernel runs in the interpreter, whose bf16 tl.dot is not a float dot.
    dot_in_fp32 = w2.dtype == torch.float32 or interpreted(_markov_step_kernel)
    for k in range(gamma + 1):
        compute = k < gamma
        _markov_step_kernel[(row_blocks, plan.num_chunks if compute else 1)](
            base_logits,
            w1,
            w2,
            anchors,
            out.drafts,
            out.step_logits,
            out.embeds,
            part_val,
            part_idx,
            k,
            batch,
            gamma,
            vocab,
            rank,
            plan.chunk,
            plan.num_chunks,
            base_logits.stride(0),
            base_logits.stride(1),
            w1.stride(0),
            w2.stride(0),
            BLOCK_B=plan.block_b,
            BLOCK_V=plan.block_v,
            BLOCK_R=plan.block_r,
            BLOCK_P=plan.block_p,
            RESOLVE_PREV=k > 0,
            COMPUTE=compute,
            USE_DOT=plan.use_dot,
            DOT_IN_FP32=dot_in_fp32,
            ROUND_KIND=DTYPE_KIND[w2.dtype],
            NO_INDEX=_NO_INDEX,
            num_warps=_NUM_WARPS,
            **programmatic_launch(_markov_step_kernel, device),
        )
    return out
