"""DeepSeek-V4 rotary embedding: interleaved pairs on the trailing `rd` channels.

Two rope types exist: "main" (plain RoPE, sliding-only layers) and "compress" (optionally YaRN;
CSA/HCA layers, their compressors and the indexer). The target model looks its cos/sin rows up in
a `RopeTable` of every position its context can hold (computed once with `rope_cos_sin`, so the
rows are the bits a per-forward computation gives); so does the DSpark draft once its runtime has
built its own table (`DSparkDraftModel.build_rope_table`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.srt.configs.model_config import RopeConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.norm import rms_norm_impl
from sgl_dspark.srt.layers.quant_store import quant_store_impl
from sgl_dspark.srt.mem_cache.v41_pool import QuantizedRows
from sgl_dspark.srt.quantization.fake_quant import fake_quant_fp8_window

# (x [N, ..., Dh], cos [N, rd/2], sin [N, rd/2], inverse) -> rotated copy of x
RopeTailFn = Callable[..., torch.Tensor]


def rope_inv_freq(rope: RopeConfig, rope_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies `[rope_dim // 2]` (fp32), with YaRN ramp when configured.
    Computed on the host whatever the ambient device (a model is built on the meta device and
    keeps this derived buffer)."""
    exps = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    pos_freqs = rope.theta**exps
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return inv_freq

    # YaRN: blend interpolated and extrapolated frequencies with a linear ramp
    # over the pair index; attention_factor stays 1 (DeepSeek-V4 applies no mscale).
    def correction_dim(num_rotations: float) -> float:
        return (
            rope_dim
            * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(rope.theta))

    lo = max(math.floor(correction_dim(rope.beta_fast)), 0)
    hi: float = min(math.ceil(correction_dim(rope.beta_slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - lo) / (hi - lo)).clamp(0, 1)
    inv_interp = 1.0 / (rope.factor * pos_freqs)
    return inv_interp * ramp + inv_freq * (1 - ramp)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[N, rd/2]` in fp32 for integer positions `[N]`."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos(), freqs.sin()


class RopeTable:
    """cos | sin of one rope type at positions 0..length-1, fp32 `[length, rd]`, computed once.

    A decode step otherwise rebuilds every table from its positions (cast, outer product, cos,
    sin: four launches per table and per compressor block start); a lookup is one gather. Rows
    are `rope_cos_sin`'s for the same positions (the same elementwise ops on the same values).
    """

    def __init__(self, inv_freq: torch.Tensor, length: int, shifts: tuple[int, ...] = ()) -> None:
        positions = torch.arange(length, dtype=torch.int64, device=inv_freq.device)
        cos, sin = rope_cos_sin(positions, inv_freq)
        self.half = cos.shape[1]
        self.length = length
        self.table = torch.cat((cos, sin), dim=1)
        # Row p of shifted[s] is row p - s of the table (wrapping like a negative index): the
        # compressors' block starts (position - (m - 1)) in one gather instead of two launches.
        self.shifted = {s: torch.roll(self.table, s, dims=0) for s in shifts if s}

    def lookup(self, positions: torch.Tensor, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[N, rd/2]` of `positions - shift` (positions `[N]`, the shifted ones in
        `[-length, length)`): column views of one gathered `[N, rd]` block (unit stride along
        rd/2, one row stride for both). Negative positions wrap (they only occur for block
        starts of rows that end no block, whose entries are discarded)."""
        if shift == 0:
            rows = self.table[positions]
        elif shift in self.shifted:
            rows = self.shifted[shift][positions]
        else:
            rows = self.table[positions - shift]
        return rows[:, : self.half], rows[:, self.half :]


def apply_rope_tail(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of `x` in interleaved pairs: the "rope"
    family's torch path, `rope_tail_ref` (`kernels/rope/reference.py`).

    Args:
        x: `[N, ..., Dh]`; rows align with `cos`/`sin` `[N, rd/2]` (broadcast over middle dims).
        inverse: rotate by -phi (used to undo the rope carried by V on the attention output).
    Returns a new tensor of x's dtype; math in fp32, the nope channels pass through.
    """
    return rope_tail_ref(x, cos, sin, inverse=inverse)


# An RMSNorm applied to x right before its rotation: (weight [Dh] or None for the weightless
# per-head norm, eps). The norm family's implementation, unless rope and norm are both Triton,
# in which case the rope kernel normalises each row itself (one launch instead of two).
PreNorm = tuple[torch.Tensor | None, float]


def _fuses_norm(kernels: KernelChoice) -> bool:
    return kernels.of("rope") == "triton" and kernels.of("norm") == "triton"


def _launch_ready(
    x: torch.Tensor,
    norm: PreNorm | None,
    fuse: bool,
    norm_fn: Callable,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, PreNorm | None]:
    """x for a Triton rope launch: (x, the norm the launch must fuse, or None). The norm is
    applied here instead when it cannot be fused (`fuse` False, or x is cast to another
    `dtype`, a pool's, after it); x leaves in `dtype` with unit channel stride."""
    dtype = x.dtype if dtype is None else dtype
    if norm is not None and not (fuse and x.dtype == dtype):
        x, norm = norm_fn(x, *norm), None
    if x.dtype != dtype or x.stride(-1) != 1:  # the kernel reads rows with unit channel stride
        x = x.to(dtype).contiguous()
    return x, norm


def _norm_kwargs(norm: PreNorm | None) -> dict[str, Any]:
    return {} if norm is None else {"norm_weight": norm[0], "norm_eps": norm[1]}


def rope_impl(kernels: KernelChoice) -> RopeTailFn:
    """The rope-tail implementation of the "rope" family, bound once by the layer that uses it.

    torch: `apply_rope_tail`. triton: the rope kernel (`kernels/rope/tail.py::rope_tail`), which
    equals `apply_rope_tail` bit for bit (the same separately rounded fp32 products, one RNE round to
    x's dtype). Both take `(x, cos, sin, inverse=False, norm=None)`; the Triton one takes x
    `[N, Dh]` or `[N, H, Dh]` with unit stride along Dh. `norm` (a `PreNorm`) normalises every
    row of Dh first; with "norm" also Triton that happens inside the rope launch (inexact against
    the two launches: the sum of squares is reduced in another order; the rounding points are
    the same).
    """
    norm_fn = rms_norm_impl(kernels)
    if kernels.of("rope") == "torch":

        def rope_torch(
            x: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            inverse: bool = False,
            norm: PreNorm | None = None,
        ) -> torch.Tensor:
            if norm is not None:
                x = norm_fn(x, *norm)
            return apply_rope_tail(x, cos, sin, inverse)

        return rope_torch
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.rope.tail import rope_tail

    fuse = _fuses_norm(kernels)

    def rope_tail_triton(
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        inverse: bool = False,
        norm: PreNorm | None = None,
    ) -> torch.Tensor:
        x, norm = _launch_ready(x, norm, fuse, norm_fn)
        fused_norm = _norm_kwargs(norm)
        if x.dim() == 2:  # single-head rows (kv, compressor entries): one head of Dh
            return rope_tail(x.unsqueeze(1), cos, sin, inverse=inverse, **fused_norm).squeeze(1)
        assert x.dim() == 3, f"rope_tail takes [N, Dh] or [N, H, Dh], got {tuple(x.shape)}"
        return rope_tail(x, cos, sin, inverse=inverse, **fused_norm)

    return rope_tail_triton


# (x [N, Dh], cos [N, rd/2], sin [N, rd/2], pool [slots, Dh], slots [N], norm=None, quant=None)
# -> None: pool[slots] = quant(rope(norm(x))) in the pool's dtype
RopeStoreFn = Callable[..., None]

# Quantisers a rope launch may apply to the rows it writes: "fp8_window", DeepSeek-V4.1's window
# KV quantiser (`fake_quant_fp8_window`), whose values the pool's dtype holds exactly.
ROW_QUANTS = ("fp8_window",)


def _check_quant(quant: str) -> None:
    if quant not in ROW_QUANTS:
        raise ValueError(f"quant={quant!r}: expected one of {ROW_QUANTS}")


def _row_quant(x: torch.Tensor, quant: str | None) -> torch.Tensor:
    if quant is None:
        return x
    _check_quant(quant)
    return fake_quant_fp8_window(x)


# (q [T, H, Dh], cos [T, rd/2], sin [T, rd/2], q norm (`PreNorm`) or None, kv [T, Dkv], the
# window cache (`QuantizedRows`), rows [T]) -> q rotated; the KV row rotated and stored
RopeQStoreKvFn = Callable[..., torch.Tensor]


def rope_q_store_kv_impl(kernels: KernelChoice) -> RopeQStoreKvFn:
    """A DeepSeek-V4.1 layer's query rotation (`rope_impl`'s, its per-head norm included) and
    its window KV row's store (`quant_store_impl`'s: rotated, quantised, written to the packed
    cache), of the "rope" family. torch: the two. triton, with the norm fused into the rope
    launch ("norm" Triton too) and a packed cache: one launch
    (`kernels/rope/q_kv.py::rope_q_quant_store_kv`) instead of two, each value its own call's
    bits; otherwise the two launches."""
    rope, store = rope_impl(kernels), quant_store_impl(kernels)

    def separate(
        q: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: PreNorm | None,
        kv: torch.Tensor,
        cache: QuantizedRows,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        q = rope(q, cos, sin, norm=q_norm)
        store(kv, cos, sin, cache, rows)
        return q

    if not _fuses_norm(kernels):
        return separate
    from sgl_dspark.kernels.rope.q_kv import rope_q_quant_store_kv

    def one_launch(
        q: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: PreNorm | None,
        kv: torch.Tensor,
        cache: QuantizedRows,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        weighted = q_norm is not None and q_norm[0] is not None
        if not cache.packed or weighted or q.stride(-1) != 1 or kv.stride(-1) != 1:
            return separate(q, cos, sin, q_norm, kv, cache, rows)
        assert cache.scales is not None
        return rope_q_quant_store_kv(
            q,
            cos,
            sin,
            kv,
            rows,
            cache.data,
            cache.scales,
            cache.fmt,
            q_norm_eps=None if q_norm is None else q_norm[1],
        )

    return one_launch


def rope_store_impl(kernels: KernelChoice) -> RopeStoreFn:
    """Rotate single-head rows and store them into a paged pool (the KV write of a layer), of the
    "rope" family, optionally normalising them first (`norm`, as in `rope_impl`). torch:
    `apply_rope_tail` then an index_put. triton: one `rope_tail` launch that scatters each
    rotated row to its slot (bit for bit the same values), with the norm inside it when "norm"
    is Triton too. `quant` (`ROW_QUANTS`) quantises the stored rows."""
    norm_fn = rms_norm_impl(kernels)
    if kernels.of("rope") == "torch":

        def store_torch(
            x: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            pool: torch.Tensor,
            slots: torch.Tensor,
            norm: PreNorm | None = None,
            quant: str | None = None,
        ) -> None:
            if norm is not None:
                x = norm_fn(x, *norm)
            pool[slots] = _row_quant(apply_rope_tail(x, cos, sin), quant).to(pool.dtype)

        return store_torch
    from sgl_dspark.kernels.quant.store import quant_store_values
    from sgl_dspark.kernels.rope.tail import rope_tail

    fuse = _fuses_norm(kernels)

    def store_triton(
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: torch.Tensor,
        slots: torch.Tensor,
        norm: PreNorm | None = None,
        quant: str | None = None,
    ) -> None:
        if quant is not None:
            # One launch rotates, quantises and stores (the norm runs before it).
            _check_quant(quant)
            x, _ = _launch_ready(x, norm, False, norm_fn, pool.dtype)
            quant_store_values(x, slots, pool, cos, sin)
            return
        x, norm = _launch_ready(x, norm, fuse, norm_fn, pool.dtype)
        rope_tail(
            x.unsqueeze(1), cos, sin, out=pool.unsqueeze(1), out_rows=slots, **_norm_kwargs(norm)
        )

    return store_triton


# (q [N, H, Dh], kv [N, Dkv], cos, sin, q_norm=None, kv_norm=None, pool=None, slots=None)
# -> (rotated q, rotated kv rows, or None when they were stored into pool[slots])
RopeQKVFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def rope_q_kv_impl(kernels: KernelChoice) -> RopeQKVFn:
    """An attention layer's rotations at one set of positions, of the "rope" family: the query
    heads (optional `q_norm`) and the KV row (optional `kv_norm`), the latter returned, or with
    `pool`/`slots` stored into the paged pool. torch: `rope_impl` for both (and an index_put).
    triton: one launch for both (`kernels/rope/q_kv.py::rope_q_kv`), with the norms
    inside it when "norm" is Triton too; the query rows are `rope_impl`'s bits, the KV row's
    norm within a tolerance (its sum of squares runs over the launch's warps)."""
    rope = rope_impl(kernels)
    if kernels.of("rope") == "torch":
        store = rope_store_impl(kernels)

        def q_kv_torch(
            q: torch.Tensor,
            kv: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            q_norm: PreNorm | None = None,
            kv_norm: PreNorm | None = None,
            pool: torch.Tensor | None = None,
            slots: torch.Tensor | None = None,
            kv_quant: str | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            q = rope(q, cos, sin, norm=q_norm)
            if pool is None:
                return q, _row_quant(rope(kv, cos, sin, norm=kv_norm), kv_quant)
            store(kv, cos, sin, pool, slots, norm=kv_norm, quant=kv_quant)
            return q, None

        return q_kv_torch
    from sgl_dspark.kernels.quant.store import quant_store_values
    from sgl_dspark.kernels.rope.q_kv import rope_q_kv

    norm_fn = rms_norm_impl(kernels)
    fuse = _fuses_norm(kernels)

    def q_kv_triton(
        q: torch.Tensor,
        kv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: PreNorm | None = None,
        kv_norm: PreNorm | None = None,
        pool: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        kv_quant: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if kv_quant is not None:
            # The query heads' rope, then one launch that rotates, quantises and writes the
            # KV rows (into the pool, or into fresh rows); the KV norm runs before it.
            _check_quant(kv_quant)
            q_out = rope(q, cos, sin, norm=q_norm)
            kv, _ = _launch_ready(kv, kv_norm, False, norm_fn, None if pool is None else pool.dtype)
            if pool is not None:
                assert slots is not None
                quant_store_values(kv, slots, pool, cos, sin)
                return q_out, None
            rows_out = torch.empty_like(kv)
            rows = torch.arange(kv.shape[0], device=kv.device)
            quant_store_values(kv, rows, rows_out, cos, sin)
            return q_out, rows_out
        # The launch fuses the weightless q norm only (a weighted one runs before it).
        q, q_norm = _launch_ready(
            q, q_norm, fuse and (q_norm is None or q_norm[0] is None), norm_fn
        )
        kv, kv_norm = _launch_ready(
            kv, kv_norm, fuse, norm_fn, None if pool is None else pool.dtype
        )
        q_out, kv_out = rope_q_kv(
            q,
            kv,
            cos,
            sin,
            q_norm_eps=None if q_norm is None else q_norm[1],
            kv_norm_eps=None if kv_norm is None else kv_norm[1],
            kv_norm_weight=None if kv_norm is None else kv_norm[0],
            kv_out=pool,
            kv_rows=slots,
        )
        return q_out, None if pool is not None else kv_out

    return q_kv_triton
