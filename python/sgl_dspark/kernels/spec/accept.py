"""Speculative acceptance finalised on device (greedy, sampled, or mixed per row) in one or two
launches (`spec_accept_ref` is the spec; `reference.py` gives the rules). Bit-exact: the sampled
draw is the fixed-point inverse CDF of `sampling/reference.py`, integer arithmetic only, so
identical uniforms give identical tokens.

Work split: one program scanning a 129k-vocab row is a long serial chain of loads, so with few
rows the sampled draw takes two launches over vocab chunks (grid [B, C], C from the shapes,
``_plan_vocab_chunks``): phase 1 writes each chunk's integer masses; phase 2 finds the chunk whose
CDF crosses the threshold, whose program alone rescans it and writes the row (the token does not
depend on C). Greedy-only steps and large batches: one launch, one program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import check_tensor, require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels.sampling.reference import FIXED_POINT_BITS, UNIFORM_BITS
from sgl_dspark.kernels.spec.reference import MIN_RESIDUAL_MASS, AcceptOutput


@triton.jit
def _scan_chunk(
    p_row_ptr,
    q_row_ptr,
    use_q,
    start,
    end,
    carry,
    threshold,
    BLOCK_V: tl.constexpr,
    FIXED_ONE: tl.constexpr,
    COUNT: tl.constexpr,
):
    """Columns [start, end) of a bonus row, weights ``trunc(max(P - Q, 0) * 2**40)`` (Q masked
    by ``use_q``). COUNT=False: (P mass, weight mass). COUNT=True: (number of columns whose CDF,
    starting from ``carry``, is <= threshold, 0). Integer sums: any tree gives the same values."""
    offs = tl.arange(0, BLOCK_V)
    first = tl.zeros((), tl.int64)
    second = tl.zeros((), tl.int64)
    for block in range(start, end, BLOCK_V):
        idx = block + offs
        ok = idx < end
        p = tl.maximum(tl.load(p_row_ptr + idx, mask=ok, other=0.0), 0.0)
        q = tl.load(q_row_ptr + idx, mask=ok & use_q, other=0.0)
        weight = (tl.maximum(p - q, 0.0) * FIXED_ONE).to(tl.int64)
        if COUNT:
            cdf = tl.cumsum(weight, axis=0) + carry
            first += tl.sum(((cdf <= threshold) & ok).to(tl.int64), axis=0)
            carry += tl.sum(weight, axis=0)
        else:
            first += tl.sum((p * FIXED_ONE).to(tl.int64), axis=0)
            second += tl.sum(weight, axis=0)
    return first, second


@triton.jit
def _threshold(total, uniform, U_BITS: tl.constexpr):
    """floor(total * u24 / 2**24) in int64 without overflow (module doc, step 3)."""
    u24 = (uniform * (1 << U_BITS)).to(tl.int64)
    u24 = tl.minimum(tl.maximum(u24, 0), (1 << U_BITS) - 1)
    return (total >> U_BITS) * u24 + (((total & ((1 << U_BITS) - 1)) * u24) >> U_BITS)


@triton.jit
def _spec_accept_kernel(
    verify_ids_ptr,
    verify_lens_ptr,
    seq_lens_ptr,
    target_ids_ptr,
    forced_ptr,
    greedy_mask_ptr,
    p_ptr,
    q_ptr,
    accept_u_ptr,
    sample_u_ptr,
    sums_ptr,
    accept_scratch_ptr,
    accept_lens_ptr,
    commit_lens_ptr,
    out_tokens_ptr,
    next_anchors_ptr,
    new_seq_lens_ptr,
    vocab,
    chunk,
    num_chunks,
    p_stride_b,
    p_stride_w,
    q_stride_b,
    q_stride_w,
    fill_token,
    W: tl.constexpr,
    W_POW2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PHASE: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    HAS_FORCED: tl.constexpr,
    HAS_SAMPLED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    FIXED_ONE: tl.constexpr,
    MIN_RESIDUAL: tl.constexpr,
    U_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, c). PHASE 0: one program per row does everything (grid [B, 1]). Split
    sampled path, grid [B, C] with vocab chunk c = [c * chunk, +chunk): PHASE 1 writes the
    chunk's two fixed-point masses to ``sums[row, c]``; PHASE 2 reads all C of them, finds the
    chunk holding the sampled token, and that program alone scans it and writes the row
    (non-sampled rows are written by chunk 0)."""
    wait_for_producers(PDL)  # every input is the verify forward's or the last phase's output
    row = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    cols = tl.arange(0, W_POW2)
    verify_len = tl.load(verify_lens_ptr + row).to(tl.int32)
    verify_len = tl.minimum(tl.maximum(verify_len, 0), W)
    is_valid = verify_len > 0
    last = tl.maximum(verify_len - 1, 0)
    ids_ptr = verify_ids_ptr + row * W
    # drafts[c] = verify_ids[row, c + 1]: the token emitted at column c when accepted.
    drafts = tl.load(ids_ptr + cols + 1, mask=cols + 1 < W, other=0)
    in_window = cols < last
    if PHASE != 1:
        # Only needed for the final stores, but loaded now so they share the first round trip.
        anchor = tl.load(ids_ptr)
        seq_len = tl.load(seq_lens_ptr + row)
        uniform = tl.load(sample_u_ptr + row) if HAS_SAMPLED else 0.0
    accept = tl.zeros((), tl.int32)
    bonus = tl.zeros((), tl.int64)
    writer = pid_c == 0
    if HAS_GREEDY and PHASE != 1:
        target = tl.load(target_ids_ptr + row * W + cols, mask=cols < W, other=0).to(tl.int64)
        if HAS_FORCED:  # simulated acceptance: the count is given, the bonus is the target's
            accept = tl.minimum(tl.maximum(tl.load(forced_ptr + row).to(tl.int32), 0), last)
        else:
            mismatch = in_window & (drafts != target)
            accept = tl.min(tl.where(mismatch, cols, last), axis=0)
        # Picked from the loaded row (accept < W): no second, dependent round trip.
        bonus = tl.sum(tl.where(cols == accept, target, 0), axis=0)
    if HAS_SAMPLED:
        run_sampler = is_valid
        if HAS_MASK:
            run_sampler = run_sampler & (tl.load(greedy_mask_ptr + row) == 0)
        chunk_ids = tl.arange(0, BLOCK_C)
        p_mass = tl.zeros((BLOCK_C,), tl.int64)
        res_mass = tl.zeros((BLOCK_C,), tl.int64)
        accept_s = tl.zeros((), tl.int32)
        if PHASE == 2:
            # Issued before the row's rule is known, so the header, the phase-1 accept length
            # and every chunk's masses arrive in one round trip (scratch rows of greedy and
            # padding rows hold garbage that is never used).
            sums = sums_ptr + (row * num_chunks + chunk_ids) * 2
            p_mass = tl.load(sums, mask=chunk_ids < num_chunks, other=0)
            res_mass = tl.load(sums + 1, mask=chunk_ids < num_chunks, other=0)
            accept_s = tl.load(accept_scratch_ptr + row)
        # Greedy and padding rows skip the vocab scans entirely.
        if run_sampler:
            if PHASE != 2:
                valid_id = in_window & (drafts >= 0) & (drafts < vocab)
                p_rows = p_ptr + row * p_stride_b + cols * p_stride_w
                q_rows = q_ptr + row * q_stride_b + cols * q_stride_w
                p_draft = tl.load(p_rows + drafts, mask=valid_id, other=0.0)
                q_draft = tl.load(q_rows + drafts, mask=valid_id, other=0.0)
                u_draft = tl.load(accept_u_ptr + row * (W - 1) + cols, mask=in_window, other=0.0)
                rejected = in_window & ((u_draft * q_draft < p_draft) == 0)
                accept_s = tl.min(tl.where(rejected, cols, last), axis=0)
            # The bonus row: P at the accept length; Q there only after a rejection.
            p_row = p_ptr + row * p_stride_b + accept_s * p_stride_w
            q_row = q_ptr + row * q_stride_b + accept_s * q_stride_w
            use_q = accept_s < last
            if PHASE == 1:
                start = pid_c * chunk
                chunk_p, chunk_res = _scan_chunk(
                    p_row,
                    q_row,
                    use_q,
                    start,
                    tl.minimum(start + chunk, vocab),
                    0,
                    0,
                    BLOCK_V,
                    FIXED_ONE,
                    False,
                )
                tl.store(sums_ptr + (row * num_chunks + pid_c) * 2, chunk_p)
                tl.store(sums_ptr + (row * num_chunks + pid_c) * 2 + 1, chunk_res)
                if pid_c == 0:
                    tl.store(accept_scratch_ptr + row, accept_s)
            else:
                token = tl.zeros((), tl.int64)
                if PHASE == 0:
                    p_total, res_total = _scan_chunk(
                        p_row, q_row, use_q, 0, vocab, 0, 0, BLOCK_V, FIXED_ONE, False
                    )
                    use_residual = res_total > MIN_RESIDUAL
                    total = tl.where(use_residual, res_total, p_total)
                    threshold = _threshold(total, uniform, U_BITS)
                    token, _ = _scan_chunk(
                        p_row,
                        q_row,
                        use_q & use_residual,
                        0,
                        vocab,
                        tl.zeros((), tl.int64),
                        threshold,
                        BLOCK_V,
                        FIXED_ONE,
                        True,
                    )
                else:
                    use_residual = tl.sum(res_mass, axis=0) > MIN_RESIDUAL
                    mass = tl.where(use_residual, res_mass, p_mass)
                    total = tl.sum(mass, axis=0)
                    threshold = _threshold(total, uniform, U_BITS)
                    # The token lies in the first chunk whose inclusive CDF exceeds the
                    # threshold: every column before it has CDF <= threshold, none after.
                    inclusive = tl.cumsum(mass, axis=0)
                    below = (inclusive <= threshold) & (chunk_ids < num_chunks)
                    owner = tl.sum(below.to(tl.int32), axis=0)
                    owner = tl.where(total > 0, owner, 0)
                    writer = pid_c == owner
                    if writer:
                        carry = tl.sum(tl.where(chunk_ids < owner, mass, 0), axis=0)
                        start = owner * chunk
                        count, _ = _scan_chunk(
                            p_row,
                            q_row,
                            use_q & use_residual,
                            start,
                            tl.minimum(start + chunk, vocab),
                            carry,
                            threshold,
                            BLOCK_V,
                            FIXED_ONE,
                            True,
                        )
                        token = start + count
                accept = accept_s
                bonus = tl.where(total > 0, token, 0)
    if PHASE != 1:
        if writer:
            accept = tl.where(is_valid, accept, 0)
            commit = tl.where(is_valid, accept + 1, 0)
            out = tl.where(cols < accept, drafts, fill_token)
            out = tl.where(cols == accept, bonus, out)
            out = tl.where(is_valid, out, fill_token)
            tl.store(out_tokens_ptr + row * W + cols, out, mask=cols < W)
            tl.store(accept_lens_ptr + row, accept)
            tl.store(commit_lens_ptr + row, commit)
            tl.store(next_anchors_ptr + row, tl.where(is_valid, bonus, anchor))
            tl.store(new_seq_lens_ptr + row, (seq_len + commit).to(seq_len.dtype))


# Split sampled scan: ~8 resident programs per SM on a GPU of ~130 SMs per launch, >= 512
# columns (4 KB of P and Q) per program, and at most 256 chunks (phase 2 loads every chunk's
# masses).
_TARGET_PROGRAMS = 1024
_MIN_CHUNK = 512
_MAX_CHUNKS = 256
_MAX_FORCED_CHUNKS = 1024


def _plan_vocab_chunks(rows: int, vocab: int, num_chunks: int | None) -> tuple[int, int, int]:
    """(chunks per row, columns per chunk, BLOCK_V) from the shapes only (graph-safe)."""
    if num_chunks is not None:  # tests: exactly this many, possibly empty past the vocab
        require(
            1 <= num_chunks <= _MAX_FORCED_CHUNKS,
            f"num_chunks must lie in [1, {_MAX_FORCED_CHUNKS}], got {num_chunks}",
        )
        chunk = triton.cdiv(vocab, num_chunks)
        return num_chunks, chunk, max(16, min(4096, triton.next_power_of_2(chunk)))
    per_row = min(_MAX_CHUNKS, triton.cdiv(vocab, _MIN_CHUNK), triton.cdiv(_TARGET_PROGRAMS, rows))
    chunk = triton.cdiv(vocab, max(1, per_row))
    block_v = max(16, min(4096, triton.next_power_of_2(chunk)))
    chunk = triton.cdiv(chunk, block_v) * block_v  # whole blocks: one or more full loads each
    return triton.cdiv(vocab, chunk), chunk, block_v


def _check_given(
    t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    require(t is not None, f"{name} is required")
    assert t is not None
    check_tensor(name, t, shape, dtypes, t.device)
    return t


def _check_sampling_inputs(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor | None,
    sample_uniforms: torch.Tensor | None,
    rows: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require(
        target_probs.dim() == 3
        and target_probs.shape[:2] == (rows, width)
        and target_probs.shape[2] >= 1
        and target_probs.dtype == torch.float32
        and target_probs.stride(-1) == 1,
        f"target_probs must be fp32 [{rows}, {width}, V>=1] with unit V stride, got "
        f"{target_probs.dtype} {tuple(target_probs.shape)}",
    )
    vocab = target_probs.shape[2]
    require(
        draft_probs is not None
        and draft_probs.shape == (rows, width - 1, vocab)
        and draft_probs.dtype == torch.float32
        and (draft_probs.numel() == 0 or draft_probs.stride(-1) == 1),
        f"draft_probs must be fp32 [{rows}, {width - 1}, {vocab}] with unit V stride",
    )
    assert draft_probs is not None
    accept_uniforms = _check_given(
        accept_uniforms, "accept_uniforms", (rows, width - 1), (torch.float32,)
    )
    sample_uniforms = _check_given(sample_uniforms, "sample_uniforms", (rows,), (torch.float32,))
    return draft_probs, accept_uniforms, sample_uniforms


def _output_buffers(
    out: AcceptOutput | None, rows: int, width: int, seq_dtype: torch.dtype, device: torch.device
) -> AcceptOutput:
    dtypes = (torch.int32, torch.int32, torch.int64, torch.int64, seq_dtype)
    shapes = ((rows,), (rows,), (rows, width), (rows,), (rows,))
    if out is None:
        return AcceptOutput(
            *(torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes))
        )
    for name, buf, dtype, shape in zip(AcceptOutput._fields, out, dtypes, shapes):
        check_tensor(f"out.{name}", buf, shape, (dtype,), device)
    return out


def spec_accept(
    verify_ids: torch.Tensor,
    verify_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    target_ids: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    accept_uniforms: torch.Tensor | None = None,
    sample_uniforms: torch.Tensor | None = None,
    greedy_mask: torch.Tensor | None = None,
    fill_token: int = -1,
    out: AcceptOutput | None = None,
    num_chunks: int | None = None,
    forced_accept: torch.Tensor | None = None,
) -> AcceptOutput:
    """Finalise one verify step on device (no host sync; graph-capturable): one launch, or two
    when the sampled rule splits the vocab scan over chunks (``_plan_vocab_chunks``).

    Args:
        verify_ids: int64 [B, W] contiguous; column 0 the anchor, columns 1.. the drafts.
        verify_lens: int32/int64 [B]; tokens verified per row (0 = padding row), clamped to [0, W].
        seq_lens: int32/int64 [B]; committed length before the step.
        target_ids: int32/int64 [B, W] target argmax per verify row (greedy rule), or None.
        target_probs: fp32 [B, W, V] target probabilities after temperature/top-k/top-p (sampled
            rule), unit stride along V, or None. Requires draft_probs and both uniforms.
        draft_probs: fp32 [B, W-1, V]; row j-1 is the distribution draft j was drawn from.
        accept_uniforms: fp32 [B, W-1] contiguous in [0, 1); column j-1 tests draft j.
        sample_uniforms: fp32 [B] contiguous in [0, 1); drives the correction/bonus draw.
        greedy_mask: bool [B]; required when both rules are given (True = greedy rule).
        fill_token: value written to out_tokens after the bonus column.
        out: optional preallocated ``AcceptOutput`` (static graph buffers) with the output dtypes.
        num_chunks: force the sampled vocab scan into this many chunks per row (1 = one program
            per row, one launch); default from the shapes. Tests use it; results never change.
        forced_accept: int32/int64 [B] (greedy rule only): simulated acceptance, module doc.
    Returns:
        ``AcceptOutput`` (see the module docstring for the exact rule).
    Raises:
        ValueError: a missing operand or a wrong shape/dtype/layout (checked on the host only).
    """
    require(
        verify_ids.dim() == 2 and verify_ids.shape[1] >= 1,
        f"verify_ids must be [B, W>=1], got {tuple(verify_ids.shape)}",
    )
    rows, width = verify_ids.shape
    check_tensor("verify_ids", verify_ids, (rows, width), (torch.int64,), verify_ids.device)
    int_types = (torch.int32, torch.int64)
    _check_given(verify_lens, "verify_lens", (rows,), int_types)
    _check_given(seq_lens, "seq_lens", (rows,), int_types)
    require(
        target_ids is not None or target_probs is not None,
        "give target_ids (greedy rule) and/or target_probs (sampled rule)",
    )
    # Operands a constexpr switch leaves unused get a placeholder pointer.
    placeholder = verify_ids
    if target_ids is not None:
        check_tensor("target_ids", target_ids, (rows, width), int_types, verify_ids.device)
    p_arg, q_arg, ua_arg, us_arg, vocab = placeholder, placeholder, placeholder, placeholder, 1
    if target_probs is not None:
        draft, ua_arg, us_arg = _check_sampling_inputs(
            target_probs, draft_probs, accept_uniforms, sample_uniforms, rows, width
        )
        p_arg, vocab = target_probs, target_probs.shape[2]
        q_arg = draft if draft.numel() > 0 else target_probs  # W == 1: Q is never read
    if forced_accept is not None:  # the greedy rule alone
        require(
            target_ids is not None and target_probs is None, "forced_accept needs target_ids only"
        )
        _check_given(forced_accept, "forced_accept", (rows,), int_types)
    has_mask = target_ids is not None and target_probs is not None
    mask_arg = placeholder
    if has_mask:
        mask_arg = _check_given(greedy_mask, "greedy_mask", (rows,), (torch.bool,))
        mask_arg = mask_arg.view(torch.uint8)
    else:
        require(greedy_mask is None, "greedy_mask needs both target_ids and target_probs")
    out = _output_buffers(out, rows, width, seq_lens.dtype, verify_ids.device)
    if rows == 0:
        return out
    p_strides = (p_arg.stride(0), p_arg.stride(1)) if target_probs is not None else (0, 0)
    q_strides = (q_arg.stride(0), q_arg.stride(1)) if target_probs is not None else (0, 0)
    chunks, chunk, block_v = 1, vocab, 16  # greedy only: the vocab is never scanned
    if target_probs is not None:
        chunks, chunk, block_v = _plan_vocab_chunks(rows, vocab, num_chunks)
    sums, accept_scratch = placeholder, placeholder
    if chunks > 1:  # graph-safe scratch; phase 2 uses only what phase 1 wrote (sampled rows)
        sums = torch.empty((rows, chunks, 2), dtype=torch.int64, device=verify_ids.device)
        accept_scratch = torch.empty((rows,), dtype=torch.int32, device=verify_ids.device)
    for phase in (0,) if chunks == 1 else (1, 2):
        _spec_accept_kernel[(rows, chunks)](
            verify_ids,
            verify_lens,
            seq_lens,
            target_ids if target_ids is not None else placeholder,
            forced_accept if forced_accept is not None else placeholder,
            mask_arg,
            p_arg,
            q_arg,
            ua_arg,
            us_arg,
            sums,
            accept_scratch,
            *out,
            vocab,
            chunk,
            chunks,
            *p_strides,
            *q_strides,
            fill_token,
            W=width,
            W_POW2=triton.next_power_of_2(width),
            BLOCK_V=block_v,
            BLOCK_C=triton.next_power_of_2(chunks),
            PHASE=phase,
            HAS_GREEDY=target_ids is not None,
            HAS_FORCED=forced_accept is not None,
            HAS_SAMPLED=target_probs is not None,
            HAS_MASK=has_mask,
            FIXED_ONE=float(1 << FIXED_POINT_BITS),
            MIN_RESIDUAL=MIN_RESIDUAL_MASS,
            U_BITS=UNIFORM_BITS,
            **programmatic_launch(_spec_accept_kernel, verify_ids.device),
            # Greedy only: a row is W ids, one warp's work (fewer cross-warp reductions).
            num_warps=4 if target_probs is not None else 1,
        )
    return out
