"""The online-softmax step shared by the attention kernels (`window_sparse.py`, `draft.py`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(
    q, keys, valid, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr, ROUND_P: tl.constexpr
):
    """One tile of keys [BLOCK_N, D] for the query rows q [ROWS, D]: the running max m_i, sum
    l_i and unnormalised accumulator acc updated, logits in the log2 domain (qk_scale includes
    log2(e)). Masked keys (valid false) contribute exactly nothing as long as m_i starts finite
    (the callers start it at the sink). ROUND_P: 16-bit keys, the probabilities enter the PV
    product in the key dtype, as the reference rounds them. DOT_FP32: the products in fp32
    (ieee; fp32 inputs must not go through tf32)."""
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(keys))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    # m_i starts at the (finite) sink, so m_new is finite and masked keys give exp2(-inf) = 0.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if ROUND_P:  # 16-bit keys: probabilities enter the PV product in the key dtype
        p = p.to(keys.dtype)
    if DOT_FP32:
        pv = tl.dot(p.to(tl.float32), keys.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, keys)
    return m_new, l_i, acc * alpha[:, None] + pv
