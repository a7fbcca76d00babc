"""Manifold-constrained hyper-connections (mHC): coefficients, collapse, stream update, head."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch
from torch import nn

from sgl_dspark.kernels.fp8.reference import Fp8ActFormat
from sgl_dspark.kernels.mhc.reference import MhcPostCombineOutput
from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.fp8_linear import attach_fp8, fp8_linear_impl
from sgl_dspark.srt.layers.norm import RMSNorm


class HyperConnection(nn.Module):
    """One mHC mixer (`attn_hc` / `ffn_hc`): parameters `fn`, `base`, `scale` (HF names, fp32)."""

    def __init__(
        self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, rms_eps: float
    ) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult = n
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.rms_eps = rms_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def coeffs(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams `[T, n, D]` -> pre `[T, n]`, post `[T, n]`, comb `[T, n, n]` (all fp32)."""
        n = self.hc_mult
        u = rms_norm_ref(streams.flatten(1).float(), None, self.rms_eps)
        mix = u @ self.fn.float().t()
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        scale = self.scale.float()
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`sum_j pre[j] * Rs[j]` -> `[T, D]` in streams' dtype (fp32 product and sum)."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand(
    streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """`Rs'[k] = post[k] * y + sum_j comb[j, k] * Rs[j]` (HF casts post/comb to the act dtype)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    """Final stream collapse (`model.hc_head`: `hc_fn`, `hc_base`, `hc_scale`)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, rms_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.rms_eps = rms_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        u = rms_norm_ref(streams.flatten(1).float(), None, self.rms_eps)
        pre = torch.sigmoid(
            (u @ self.hc_fn.float().t()) * self.hc_scale.float() + self.hc_base.float()
        )
        return hc_collapse(streams, pre + self.hc_eps)


# ---- fused sublayer boundaries ("mhc" family) ---------------------------------------------------


class HcSublayers(Protocol):
    """What the fused loop reads from one layer: both mixers and both sublayer-input norms."""

    attn_hc: HyperConnection
    ffn_hc: HyperConnection
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm


class HcBoundary(Protocol):
    """The fused sublayer boundaries of the "mhc" family (see `hc_boundary_impl`)."""

    def __call__(
        self,
        streams: torch.Tensor,
        y: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        next_hc: HyperConnection,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Close a sublayer and open the next: (streams', next input normed, post', comb')."""

    def open(
        self,
        streams: torch.Tensor,
        hc: HyperConnection,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Open the first sublayer: (its normed input, post, comb)."""

    def close_to_head(
        self,
        streams: torch.Tensor,
        y: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        head: HyperHead,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Close the last sublayer and apply the hyper head and the final norm:
        (streams', `head(streams')`, `norm(head(streams'))`)."""

    def open_single_pass(
        self,
        streams: torch.Tensor,
        prev_pre: torch.Tensor,
        hc: HyperConnection,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Single-pass mHC: open a sublayer whose input is collapsed with the previous site's
        `prev_pre` `[T, n]`: (its normed input, its own pre, post, comb)."""

    def single_pass(
        self,
        streams: torch.Tensor,
        y: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        prev_pre: torch.Tensor,
        next_hc: HyperConnection,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Single-pass mHC: close a sublayer and open the next, collapsing its input with
        `prev_pre` (the closed site's pre): (streams', next input normed, pre', post', comb')."""

    def close_collapse(
        self,
        streams: torch.Tensor,
        y: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        pre: torch.Tensor,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Close a sublayer, then collapse the new streams with `pre` and apply `norm`:
        (streams', collapse, normed collapse); no coefficients are computed."""


class CoefficientStream:
    """Where a single-pass boundary's coefficients run (`mhc_post_combine`'s `coeffs_scope`):
    while a CUDA graph is captured, on a side stream forked from the current one after the
    boundary's phase A and joined back by the next boundary launch, which reads them; so the
    Sinkhorn chain runs beside the sublayer's GEMMs instead of before them. Eagerly (and off
    CUDA) nowhere apart: two stream switches a boundary would cost host time in a step the
    host already bounds. The same programs run either way, so the bits do not change."""

    def __init__(self) -> None:
        self._side: torch.cuda.Stream | None = None
        self._joiner: torch.cuda.Stream | None = None  # the stream that forked, until it joins
        # What the forked work reads, held until the join orders its release after that work.
        self._held: torch.Tensor | None = None

    def scope(
        self, device: torch.device
    ) -> Callable[[torch.Tensor], AbstractContextManager[object]] | None:
        """The scope to launch the coefficients in on `device`, or None (the usual launch)."""
        if device.type != "cuda":
            return None
        if self._side is None or self._side.device != device:
            # Made on the first call, an eager one: a graph runner warms up before it captures.
            self._side = torch.cuda.Stream(device)
        if not torch.cuda.is_current_stream_capturing():
            return None
        return self._fork

    @contextmanager
    def _fork(self, reads: torch.Tensor) -> Iterator[None]:
        assert self._side is not None and self._joiner is None, "a fork was left unjoined"
        current = torch.cuda.current_stream(self._side.device)
        self._side.wait_stream(current)  # after phase A, which wrote the partials
        with torch.cuda.stream(self._side):
            yield
        self._joiner, self._held = current, reads

    def join(self) -> None:
        """Order the current stream's next work after the forked coefficients (no-op if none);
        what they read may then be released and reused by the current stream."""
        if self._joiner is not None:
            assert self._side is not None
            self._joiner.wait_stream(self._side)
            self._joiner = self._held = None


def hc_boundary_impl(kernels: KernelChoice) -> HcBoundary | None:
    """The fused sublayer boundary of the "mhc" family, or None for the unfused torch path.

    triton: `kernels/mhc/post_combine.py::mhc_post_combine` closes one sublayer (`hc_expand`) and
    opens the next (`coeffs`, `hc_collapse`, weighted RMSNorm) in one kernel (two launches: a pass
    split over D, then a per-row finish); `open` (`mhc_pre`) runs the same kernel without the
    stream update for the first sublayer (about 120 small torch kernels otherwise: the Sinkhorn
    loop alone is 3 per iteration); `close_to_head` closes the last sublayer with the hyper head
    and the final norm in the place of the next mixer and its norm. It differs from the
    torch path: the stream update is accumulated in fp32 with fp32 post/comb (`hc_expand` casts
    them to the activation dtype and uses a matmul), and the coefficient reductions run in a
    different order, so outputs agree to a tolerance, not bit for bit. Single-pass mHC
    (DeepSeek-V4.1, `run_single_pass_layers`): the same kernel takes the previous site's pre in
    for the collapse and gives the new pre out (`single_pass`, `open_single_pass`), and
    `close_collapse` (`mhc_post_collapse`) closes a sublayer into a given pre's collapse and a
    norm without computing coefficients.

    With FP8 activations on (`layers/fp8_linear.py`) the boundaries that open a sublayer of more
    rows than the decode-size kernels take also write its normed input's FP8 form in the same
    launch, recorded on the returned tensor for the sublayer's W8A8 GEMMs (bit-exact to
    quantising the stored normed input; nothing else changes).
    """
    if kernels.of("mhc") == "torch":
        return None
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.mhc.post_combine import (
        mhc_post_collapse,
        mhc_post_combine,
        mhc_pre,
    )

    def opening(
        streams: torch.Tensor, hc: HyperConnection, norm: RMSNorm, collapse_pre: torch.Tensor | None
    ) -> dict:
        """The arguments that open a sublayer at mixer `hc` and its norm (both launches'). A
        single-pass site's coefficients go apart (`CoefficientStream`); every launch first
        joins the coefficients of the site before it, which it reads."""
        assert norm.eps == hc.rms_eps, (norm.eps, hc.rms_eps)
        side.join()
        return {
            "coeffs_scope": side.scope(streams.device) if collapse_pre is not None else None,
            "fn": hc.fn,
            "base": hc.base,
            "scale": hc.scale,
            "norm_weight": norm.weight,
            "hc_eps": hc.hc_eps,
            "sinkhorn_iters": hc.sinkhorn_iters,
            "rms_eps": hc.rms_eps,
            "collapse_pre": collapse_pre,
            "fp8_out": fp8_out(streams),
        }

    def combine_at(
        streams: torch.Tensor,
        y: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        hc: HyperConnection,
        norm: RMSNorm,
        collapse_pre: torch.Tensor | None,
    ) -> MhcPostCombineOutput:
        """Close a sublayer and open the next at mixer `hc` and its norm; the next input is
        collapsed with `collapse_pre` (single pass) or with the mixer's own pre (two pass)."""
        return mhc_post_combine(
            streams, y.contiguous(), post, comb, **opening(streams, hc, norm, collapse_pre)
        )

    def open_at(
        streams: torch.Tensor,
        hc: HyperConnection,
        norm: RMSNorm,
        collapse_pre: torch.Tensor | None,
    ) -> MhcPostCombineOutput:
        """`combine_at` without the stream update: open a sublayer."""
        return mhc_pre(streams, **opening(streams, hc, norm, collapse_pre))

    fp8 = fp8_linear_impl(kernels)
    side = CoefficientStream()

    def fp8_out(streams: torch.Tensor) -> Fp8ActFormat | None:
        """The FP8 form to write for a sublayer input of these rows, if any."""
        return fp8.fmt if fp8 is not None and fp8.wants(streams.shape[0]) else None

    def normed(out: MhcPostCombineOutput) -> torch.Tensor:
        """The normed input, its FP8 form recorded on it when written."""
        if fp8 is not None and out.x_fp8 is not None:
            attach_fp8(out.x_normed, fp8.fmt, out.x_fp8)
        return out.x_normed

    class _Boundary:
        def __call__(
            self,
            streams: torch.Tensor,
            y: torch.Tensor,
            post: torch.Tensor,
            comb: torch.Tensor,
            next_hc: HyperConnection,
            next_norm: RMSNorm,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            out = combine_at(streams, y, post, comb, next_hc, next_norm, None)
            return out.streams, normed(out), out.post, out.comb

        def open(
            self,
            streams: torch.Tensor,
            hc: HyperConnection,
            norm: RMSNorm,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            out = open_at(streams, hc, norm, None)
            return normed(out), out.post, out.comb

        def close_to_head(
            self,
            streams: torch.Tensor,
            y: torch.Tensor,
            post: torch.Tensor,
            comb: torch.Tensor,
            head: HyperHead,
            norm: RMSNorm,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            # The hyper head is the pre half of a mixer (weightless RMSNorm over n·D, fn
            # projection, sigmoid + eps, collapse) and the final norm follows it, so the last
            # boundary's kernel computes both from the head's fn/base/scale zero-padded to a
            # mixer's shape (the padded rows only feed post/comb, which are discarded): one
            # kernel instead of the unfused stream update (five torch launches) and another.
            assert norm.eps == head.rms_eps, (norm.eps, head.rms_eps)
            fn, base, scale = _padded_head_params(head)
            side.join()
            out = mhc_post_combine(
                streams,
                y.contiguous(),
                post,
                comb,
                fn,
                base,
                scale,
                norm.weight,
                hc_eps=head.hc_eps,
                sinkhorn_iters=1,
                rms_eps=head.rms_eps,
            )
            return out.streams, out.x_in, out.x_normed

        def open_single_pass(
            self,
            streams: torch.Tensor,
            prev_pre: torch.Tensor,
            hc: HyperConnection,
            norm: RMSNorm,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            out = open_at(streams, hc, norm, prev_pre)
            return normed(out), out.pre, out.post, out.comb

        def single_pass(
            self,
            streams: torch.Tensor,
            y: torch.Tensor,
            post: torch.Tensor,
            comb: torch.Tensor,
            prev_pre: torch.Tensor,
            next_hc: HyperConnection,
            next_norm: RMSNorm,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            out = combine_at(streams, y, post, comb, next_hc, next_norm, prev_pre)
            return out.streams, normed(out), out.pre, out.post, out.comb

        def close_collapse(
            self,
            streams: torch.Tensor,
            y: torch.Tensor,
            post: torch.Tensor,
            comb: torch.Tensor,
            pre: torch.Tensor,
            norm: RMSNorm,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            side.join()
            out = mhc_post_collapse(
                streams, y.contiguous(), post, comb, pre, norm.weight, rms_eps=norm.eps
            )
            return out.streams, out.x_in, out.x_normed

    return _Boundary()


def _padded_head_params(head: HyperHead) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fn, base, scale) of a mixer whose pre half is `head`, cached on the module and rebuilt
    when a head parameter is replaced (placement and casts assign new tensors; weights are loaded
    before the first forward). The first call runs eagerly (the graph runner warms up before
    capturing), so capture sees the cache."""
    key = tuple(p.data_ptr() for p in (head.hc_fn, head.hc_base, head.hc_scale))
    cached = getattr(head, "_padded_params", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    n = head.hc_fn.shape[0]
    r = (2 + n) * n
    fn = head.hc_fn.new_zeros(r, head.hc_fn.shape[1], dtype=torch.float32)
    fn[:n] = head.hc_fn.float()
    base = head.hc_base.new_zeros(r, dtype=torch.float32)
    base[:n] = head.hc_base.float()
    scale = torch.ones(3, dtype=torch.float32, device=head.hc_scale.device)
    scale[0] = head.hc_scale.float().reshape(())
    params = (fn, base, scale)
    head._padded_params = (key, params)  # type: ignore[assignment]
    return params


def run_fused_hc_layers(
    streams: torch.Tensor,
    layers: Sequence[HcSublayers],
    attn: Callable[[int, torch.Tensor], torch.Tensor],
    ffn: Callable[[int, torch.Tensor], torch.Tensor],
    boundary: HcBoundary,
    after_layer: Callable[[int, torch.Tensor], None] | None = None,
    head: tuple[HyperHead, RMSNorm] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Run mHC layers with fused boundaries: attn post + ffn pre inside a layer, ffn post + the
    next layer's attn pre across layers.

    The first layer's attn pre runs `boundary.open`; the last layer's ffn post runs with the
    hyper head and the final norm (`boundary.close_to_head`) when `head` is given, unfused
    otherwise.

    Args:
        streams: `[T, n, D]` residual streams entering layer 0.
        attn, ffn: `(layer index, normed input [T, D]) -> sublayer output [T, D]`.
        boundary: from `hc_boundary_impl`.
        after_layer: called with `(layer index, streams after the layer)` (hidden-state taps).
        head: the hyper head and the final norm (`[T, D]` each: every row gets them).
    Returns the streams after the last layer and, with `head`, (`head(streams)`,
    `norm(head(streams))`).
    """
    x, post, comb = boundary.open(streams, layers[0].attn_hc, layers[0].input_layernorm)
    head_out = None
    for i, layer in enumerate(layers):
        a = attn(i, x)
        streams, x, post, comb = boundary(
            streams, a, post, comb, layer.ffn_hc, layer.post_attention_layernorm
        )
        f = ffn(i, x)
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            streams, x, post, comb = boundary(
                streams, f, post, comb, nxt.attn_hc, nxt.input_layernorm
            )
        elif head is not None:
            streams, y, y_normed = boundary.close_to_head(streams, f, post, comb, *head)
            head_out = (y, y_normed)
        else:
            streams = hc_expand(streams, f, post, comb)
        if after_layer is not None:
            after_layer(i, streams)
    return streams, head_out


# ---- single-pass mHC (DeepSeek-V4.1) -------------------------------------------------------------


def run_single_pass_layers(
    streams: torch.Tensor,
    layers: Sequence[HcSublayers],
    attn: Callable[[int, torch.Tensor], torch.Tensor],
    ffn: Callable[[int, torch.Tensor], torch.Tensor],
    boundary: HcBoundary | None,
    final_norm: tuple[RMSNorm, Callable[..., torch.Tensor]],
    before_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    rewrites: Container[int] = (),
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run layers of single-pass mHC: every site computes its coefficients from its input
    streams as usual, but collapses its sublayer input with the PREVIOUS site's `pre` (the
    first input is stream 0); the output is the last FFN site's collapse, normed. No hyper
    head.

    Args:
        streams: `[T, n, D]` entering layer 0.
        attn, ffn: `(layer index, normed input [T, D]) -> sublayer output [T, D]`.
        boundary: the fused boundaries (`hc_boundary_impl`), or None for the torch path, which
            follows HF's rounding (`hc_expand`, `hc_collapse`).
        final_norm: the final RMSNorm module and the norm function to apply it with.
        before_layer: `(layer index, streams entering it) -> streams`: the Engram of a layer in
            `rewrites` returns new streams; other layers only read them (hidden-state taps) and
            must return the same tensor.
        rows: the rows whose output is wanted (all when None).
    Returns (y, norm(y)) `[rows, D]`: y = the final collapse, before the norm.
    """
    norm, norm_fn = final_norm
    pre = streams.new_zeros(streams.shape[0], streams.shape[1], dtype=torch.float32)
    pre[:, 0] = 1.0  # the first sublayer reads stream 0

    def enter(i: int, s: torch.Tensor) -> torch.Tensor:
        if before_layer is None:
            return s
        out = before_layer(i, s)
        assert i in rewrites or out is s, f"layer {i} rewrote its input streams"
        return out

    if boundary is None:
        for i, layer in enumerate(layers):
            streams = enter(i, streams)
            pre_attn, post, comb = layer.attn_hc.coeffs(streams)
            x = layer.input_layernorm(hc_collapse(streams, pre))
            streams = hc_expand(streams, attn(i, x), post, comb)
            pre_ffn, post, comb = layer.ffn_hc.coeffs(streams)
            x = layer.post_attention_layernorm(hc_collapse(streams, pre_attn))
            streams = hc_expand(streams, ffn(i, x), post, comb)
            pre = pre_ffn
        if rows is not None:
            streams, pre = streams[rows], pre[rows]
        y = hc_collapse(streams, pre)
        return y, norm_fn(y, norm.weight, norm.eps)

    streams = enter(0, streams)
    first = layers[0]
    x, pre_attn, post, comb = boundary.open_single_pass(
        streams, pre, first.attn_hc, first.input_layernorm
    )
    for i, layer in enumerate(layers):
        streams, x, pre_ffn, post, comb = boundary.single_pass(
            streams, attn(i, x), post, comb, pre_attn, layer.ffn_hc, layer.post_attention_layernorm
        )
        f = ffn(i, x)
        if i + 1 == len(layers):
            _, y, y_normed = boundary.close_collapse(streams, f, post, comb, pre_ffn, norm)
            if rows is not None:
                y, y_normed = y[rows], y_normed[rows]
            return y, y_normed
        nxt = layers[i + 1]
        if i + 1 in rewrites:
            # The next layer's Engram changes the streams between this FFN's update and the
            # next attention's coefficients: the boundary is not fused across it.
            streams, _, _ = boundary.close_collapse(streams, f, post, comb, pre_ffn, norm)
            streams = enter(i + 1, streams)
            x, pre_attn, post, comb = boundary.open_single_pass(
                streams, pre_ffn, nxt.attn_hc, nxt.input_layernorm
            )
        else:
            streams, x, pre_attn, post, comb = boundary.single_pass(
                streams, f, post, comb, pre_ffn, nxt.attn_hc, nxt.input_layernorm
            )
            enter(i + 1, streams)
    raise AssertionError("no layers")
