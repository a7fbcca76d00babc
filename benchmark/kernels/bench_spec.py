"""Benchmark cases for the draft/verify/accept kernels: rope, vocab argmax, acceptance, draft
inputs.

``CASES`` is a list of dicts with keys:
    name         str
    make_inputs  (M, device) -> dict of keyword arguments, at DeepSeek-V4-Flash decode shapes
    reference    (**inputs) -> output   (the unfused torch reference)
    launcher     (**inputs) -> output   (the Triton launcher; graph-capturable)
    check        (reference_output, launcher_output) -> None, raises AssertionError on mismatch
    bytes_moved  (M) -> int, the minimal HBM traffic of the fused op (bandwidth floor)
M is the number of token rows of the step: verify tokens bs * w for the argmax and the acceptance
(`_BS_W` maps M to (bs, w)), query tokens for the rope, requests for the draft inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sgl_dspark.kernels.rope.q_kv import rope_q_kv
from sgl_dspark.kernels.rope.reference import rope_q_kv_ref, rope_tail_ref
from sgl_dspark.kernels.rope.tail import rope_tail
from sgl_dspark.kernels.sampling.reference import vocab_argmax_ref
from sgl_dspark.kernels.sampling.vocab_argmax import shard_argmax_pairs, vocab_argmax
from sgl_dspark.kernels.spec.accept import spec_accept
from sgl_dspark.kernels.spec.draft_inputs import prepare_draft_inputs
from sgl_dspark.kernels.spec.reference import prepare_draft_inputs_ref, spec_accept_ref

VOCAB = 129280
TP = 4
VOCAB_LOCAL = VOCAB // TP  # 32320
HEADS_LOCAL, HEADS_PADDED, HEAD_DIM, ROPE_DIM = 16, 64, 512, 64
GAMMA = 5  # draft block; W_full = GAMMA + 1, Q = GAMMA (sample_from_anchor)
M_VALUES = (1, 4, 8, 24, 32, 128)
# The decode shapes: M -> (bs, w) (w = verify width; bs 1 verifies up to 8 tokens).
_BS_W = {1: (1, 1), 4: (1, 4), 8: (1, 8), 24: (8, 3), 32: (8, 4), 128: (32, 4)}


def _bs_w(m: int) -> tuple[int, int]:
    return _BS_W.get(m, (max(m // 4, 1), 4))


def _gen(m: int) -> torch.Generator:
    return torch.Generator().manual_seed(1234 + m)


def _check_equal(want: Any, got: Any) -> None:
    wants = want if isinstance(want, tuple) else (want,)
    gots = got if isinstance(got, tuple) else (got,)
    assert len(wants) == len(gots)
    for i, (w, g) in enumerate(zip(wants, gots)):
        assert torch.equal(w, g), f"output {i} differs"


def _check_bits(want: torch.Tensor, got: torch.Tensor) -> None:
    assert torch.equal(want.view(torch.int16), got.view(torch.int16)), "bf16 bits differ"


# ----------------------------------------------------------------------------- rope


def _rope_inputs(m: int, device: str, inverse: bool) -> dict[str, Any]:
    gen = _gen(m)
    heads_in, heads_out = (HEADS_PADDED, HEADS_LOCAL) if inverse else (HEADS_LOCAL, HEADS_PADDED)
    x = torch.randn(m, heads_in, HEAD_DIM, generator=gen).to(torch.bfloat16)
    angles = torch.rand(m, ROPE_DIM // 2, generator=gen) * 1000
    out = torch.empty(m, heads_out, HEAD_DIM, dtype=torch.bfloat16)
    tensors = dict(x=x, cos=angles.cos(), sin=angles.sin(), out=out)
    return {**{k: v.to(device) for k, v in tensors.items()}, "inverse": inverse}


def _rope_ref(x, cos, sin, out, inverse):
    return rope_tail_ref(x, cos, sin, inverse=inverse, out_heads=out.shape[1])


def _rope_launch(x, cos, sin, out, inverse):
    return rope_tail(x, cos, sin, inverse=inverse, out=out)


def _rope_bytes(m: int) -> int:
    return m * (HEADS_LOCAL * HEAD_DIM * 2 + HEADS_PADDED * HEAD_DIM * 2 + ROPE_DIM * 4)


# `rope_q_kv`: the q heads' norm + rope tail + head padding and the KV row's kv_norm +
# rope + store into the paged pool, one launch (the reference: the q chain, then the KV chain
# and its index_put, as an attention layer of the engine runs them unfused).
POOL_ROWS, NORM_EPS = 4096, 1e-6


def _rope_qkv_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    angles = torch.rand(m, ROPE_DIM // 2, generator=gen) * 1000
    tensors = dict(
        q=torch.randn(m, HEADS_LOCAL, HEAD_DIM, generator=gen).to(torch.bfloat16),
        kv=torch.randn(m, HEAD_DIM, generator=gen).to(torch.bfloat16),
        cos=angles.cos(),
        sin=angles.sin(),
        q_out=torch.empty(m, HEADS_PADDED, HEAD_DIM, dtype=torch.bfloat16),
        kv_norm_weight=(torch.rand(HEAD_DIM, generator=gen) + 0.5).to(torch.bfloat16),
        kv_out=torch.randn(POOL_ROWS, HEAD_DIM, generator=gen).to(torch.bfloat16),
        kv_rows=torch.randperm(POOL_ROWS, generator=gen)[:m],
    )
    return {k: v.to(device) for k, v in tensors.items()}


def _rope_qkv_ref(q, kv, cos, sin, q_out, kv_norm_weight, kv_out, kv_rows):
    return rope_q_kv_ref(
        q,
        kv,
        cos,
        sin,
        q_out_heads=q_out.shape[1],
        q_norm_eps=NORM_EPS,
        kv_norm_eps=NORM_EPS,
        kv_norm_weight=kv_norm_weight,
        kv_out=kv_out,
        kv_rows=kv_rows,
    )


def _rope_qkv_launch(q, kv, cos, sin, q_out, kv_norm_weight, kv_out, kv_rows):
    return rope_q_kv(
        q,
        kv,
        cos,
        sin,
        q_out=q_out,
        q_norm_eps=NORM_EPS,
        kv_norm_eps=NORM_EPS,
        kv_norm_weight=kv_norm_weight,
        kv_out=kv_out,
        kv_rows=kv_rows,
    )


def _check_normed_bf16(want: tuple, got: tuple) -> None:
    """A tolerance (the norms' rstd may move a last bit, `rope/tail.py`): within one bf16 ulp of the value's
    magnitude and almost all elements equal."""
    assert want[1].data_ptr() != got[1].data_ptr(), "the check needs two pools"
    for w, g in zip(want, got):
        w, g = w.float(), g.float()
        assert ((w - g).abs() <= 2.0**-7 * w.abs() + 1e-6).all(), "beyond one bf16 ulp"
        assert (w == g).float().mean() >= 0.99, "too many elements differ"


def _rope_qkv_bytes(m: int) -> int:
    return _rope_bytes(m) + m * (2 * HEAD_DIM * 2 + 8) + HEAD_DIM * 2


# ----------------------------------------------------------------------------- vocab_argmax


def _argmax_inputs(m: int, device: str) -> dict[str, Any]:
    logits = torch.randn(m, VOCAB, generator=_gen(m)) * 5
    return {"shards": [s.contiguous().to(device) for s in torch.split(logits, VOCAB_LOCAL, 1)]}


def _rank_inputs(m: int, device: str) -> dict[str, Any]:
    logits = torch.randn(m, VOCAB_LOCAL, generator=_gen(m)) * 5
    return {"logits": logits.to(device), "vocab_offset": 2 * VOCAB_LOCAL}


def _rank_pairs_ref(logits: torch.Tensor, vocab_offset: int) -> torch.Tensor:
    idx = torch.argmax(logits, -1)
    value = logits.float().gather(1, idx[:, None])[:, 0]
    return torch.stack([value, (idx + vocab_offset).float()], dim=1)


# ----------------------------------------------------------------------------- spec_accept


def _accept_inputs(m: int, device: str, sampled: bool) -> dict[str, Any]:
    gen = _gen(m)
    bs, w = _bs_w(m)
    vocab = VOCAB if sampled else 1000
    ids = torch.randint(0, vocab, (bs, w), generator=gen)
    lens = torch.full((bs,), w, dtype=torch.int64)
    seqs = torch.randint(100, 4000, (bs,), generator=gen)
    inputs: dict[str, Any] = dict(verify_ids=ids, verify_lens=lens, seq_lens=seqs)
    if sampled:
        p = torch.softmax(torch.randn(bs, w, vocab, generator=gen) * 3, -1)
        q = torch.softmax(torch.randn(bs, w - 1, vocab, generator=gen) * 3, -1)
        ids[:, 1:] = p[:, :-1].argmax(-1)  # mostly accepted, like a good draft
        inputs.update(
            target_probs=p,
            draft_probs=q,
            accept_uniforms=torch.rand(bs, w - 1, generator=gen),
            sample_uniforms=torch.rand(bs, generator=gen),
        )
    else:
        target = torch.randint(0, vocab, (bs, w), generator=gen)
        target[:, : w - 1] = torch.where(
            torch.rand(bs, w - 1, generator=gen) < 0.8, ids[:, 1:], target[:, : w - 1]
        )
        inputs.update(target_ids=target)
    return {k: v.to(device) for k, v in inputs.items()}


def _accept_bytes(m: int, sampled: bool) -> int:
    bs, w = _bs_w(m)
    small = bs * (w * 8 * 3 + 8 * 6)
    # Sampled: one full read of the P and Q rows at the sampling row, plus the draft gathers.
    return small + (bs * 2 * VOCAB * 4 if sampled else 0)


# ----------------------------------------------------------------------------- prepare_draft_inputs


def _draft_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    table_width = 4096
    table = torch.randperm(2 * m * table_width, generator=gen).to(torch.int32)
    inputs = dict(
        anchors=torch.randint(0, VOCAB, (m,), generator=gen),
        seq_lens=torch.randint(0, table_width - 16, (m,), generator=gen),
        req_pool_indices=torch.randperm(2 * m, generator=gen)[:m],
        req_to_token=table.reshape(2 * m, table_width),
        n_valid=torch.tensor(max(m - 1, 1), dtype=torch.int32),
    )
    return {
        **{k: v.to(device) for k, v in inputs.items()},
        "draft_len": GAMMA,
        "verify_width": GAMMA + 1,
        "mask_token_id": VOCAB - 1,
    }


def _draft_bytes(m: int) -> int:
    return m * (3 * 8 + (GAMMA + 1) * 4 + (3 * GAMMA + 2 * (GAMMA + 1)) * 8)


def _case(
    name: str,
    make_inputs: Callable[[int, str], dict[str, Any]],
    reference: Callable,
    launcher: Callable,
    check: Callable,
    bytes_moved: Callable[[int], int],
) -> dict[str, Any]:
    return dict(
        name=name,
        make_inputs=make_inputs,
        reference=reference,
        launcher=launcher,
        check=check,
        bytes_moved=bytes_moved,
    )


CASES: list[dict[str, Any]] = [
    _case(
        "rope_tail_q_pad16to64",
        lambda m, d: _rope_inputs(m, d, inverse=False),
        _rope_ref,
        _rope_launch,
        _check_bits,
        _rope_bytes,
    ),
    _case(
        "rope_tail_inverse_out_unpad64to16",
        lambda m, d: _rope_inputs(m, d, inverse=True),
        _rope_ref,
        _rope_launch,
        _check_bits,
        _rope_bytes,
    ),
    _case(
        "rope_q_kv_store_norms",
        _rope_qkv_inputs,
        _rope_qkv_ref,
        _rope_qkv_launch,
        _check_normed_bf16,
        _rope_qkv_bytes,
    ),
    _case(
        "shard_argmax_pairs_rank",
        _rank_inputs,
        _rank_pairs_ref,
        shard_argmax_pairs,
        _check_equal,
        lambda m: m * (VOCAB_LOCAL * 4 + 8),
    ),
    _case(
        "vocab_argmax_4_shards",
        _argmax_inputs,
        vocab_argmax_ref,
        vocab_argmax,
        _check_equal,
        lambda m: m * (VOCAB * 4 + 8 * TP + 8),
    ),
    _case(
        "spec_accept_greedy",
        lambda m, d: _accept_inputs(m, d, sampled=False),
        spec_accept_ref,
        spec_accept,
        _check_equal,
        lambda m: _accept_bytes(m, sampled=False),
    ),
    _case(
        "spec_accept_sampled",
        lambda m, d: _accept_inputs(m, d, sampled=True),
        spec_accept_ref,
        spec_accept,
        _check_equal,
        lambda m: _accept_bytes(m, sampled=True),
    ),
    _case(
        "prepare_draft_inputs_gamma5",
        _draft_inputs,
        prepare_draft_inputs_ref,
        prepare_draft_inputs,
        _check_equal,
        _draft_bytes,
    ),
]
