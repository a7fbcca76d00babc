"""mHC post-combine: the references against HF transformers, the kernel against the references.

Exactness: the stream update is elementwise with a fixed operand order, so Rs' must be bit-exact
(fp32 and bf16, interpreter and GPU). The coefficients go through a split reduction, exp and sigmoid
whose order/lowering differ from torch (a tolerance vs the torch chain), so they and everything
derived from them (x_in, the normed input) are compared with a tolerance.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.mhc import post_combine as mhc_module
from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine, mhc_pre
from sgl_dspark.kernels.mhc.reference import (
    MhcPostCombineOutput,
    mhc_coeffs_ref,
    mhc_collapse_ref,
    mhc_post_combine_ref,
    mhc_post_ref,
    mhc_pre_ref,
)
from sgl_dspark.kernels.norm.reference import rms_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0**-7  # relative spacing of bf16 at the bottom of a binade


def _make_inputs(m: int, n: int, d: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = (2 + n) * n

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    return dict(
        streams=rnd(m, n, d).to(dtype),
        y=rnd(m, d).to(dtype),
        post=(torch.rand(m, n, generator=g) * 2).to(DEVICE),
        comb=torch.rand(m, n, n, generator=g).to(DEVICE),
        fn=rnd(r, n * d, scale=0.05),
        base=rnd(r, scale=0.5),
        scale=(torch.rand(3, generator=g) + 0.5).to(DEVICE),
        norm_weight=rnd(d).to(torch.float32),
    )


def _poisoned_out(m: int, n: int, d: int, dtype: torch.dtype) -> MhcPostCombineOutput:
    def nan(*shape: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dt, device=DEVICE)

    return MhcPostCombineOutput(
        nan(m, n, d, dt=dtype),
        nan(m, n),
        nan(m, n),
        nan(m, n, n),
        nan(m, d, dt=dtype),
        nan(m, d, dt=dtype),
    )


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    int_ty = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(int_ty), b.view(int_ty)), (a - b).abs().max()


def _assert_close_act(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32: a few ulps. bf16: at most one bf16 ulp, and only rarely (an fp32 difference of ~1e-7
    flips the rounding of a value sitting near a bf16 midpoint); truncating instead of rounding
    would differ on about half of the values."""
    assert not torch.isnan(a).any()
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(a.float(), b.float(), rtol=BF16_ULP, atol=1e-6)
    assert (a != b).float().mean().item() < 0.02


# ------------------------------------------------------------------------------------------------
# References vs HF transformers (the parity target)
# ------------------------------------------------------------------------------------------------


def _require_parity_transformers() -> None:
    """Skip unless transformers >= 5.23, the parity reference (the version CI installs): older
    DeepSeek-V4 modules differ in ways that are not ours to match, e.g. 5.17's DeepseekV4RMSNorm
    returns fp32 where 5.23 returns the input dtype."""
    pytest.importorskip("transformers", minversion="5.23")


@pytest.mark.parametrize("n,iters,hc_eps", [(1, 1, 1e-6), (3, 3, 1e-2), (4, 20, 1e-6)])
def test_coeffs_ref_matches_hf_hyper_connection(n: int, iters: int, hc_eps: float) -> None:
    _require_parity_transformers()
    hf_cfg = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")
    hf_mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    d = 96
    cfg = hf_cfg.DeepseekV4Config(
        hidden_size=d, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=hc_eps, rms_norm_eps=1e-6
    )
    hc = hf_mod.DeepseekV4HyperConnection(cfg)
    inp = _make_inputs(6, n, d, torch.float32, seed=n)
    with torch.no_grad():
        hc.fn.copy_(inp["fn"].cpu())
        hc.base.copy_(inp["base"].cpu())
        hc.scale.copy_(inp["scale"].cpu())
        streams = inp["streams"].cpu()
        hf_post, hf_comb, hf_collapsed = hc(streams.unsqueeze(0))
    fn, base, scale = inp["fn"].cpu(), inp["base"].cpu(), inp["scale"].cpu()
    pre, post, comb = mhc_coeffs_ref(
        streams, fn, base, scale, hc_eps=hc_eps, sinkhorn_iters=iters, rms_eps=1e-6
    )
    torch.testing.assert_close(post, hf_post[0], rtol=0, atol=0)
    torch.testing.assert_close(comb, hf_comb[0], rtol=0, atol=0)
    collapsed = mhc_collapse_ref(streams, pre)
    torch.testing.assert_close(collapsed, hf_collapsed[0], rtol=1e-6, atol=1e-6)
    # Sinkhorn ends on columns: they sum to ~1 (exactly 1 up to hc_eps).
    assert torch.allclose(comb.sum(dim=-2), torch.ones(6, n), atol=n * hc_eps + 1e-5)


def test_post_ref_matches_hf_decoder_update() -> None:
    m, n, d = 5, 4, 160
    inp = _make_inputs(m, n, d, torch.float32, seed=7)
    streams, y, post, comb = (inp[k].cpu() for k in ("streams", "y", "post", "comb"))
    # HF DeepseekV4DecoderLayer: post ⊗ y + comb^T @ streams.
    hf = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    torch.testing.assert_close(mhc_post_ref(streams, y, post, comb), hf, rtol=1e-6, atol=1e-6)


def test_rms_norm_ref_matches_hf() -> None:
    _require_parity_transformers()
    hf_mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    norm = hf_mod.DeepseekV4RMSNorm(160, eps=1e-6)
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(160))
        expected = norm(x)
    _assert_bits_equal(rms_norm_ref(x, norm.weight.detach(), 1e-6), expected)


# ------------------------------------------------------------------------------------------------
# Kernel vs reference
# ------------------------------------------------------------------------------------------------

_KW = dict(hc_eps=1e-6, rms_eps=1e-6)


@pytest.mark.parametrize(
    "m,n,d,dtype,iters",
    [
        (1, 4, 96, torch.float32, 20),
        (5, 4, 160, torch.bfloat16, 20),
        (4, 1, 96, torch.bfloat16, 1),
        (9, 2, 160, torch.float32, 3),
        (37, 4, 96, torch.bfloat16, 3),
        (3, 3, 96, torch.float32, 2),
        (2, 4, 1100, torch.bfloat16, 20),  # 18 slices of 64 (not a power of two), masked tail
        (3, 2, 33, torch.bfloat16, 4),  # odd D narrower than one slice
    ],
)
def test_kernel_matches_ref(m: int, n: int, d: int, dtype: torch.dtype, iters: int) -> None:
    inp = _make_inputs(m, n, d, dtype, seed=100 * m + 10 * n + iters)
    ref = mhc_post_combine_ref(**inp, sinkhorn_iters=iters, **_KW)
    out = mhc_post_combine(**inp, sinkhorn_iters=iters, **_KW, out=_poisoned_out(m, n, d, dtype))
    _assert_bits_equal(out.streams, ref.streams)
    for name in ("pre", "post", "comb"):
        got, want = getattr(out, name), getattr(ref, name)
        assert not torch.isnan(got).any(), name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    _assert_close_act(out.x_in, ref.x_in)
    _assert_close_act(out.x_normed, ref.x_normed)


@pytest.mark.parametrize(
    "m,n,d,dtype,iters",
    [
        (1, 4, 96, torch.float32, 20),
        (5, 4, 160, torch.bfloat16, 20),
        (4, 1, 96, torch.bfloat16, 1),
        (37, 4, 96, torch.bfloat16, 3),
        (2, 4, 1100, torch.bfloat16, 20),
        (3, 2, 33, torch.float32, 4),
    ],
)
def test_pre_matches_ref_and_equals_identity_update(
    m: int, n: int, d: int, dtype: torch.dtype, iters: int
) -> None:
    """Opening only: the coefficients / x_in / normed input of the given streams (a tolerance),
    the streams returned untouched, and bit-identical to the full kernel with post = 0 and
    comb = I (same reduction trees; the identity update reproduces Rs exactly)."""
    inp = _make_inputs(m, n, d, dtype, seed=7 * m + n + iters)
    streams_before = inp["streams"].clone()
    heads = {k: inp[k] for k in ("fn", "base", "scale", "norm_weight")}
    ref = mhc_pre_ref(inp["streams"], **heads, sinkhorn_iters=iters, **_KW)
    poison = _poisoned_out(m, n, d, dtype)
    out = mhc_pre(inp["streams"], **heads, sinkhorn_iters=iters, **_KW, out=poison)
    assert out.streams is inp["streams"]
    _assert_bits_equal(inp["streams"], streams_before)
    assert torch.isnan(poison.streams.float()).all()  # out.streams is not written
    for name in ("pre", "post", "comb"):
        got, want = getattr(out, name), getattr(ref, name)
        assert not torch.isnan(got).any(), name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    _assert_close_act(out.x_in, ref.x_in)
    _assert_close_act(out.x_normed, ref.x_normed)
    ident = mhc_post_combine(
        inp["streams"],
        inp["y"],
        torch.zeros(m, n, device=DEVICE),
        torch.eye(n, device=DEVICE).expand(m, n, n).contiguous(),
        **heads,
        sinkhorn_iters=iters,
        **_KW,
    )
    _assert_bits_equal(ident.streams, inp["streams"])
    for name in ("pre", "post", "comb", "x_in", "x_normed"):
        _assert_bits_equal(getattr(out, name), getattr(ident, name))


def test_pre_empty_batch() -> None:
    inp = _make_inputs(0, 4, 96, torch.bfloat16, seed=1)
    out = mhc_pre(
        inp["streams"],
        inp["fn"],
        inp["base"],
        inp["scale"],
        inp["norm_weight"],
        sinkhorn_iters=3,
        **_KW,
    )
    assert out.x_normed.shape == (0, 96) and out.comb.shape == (0, 4, 4)


def test_kernel_keeps_signed_zeros() -> None:
    """Columns where y and every stream are -0.0 give Rs' = -0.0 in the reference (post·(-0)
    plus comb·(-0) terms); the kernel's bit-exact stream update must keep that sign."""
    inp = _make_inputs(3, 4, 96, torch.bfloat16, seed=13)
    inp["streams"][:, :, ::3] = -0.0
    inp["y"][:, ::3] = -0.0
    ref = mhc_post_combine_ref(**inp, sinkhorn_iters=3, **_KW)
    assert torch.signbit(ref.streams[:, :, ::3]).all()
    out = mhc_post_combine(
        **inp, sinkhorn_iters=3, **_KW, out=_poisoned_out(3, 4, 96, torch.bfloat16)
    )
    _assert_bits_equal(out.streams, ref.streams)
    _assert_close_act(out.x_normed, ref.x_normed)


def test_kernel_large_magnitudes_and_hc_eps() -> None:
    """Streams with large norms and a large hc_eps: the rsqrt scaling and eps placement matter."""
    inp = _make_inputs(6, 4, 96, torch.float32, seed=11)
    inp["streams"] = inp["streams"] * 300.0
    inp["y"] = inp["y"] * 300.0
    kw = dict(hc_eps=1e-2, sinkhorn_iters=5, rms_eps=1e-6)
    ref = mhc_post_combine_ref(**inp, **kw)
    out = mhc_post_combine(**inp, **kw)
    _assert_bits_equal(out.streams, ref.streams)
    torch.testing.assert_close(out.comb, ref.comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.x_normed, ref.x_normed, rtol=1e-5, atol=1e-5)


def _assert_rows_equal(
    got: MhcPostCombineOutput, want: MhcPostCombineOutput, rows: list[int], want_rows: list[int]
) -> None:
    # The tensor outputs (x_fp8 is None unless asked for).
    for name, a, b in zip(MhcPostCombineOutput._fields[:6], got, want):
        for r, wr in zip(rows, want_rows):
            int_ty = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
            assert torch.equal(a[r].view(int_ty), b[wr].view(int_ty)), (name, r, wr)


@pytest.mark.parametrize("single_pass", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_rows_do_not_depend_on_batch(dtype: torch.dtype, single_pass: bool) -> None:
    """A row's result is a function of that row only: the same rows, embedded at different
    positions of batches of different M (so phase A tiles them 1, 2, 4 and 8 per program, and
    one again above `_MAX_TILED_ROWS`), give bit-identical outputs; single pass (the collapse in
    phase A, the norm in chunks) likewise."""
    n, d = 4, 96
    batch_sizes = [1, 5, 9, 17, 33]
    assert [mhc_module._rows_per_program(m) for m in batch_sizes] == [1, 2, 4, 8, 1]
    probe = _make_inputs(3, n, d, dtype, seed=5)
    keys = ["streams", "y", "post", "comb"]
    if single_pass:
        probe["collapse_pre"] = _prev_pre(3, n, seed=6)
        keys.append("collapse_pre")
    alone = mhc_post_combine(**probe, sinkhorn_iters=3, **_KW)
    for m in batch_sizes:
        inp = _make_inputs(m, n, d, dtype, seed=50 + m)
        if single_pass:
            inp["collapse_pre"] = _prev_pre(m, n, seed=60 + m)
        rows = sorted({m - 1, (7 * m) // 9, m // 3})[:3]
        inp.update({k: probe[k] for k in ("fn", "base", "scale", "norm_weight")})
        for key in keys:
            for i, r in enumerate(rows):
                inp[key][r] = probe[key][i]
        out = mhc_post_combine(**inp, sinkhorn_iters=3, **_KW, out=_poisoned_out(m, n, d, dtype))
        _assert_rows_equal(out, alone, rows, list(range(len(rows))))


def test_kernel_chunked_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows wider than the register-resident finish block are collapsed and normed in chunks
    (three here, the last one masked), with the norm pass re-reading x_in."""
    monkeypatch.setattr(mhc_module, "_MAX_FINISH_BLOCK", 64)
    m, n, d = 3, 4, 160
    inp = _make_inputs(m, n, d, torch.bfloat16, seed=21)
    ref = mhc_post_combine_ref(**inp, sinkhorn_iters=5, **_KW)
    out = mhc_post_combine(
        **inp, sinkhorn_iters=5, **_KW, out=_poisoned_out(m, n, d, torch.bfloat16)
    )
    _assert_bits_equal(out.streams, ref.streams)
    torch.testing.assert_close(out.pre, ref.pre, rtol=1e-5, atol=1e-6)
    _assert_close_act(out.x_in, ref.x_in)
    _assert_close_act(out.x_normed, ref.x_normed)


def test_repeated_calls_are_identical() -> None:
    """No state survives a call: repeats are bit-identical."""
    inp = _make_inputs(9, 4, 96, torch.float32, seed=9)
    first = mhc_post_combine(**inp, sinkhorn_iters=3, **_KW)
    second = mhc_post_combine(
        **inp, sinkhorn_iters=3, **_KW, out=_poisoned_out(9, 4, 96, torch.float32)
    )
    for a, b in zip(first[:6], second[:6]):
        _assert_bits_equal(a, b)


def test_empty_batch() -> None:
    inp = _make_inputs(0, 4, 96, torch.bfloat16, seed=0)
    out = mhc_post_combine(**inp, sinkhorn_iters=3, **_KW)
    shapes = [(0, 4, 96), (0, 4), (0, 4), (0, 4, 4), (0, 96), (0, 96)]
    assert [tuple(t.shape) for t in out[:6]] == shapes and out.x_fp8 is None


@pytest.mark.parametrize(
    "field,bad",
    [
        ("post", lambda t: t.to(torch.bfloat16)),
        ("y", lambda t: t[:, :-1]),
        ("fn", lambda t: t.t().contiguous()),
        ("comb", lambda t: t.transpose(1, 2)),
    ],
)
def test_bad_arguments_raise(field: str, bad) -> None:
    inp = _make_inputs(2, 4, 96, torch.float32, seed=1)
    inp[field] = bad(inp[field])
    with pytest.raises(ValueError, match=field):
        mhc_post_combine(**inp, sinkhorn_iters=3, **_KW)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc_post_combine(**_make_inputs(2, 4, 96, torch.float32, seed=1), sinkhorn_iters=0, **_KW)


# ------------------------------------------------------------------------------------------------
# Single-pass mHC (DeepSeek-V4.1): collapse with the previous site's pre
# ------------------------------------------------------------------------------------------------


def _prev_pre(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pre = torch.rand(m, n, generator=g) * 1.5 + 1e-6
    if m:
        pre[0] = 0.0
        pre[0, 0] = 1.0  # the one-hot first input (stream 0)
    return pre.to(DEVICE)


@pytest.mark.parametrize(
    "m,n,d,dtype,iters",
    [
        (1, 4, 96, torch.float32, 20),
        (5, 4, 160, torch.bfloat16, 20),
        (3, 2, 33, torch.bfloat16, 4),
        (7, 3, 1100, torch.float32, 2),
    ],
)
def test_single_pass_boundary_collapses_with_the_given_pre(
    m: int, n: int, d: int, dtype: torch.dtype, iters: int
) -> None:
    """`collapse_pre`: Rs' and x_in are bit-exact (a given pre leaves nothing to reduce), the new
    pre'/post'/comb' and the norm within the tolerance; the opening variant likewise."""
    inp = _make_inputs(m, n, d, dtype, seed=31 * m + n)
    prev = _prev_pre(m, n, seed=m + d)
    ref = mhc_post_combine_ref(**inp, sinkhorn_iters=iters, **_KW, collapse_pre=prev)
    out = mhc_post_combine(
        **inp, sinkhorn_iters=iters, **_KW, out=_poisoned_out(m, n, d, dtype), collapse_pre=prev
    )
    _assert_bits_equal(out.streams, ref.streams)
    _assert_bits_equal(out.x_in, ref.x_in)
    for name in ("pre", "post", "comb"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    _assert_close_act(out.x_normed, ref.x_normed)
    # the new pre is the usual one (what the next site will collapse with)
    plain = mhc_post_combine_ref(**inp, sinkhorn_iters=iters, **_KW)
    torch.testing.assert_close(out.pre, plain.pre, rtol=1e-5, atol=1e-6)

    heads = {k: inp[k] for k in ("fn", "base", "scale", "norm_weight")}
    ref_open = mhc_pre_ref(inp["streams"], **heads, sinkhorn_iters=iters, **_KW, collapse_pre=prev)
    got_open = mhc_pre(inp["streams"], **heads, sinkhorn_iters=iters, **_KW, collapse_pre=prev)
    _assert_bits_equal(got_open.x_in, ref_open.x_in)
    torch.testing.assert_close(got_open.pre, ref_open.pre, rtol=1e-5, atol=1e-6)
    _assert_close_act(got_open.x_normed, ref_open.x_normed)


@pytest.mark.parametrize(
    "m,n,d,dtype",
    [(1, 4, 96, torch.bfloat16), (6, 2, 33, torch.float32), (4, 4, 1100, torch.bfloat16)],
)
def test_post_collapse_without_coefficients(m: int, n: int, d: int, dtype: torch.dtype) -> None:
    """Close + collapse with a given pre + norm, no coefficients: Rs' and x_in bit-exact."""
    from sgl_dspark.kernels.mhc.post_combine import mhc_post_collapse
    from sgl_dspark.kernels.mhc.reference import mhc_post_collapse_ref

    inp = _make_inputs(m, n, d, dtype, seed=5 * m + d)
    prev = _prev_pre(m, n, seed=d)
    args = (inp["streams"], inp["y"], inp["post"], inp["comb"], prev, inp["norm_weight"])
    ref = mhc_post_collapse_ref(*args, rms_eps=1e-20)
    out = mhc_post_collapse(*args, rms_eps=1e-20)
    _assert_bits_equal(out.streams, ref.streams)
    _assert_bits_equal(out.x_in, ref.x_in)
    _assert_close_act(out.x_normed, ref.x_normed)
    with pytest.raises(ValueError, match="collapse_pre"):
        mhc_post_collapse(*args[:4], prev[:, :1].contiguous(), args[5], rms_eps=1e-6)


@pytest.mark.parametrize("m,n,d,dtype", [(3, 4, 160, torch.bfloat16), (5, 3, 96, torch.float32)])
def test_single_pass_collapse_in_either_phase(
    m: int, n: int, d: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the collapse pre given, phase A collapses (the library's choice) or phase B does (the
    two-pass layout, `collapse_in_stream_pass` answering False): the same Rs' and x_in bits,
    and the rest within the tolerance of the reference either way."""
    inp = _make_inputs(m, n, d, dtype, seed=3 * m + d)
    prev = _prev_pre(m, n, seed=d + n)
    ref = mhc_post_combine_ref(**inp, sinkhorn_iters=20, **_KW, collapse_pre=prev)
    outs = []
    for in_stream_pass in (True, False):
        monkeypatch.setattr(
            mhc_module, "collapse_in_stream_pass", lambda pre, on=in_stream_pass: on
        )
        out = mhc_post_combine(
            **inp, sinkhorn_iters=20, **_KW, out=_poisoned_out(m, n, d, dtype), collapse_pre=prev
        )
        for name in ("pre", "post", "comb"):
            torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
        _assert_close_act(out.x_normed, ref.x_normed)
        outs.append(out)
    for name in ("streams", "x_in"):
        _assert_bits_equal(getattr(outs[0], name), getattr(ref, name))
        _assert_bits_equal(getattr(outs[1], name), getattr(ref, name))


@pytest.mark.parametrize("coefficients", [True, False])
def test_single_pass_norm_in_chunks(coefficients: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase B norms x_in in chunks of `_NORM_BLOCK` columns over several programs (four here,
    the last one masked), with and without the coefficients' program before them."""
    from sgl_dspark.kernels.mhc.post_combine import mhc_post_collapse
    from sgl_dspark.kernels.mhc.reference import mhc_post_collapse_ref

    monkeypatch.setattr(mhc_module, "_NORM_BLOCK", 32)
    m, n, d = 3, 4, 100
    inp = _make_inputs(m, n, d, torch.bfloat16, seed=77)
    prev = _prev_pre(m, n, seed=78)
    if coefficients:
        ref = mhc_post_combine_ref(**inp, sinkhorn_iters=5, **_KW, collapse_pre=prev)
        out = mhc_post_combine(
            **inp,
            sinkhorn_iters=5,
            **_KW,
            out=_poisoned_out(m, n, d, torch.bfloat16),
            collapse_pre=prev,
        )
        torch.testing.assert_close(out.comb, ref.comb, rtol=1e-5, atol=1e-6)
    else:
        args = (inp["streams"], inp["y"], inp["post"], inp["comb"], prev, inp["norm_weight"])
        ref = mhc_post_collapse_ref(*args, rms_eps=1e-6)
        out = mhc_post_collapse(*args, rms_eps=1e-6)
    _assert_bits_equal(out.streams, ref.streams)
    _assert_bits_equal(out.x_in, ref.x_in)
    _assert_close_act(out.x_normed, ref.x_normed)
