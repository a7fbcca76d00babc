"""The per-family dispatch of `--kernel-backend` (rope, mhc, sampling, spec draft inputs): each
Triton binding against the torch implementation it replaces, on random inputs and layouts the
runtime produces. Accept (spec) is covered in test_dspark_accept.py."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.mhc import (
    CoefficientStream,
    HyperConnection,
    HyperHead,
    hc_boundary_impl,
    hc_collapse,
    hc_expand,
    run_fused_hc_layers,
    run_single_pass_layers,
)
from sgl_dspark.srt.layers.norm import RMSNorm
from sgl_dspark.srt.layers.rotary import (
    apply_rope_tail,
    rope_impl,
    rope_q_kv_impl,
    rope_store_impl,
)
from sgl_dspark.srt.layers.sampler import greedy_argmax_impl
from sgl_dspark.srt.speculative.dspark.ops import create_draft_inputs_fn, draft_inputs_torch

# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
TORCH, TRITON = KernelChoice("torch"), KernelChoice("triton")
# Compiled Triton only takes device tensors; on CPU the conftest runs the interpreter. Inputs are
# drawn on the CPU generator (same values on both) and then moved.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rope_args(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 64, generator=gen).to(DEVICE)
    ang = torch.rand(5, 16, generator=gen) * 50
    return x, ang.cos().to(DEVICE), ang.sin().to(DEVICE)


def test_torch_choice_binds_the_torch_implementations():
    x, cos, sin = _rope_args()
    assert torch.equal(rope_impl(TORCH)(x, cos, sin), apply_rope_tail(x, cos, sin))
    assert hc_boundary_impl(TORCH) is None
    assert create_draft_inputs_fn(TORCH) is draft_inputs_torch
    logits = torch.randn(3, 9, device=DEVICE)
    assert torch.equal(greedy_argmax_impl(TORCH)(logits), torch.argmax(logits, -1))
    mixed = KernelChoice("triton", (("rope", "torch"), ("mhc", "torch")))
    assert torch.equal(
        rope_impl(mixed)(x, cos, sin, inverse=True), apply_rope_tail(x, cos, sin, inverse=True)
    )
    assert hc_boundary_impl(mixed) is None


# ---- rope ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, half", [((1, 64), 8), ((7, 64), 8), ((5, 4, 64), 8), ((3, 3, 32), 16), ((9, 16, 32), 4)]
)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_triton_is_bit_exact(shape, half, dtype, inverse):
    gen = torch.Generator().manual_seed(shape[0] * 31 + half)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    pos = torch.randint(0, 5000, (shape[0],), generator=gen).float()
    freqs = pos[:, None] * torch.rand(half, generator=gen)[None, :]
    x, cos, sin = x.to(DEVICE), freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    want = apply_rope_tail(x, cos, sin, inverse=inverse)
    got = rope_impl(TRITON)(x, cos, sin, inverse=inverse)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)
    assert not torch.equal(got, x)  # the tail did rotate


def test_rope_triton_takes_strided_views():
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(6, 2 * 4 * 32, generator=gen).to(DEVICE)  # a fused projection output
    x = fused.view(6, 8, 32)[:, ::2]  # every other head: head stride 64
    tail_major = torch.randn(6, 32, 4, generator=gen).to(DEVICE).transpose(1, 2)  # ch. stride 4
    freqs = (torch.rand(6, 8, generator=gen) * 10).to(DEVICE)
    for view in (x, tail_major):
        want = apply_rope_tail(view, freqs.cos(), freqs.sin())
        assert torch.equal(rope_impl(TRITON)(view, freqs.cos(), freqs.sin()), want)


# ---- mhc -------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, n: int, d: int, gen: torch.Generator) -> None:
        super().__init__()
        args = (n, d, 5, 1e-6, 1e-6)
        self.attn_hc, self.ffn_hc = HyperConnection(*args), HyperConnection(*args)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        for p in self.parameters():
            p.data = (
                1 + 0.2 * torch.randn(p.shape, generator=gen)
                if p.dim() < 2
                else (0.05 * torch.randn(p.shape, generator=gen))
            )
        self.w_attn = 0.3 * torch.randn(d, d, generator=gen)
        self.w_ffn = 0.3 * torch.randn(d, d, generator=gen)
        self.to(DEVICE)  # parameters; the plain weight attributes are moved by hand
        self.w_attn, self.w_ffn = self.w_attn.to(DEVICE), self.w_ffn.to(DEVICE)


def _unfused(streams, layers, taps):
    for layer in layers:
        pre, post, comb = layer.attn_hc.coeffs(streams)
        a = torch.tanh(layer.input_layernorm(hc_collapse(streams, pre)) @ layer.w_attn)
        streams = hc_expand(streams, a, post, comb)
        pre, post, comb = layer.ffn_hc.coeffs(streams)
        f = torch.tanh(layer.post_attention_layernorm(hc_collapse(streams, pre)) @ layer.w_ffn)
        streams = hc_expand(streams, f, post, comb)
        taps.append(streams)
    return streams


@pytest.mark.parametrize("rows, n, d, num_layers", [(1, 4, 64, 1), (6, 4, 128, 3), (37, 2, 96, 2)])
def test_fused_mhc_layers_match_unfused(rows, n, d, num_layers):
    gen = torch.Generator().manual_seed(rows + d)
    layers = [_Layer(n, d, gen) for _ in range(num_layers)]
    streams = torch.randn(rows, n, d, generator=gen).to(DEVICE)
    want_taps: list[torch.Tensor] = []
    got_taps: list[tuple[int, torch.Tensor]] = []
    want = _unfused(streams, layers, want_taps)
    boundary = hc_boundary_impl(TRITON)
    assert boundary is not None
    got, no_head = run_fused_hc_layers(
        streams,
        layers,
        lambda i, x: torch.tanh(x @ layers[i].w_attn),
        lambda i, x: torch.tanh(x @ layers[i].w_ffn),
        boundary,
        lambda i, s: got_taps.append((i, s)),
    )
    # The kernel reduces in another order (fp32), so a tolerance, not equality.
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert no_head is None
    assert [i for i, _ in got_taps] == list(range(num_layers))
    for (_, g), w in zip(got_taps, want_taps):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want, streams)

    # With the hyper head, the last boundary also returns head(streams) and its final norm;
    # the streams and the taps are those of the run without it.
    head, norm = _head_and_norm(n, d, gen)
    got_taps.clear()
    got_h, head_out = run_fused_hc_layers(
        streams,
        layers,
        lambda i, x: torch.tanh(x @ layers[i].w_attn),
        lambda i, x: torch.tanh(x @ layers[i].w_ffn),
        boundary,
        lambda i, s: got_taps.append((i, s)),
        head=(head, norm),
    )
    torch.testing.assert_close(got_h, want, atol=1e-4, rtol=1e-4)
    assert [i for i, _ in got_taps] == list(range(num_layers))
    assert head_out is not None
    y, y_normed = head_out
    torch.testing.assert_close(y, head(want), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        y_normed, rms_norm_ref(head(want), norm.weight, 1e-6), atol=1e-4, rtol=1e-4
    )


def test_coefficient_stream_stays_on_the_current_stream_off_capture() -> None:
    """Off CUDA, and eagerly on CUDA, no scope: the boundary launches as usual; joining with
    nothing forked is a no-op."""
    side = CoefficientStream()
    assert side.scope(torch.device("cpu")) is None
    side.join()
    if DEVICE == "cuda":
        assert side.scope(torch.device(DEVICE, torch.cuda.current_device())) is None
        side.join()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_single_pass_layers_in_a_captured_graph_fork_and_join_the_coefficients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three single-pass layers captured in a CUDA graph (every single-pass boundary's
    coefficients forked to the side stream, joined by the next boundary) replay the eager run's
    bits, on the captured inputs and on new ones copied in."""
    forks: list[bool] = []
    fork = CoefficientStream._fork

    owners: list[CoefficientStream] = []

    def counted(self: CoefficientStream, reads: torch.Tensor):
        forks.append(torch.cuda.is_current_stream_capturing())
        owners.append(self)
        return fork(self, reads)

    monkeypatch.setattr(CoefficientStream, "_fork", counted)
    gen = torch.Generator().manual_seed(9)
    n, d, rows = 4, 256, 3
    layers = [_Layer(n, d, gen) for _ in range(3)]
    norm = RMSNorm(d, 1e-6).to(DEVICE)
    boundary = hc_boundary_impl(TRITON)
    assert boundary is not None

    def forward(streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run_single_pass_layers(
            streams,
            layers,
            lambda i, x: torch.tanh(x @ layers[i].w_attn),
            lambda i, x: torch.tanh(x @ layers[i].w_ffn),
            boundary,
            (norm, rms_norm_ref),
        )

    static_in = torch.randn(rows, n, d, generator=gen).to(DEVICE)
    inputs = [static_in.clone(), torch.randn(rows, n, d, generator=gen).to(DEVICE)]
    with torch.no_grad():
        eager = [forward(x) for x in inputs]  # also warms up (the side stream is made here)
        assert forks == []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward(static_in)
        # The opening site and the five boundaries after it (the last one computes none); the
        # last boundary joined the last fork and let go of the partials it read.
        assert forks == [True] * 6
        assert all(o._joiner is None and o._held is None for o in owners)
        for x, want in zip(inputs, eager):
            static_in.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            for got, ref in zip(static_out, want):
                assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert not torch.equal(eager[0][0], eager[1][0])


def _head_and_norm(n: int, d: int, gen: torch.Generator) -> tuple[HyperHead, RMSNorm]:
    head = HyperHead(n, d, 1e-6, 1e-6)
    head.hc_fn.data = torch.randn(n, n * d, generator=gen) * 0.05
    head.hc_base.data = torch.randn(n, generator=gen)
    head.hc_scale.data = torch.rand(1, generator=gen) + 0.5
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(d, generator=gen)
    return head.to(DEVICE), norm.to(DEVICE)


# ---- sampling --------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, vocab", [(1, 5), (4, 512), (9, 4099)])
def test_greedy_argmax_triton_equals_torch_with_ties(rows, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(DEVICE)
    logits[0, vocab // 2 :] = logits[0].max() + 1  # a tie: the first index wins
    got = greedy_argmax_impl(TRITON)(logits)
    assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(logits, -1))
    assert int(got[0]) == vocab // 2


# ---- spec: draft inputs ------------------------------------------------------------------------
@pytest.mark.parametrize("batch, gamma, window", [(2, 1, 4), (5, 3, 8), (8, 7, 32)])
def test_draft_inputs_triton_equals_torch(batch, gamma, window):
    gen = torch.Generator().manual_seed(batch * gamma)
    table = torch.randint(1, 1000, (12, 96), generator=gen)
    seq = torch.randint(0, 60, (batch,), generator=gen)
    seq[0] = 0  # a fresh request: no context at all
    rows = torch.randperm(12, generator=gen)[:batch]
    anchors = torch.randint(0, 500, (batch,), generator=gen)
    table, seq, rows, anchors = (t.to(DEVICE) for t in (table, seq, rows, anchors))
    want = draft_inputs_torch(anchors, seq, rows, table, gamma, window, 3)
    got = create_draft_inputs_fn(TRITON)(anchors, seq, rows, table, gamma, window, 3)
    for name in ("input_ids", "positions", "ctx_valid"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # Slots of positions < 0 are masked by ctx_valid; the visible ones must agree.
    assert torch.equal(got.ctx_slots[want.ctx_valid], want.ctx_slots[want.ctx_valid])
    assert bool(want.ctx_valid.any()) and bool((~want.ctx_valid).any())


def test_last_boundary_with_hyper_head_matches_unfused_and_follows_new_weights():
    """`boundary.close_to_head` (the last stream update with the head's parameters padded to a
    mixer) equals hc_expand + the hyper head + the final RMSNorm within tolerance, and picks
    up replaced head parameters."""
    gen = torch.Generator().manual_seed(21)
    n, d, rows = 4, 96, 5
    head, norm = _head_and_norm(n, d, gen)
    streams = torch.randn(rows, n, d, generator=gen).to(DEVICE)
    y = torch.randn(rows, d, generator=gen).to(DEVICE)
    post = (2 * torch.rand(rows, n, generator=gen)).to(DEVICE)
    comb = torch.softmax(torch.randn(rows, n, n, generator=gen), -1).to(DEVICE)
    boundary = hc_boundary_impl(TRITON)
    assert boundary is not None
    want_streams = hc_expand(streams, y, post, comb)
    for _ in range(2):  # second round: new head weights must not reuse the cached padding
        got_streams, got_y, got_normed = boundary.close_to_head(streams, y, post, comb, head, norm)
        want = head(want_streams)
        torch.testing.assert_close(got_streams, want_streams, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_y, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            got_normed, rms_norm_ref(want, norm.weight, 1e-6), atol=1e-5, rtol=1e-5
        )
        head.hc_fn.data = (torch.randn(n, n * d, generator=gen) * 0.05).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_triton_equals_torch(dtype):
    """The KV write of a layer: rotate rows and store them at their pool slots (one scattering
    launch on the triton choice) — the same bits as rope + index_put, other slots untouched."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen).to(dtype).to(DEVICE)
    ang = torch.rand(6, 16, generator=gen) * 50
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    slots = torch.tensor([9, 3, 17, 0, 4, 12], device=DEVICE)
    pools = {}
    for name, k in (("torch", TORCH), ("triton", TRITON)):
        pool = torch.full((20, 64), float("nan"), dtype=dtype, device=DEVICE)
        rope_store_impl(k)(x, cos, sin, pool, slots)
        pools[name] = pool
    assert torch.equal(pools["torch"][slots], pools["triton"][slots])
    assert torch.isnan(pools["triton"][1].float()).all()
    assert torch.equal(pools["torch"][slots], apply_rope_tail(x, cos, sin))


def test_linear_family_small_m_kernel_and_blas_fallback():
    """torch: F.linear (bit for bit on a plain weight). triton: decode-sized rows through the
    small-M kernel (a tolerance vs F.linear), larger or 3-D inputs through F.linear itself (bit
    for bit)."""
    from sgl_dspark.srt.layers.fused_linear import linear_impl

    gen = torch.Generator().manual_seed(8)
    w = (torch.randn(70, 96, generator=gen) * 0.1).to(DEVICE)
    for x in (torch.randn(3, 96, generator=gen), torch.randn(2, 5, 96, generator=gen)):
        x = x.to(DEVICE)
        assert torch.equal(linear_impl(TORCH)(x, w), torch.nn.functional.linear(x, w))
    lin = linear_impl(TRITON)
    for rows in (1, 7, 16):
        x = torch.randn(rows, 96, generator=gen).to(DEVICE)
        torch.testing.assert_close(
            lin(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5
        )
    for x in (torch.randn(17, 96, generator=gen), torch.randn(2, 3, 96, generator=gen)):
        x = x.to(DEVICE)
        assert torch.equal(lin(x, w), torch.nn.functional.linear(x, w))


def test_grouped_linear_family_small_m_kernel_and_einsum_fallback():
    """The grouped output projection: torch is the einsum; triton sends decode-sized rows to
    the grouped small-M launch (inexact vs the einsum, each group as `small_m_linear`) and larger
    ones to the einsum itself (bit for bit)."""
    from sgl_dspark.kernels.linear.small_m import small_m_linear
    from sgl_dspark.srt.layers.fused_linear import grouped_linear_impl

    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(4, 24, 64, generator=gen) * 0.1).to(DEVICE)

    def einsum(x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("mgk,gnk->mgn", x, w)

    grouped = grouped_linear_impl(TRITON)
    for rows in (1, 5, 16):
        x = torch.randn(rows, 4 * 64, generator=gen).to(DEVICE).view(rows, 4, 64)
        assert torch.equal(grouped_linear_impl(TORCH)(x, w), einsum(x))
        got = grouped(x, w)
        torch.testing.assert_close(got, einsum(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(got[:, 2], small_m_linear(x[:, 2], w[2]))
    x = torch.randn(17, 4, 64, generator=gen).to(DEVICE)
    assert torch.equal(grouped(x, w), einsum(x))


def test_markov_greedy_choice_equals_torch_loop():
    """The spec family's all-greedy Markov loop: the Triton launches give the torch loop's
    drafts and embeddings (fp32 weights: no rounding of the W2 dot), step logits to a tolerance."""
    from sgl_dspark.srt.speculative.dspark.ops import create_markov_greedy_fn

    gen = torch.Generator().manual_seed(12)
    base = torch.randn(3, 5, 300, generator=gen).to(DEVICE)
    w1 = torch.randn(300, 16, generator=gen).to(DEVICE)
    w2 = torch.randn(300, 16, generator=gen).to(DEVICE)
    anchors = torch.tensor([4, 299, 0], device=DEVICE)
    want = create_markov_greedy_fn(TORCH)(base, w1, w2, anchors)
    got = create_markov_greedy_fn(TRITON)(base, w1, w2, anchors)
    assert torch.equal(got.drafts, want.drafts)
    assert torch.equal(got.markov_embeds, want.markov_embeds)
    torch.testing.assert_close(got.step_logits, want.step_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_pre_norm_dispatch(dtype):
    """`norm=` on the rope family: with rope and norm both Triton the norm runs inside the rope
    launch (a tolerance against norm then rope: the sum of squares in another order); with the norm
    family overridden to torch, the torch norm runs first and the bits are norm-then-rope's."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(6, 4, 64, generator=gen) * 3).to(dtype).to(DEVICE)
    ang = torch.rand(6, 16, generator=gen) * 50
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    w = (torch.rand(64, generator=gen) + 0.5).to(DEVICE)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    norm_torch = KernelChoice("triton", (("norm", "torch"),))
    for norm in ((None, 1e-6), (w, 1e-6)):
        want = apply_rope_tail(rms_norm_ref(x, *norm), cos, sin)
        got = rope_impl(TRITON)(x, cos, sin, norm=norm)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        assert torch.equal(rope_impl(TORCH)(x, cos, sin, norm=norm), want)
        assert torch.equal(rope_impl(norm_torch)(x, cos, sin, norm=norm), want)
    slots = torch.tensor([9, 3, 17, 0, 4, 12], device=DEVICE)
    rows = x[:, 0]
    pools = {}
    for name, k in (("torch", TORCH), ("triton", TRITON)):
        pool = torch.full((20, 64), float("nan"), dtype=dtype, device=DEVICE)
        rope_store_impl(k)(rows, cos, sin, pool, slots, norm=(w, 1e-6))
        pools[name] = pool
    want = apply_rope_tail(rms_norm_ref(rows, w, 1e-6), cos, sin)
    assert torch.equal(pools["torch"][slots], want)
    torch.testing.assert_close(pools["triton"][slots].float(), want.float(), **tol)
    assert torch.isnan(pools["triton"][1].float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_q_kv_dispatch(dtype):
    """An attention layer's q + KV rotations (`rope_q_kv_impl`): torch is `rope_impl` for q and
    `rope_store_impl` (or `rope_impl`) for the KV row, bit for bit; triton's one launch gives
    q the bits of `rope_impl`'s Triton binding and the KV row inexact (norm inside), the bits of the
    torch chain when the norm family is torch, and stores only at the slots; a pool of another
    dtype takes the rows converted (the norm then runs before the conversion)."""
    gen = torch.Generator().manual_seed(21)
    q = (torch.randn(6, 4, 64, generator=gen) * 3).to(dtype).to(DEVICE)
    kv = (torch.randn(6, 64, generator=gen) * 3).to(dtype).to(DEVICE)
    ang = torch.rand(6, 16, generator=gen) * 50
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    w = (torch.rand(64, generator=gen) + 0.5).to(DEVICE)
    slots = torch.tensor([9, 3, 17, 0, 4, 12], device=DEVICE)
    q_norm, kv_norm = (None, 1e-6), (w, 1e-6)
    want_q = rope_impl(TORCH)(q, cos, sin, norm=q_norm)
    want_kv = rope_impl(TORCH)(kv, cos, sin, norm=kv_norm)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    norm_torch = KernelChoice("triton", (("norm", "torch"),))
    for k in (TORCH, TRITON, norm_torch):
        got_q, got_kv = rope_q_kv_impl(k)(q, kv, cos, sin, q_norm=q_norm, kv_norm=kv_norm)
        pool = torch.full((20, 64), float("nan"), dtype=dtype, device=DEVICE)
        stored_q, none = rope_q_kv_impl(k)(
            q, kv, cos, sin, q_norm=q_norm, kv_norm=kv_norm, pool=pool, slots=slots
        )
        assert none is None and torch.equal(stored_q, got_q)
        assert torch.isnan(pool[1].float()).all() and torch.equal(pool[slots], got_kv)
        if k is TRITON:
            assert torch.equal(got_q, rope_impl(TRITON)(q, cos, sin, norm=q_norm))
            torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
            torch.testing.assert_close(got_kv.float(), want_kv.float(), **tol)
        else:
            assert torch.equal(got_q, want_q) and torch.equal(got_kv, want_kv)
    if dtype == torch.float32:  # a bf16 pool: the fp32 rows normed, rotated, then converted
        pool = torch.full((20, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        rope_q_kv_impl(TRITON)(q, kv, cos, sin, kv_norm=kv_norm, pool=pool, slots=slots)
        want = apply_rope_tail(rms_norm_ref(kv, *kv_norm).to(torch.bfloat16), cos, sin)
        # The Triton norm's fp32 sum order may move a bf16 rounding.
        torch.testing.assert_close(pool[slots].float(), want.float(), rtol=2**-7, atol=2e-2)
        assert torch.isnan(pool[1].float()).all()
