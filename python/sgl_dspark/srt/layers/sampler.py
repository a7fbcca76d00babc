"""The sampler of plain and speculative decoding: per-row parameters, per-request seeded
randomness, one inverse-CDF draw.

Per row, for a sampled (non-greedy) request, with p = softmax(logits / temperature):

1. top-k: keep the k most probable tokens (ties at the boundary go to the lower token id);
2. top-p: on the top-k distribution renormalised, keep the smallest most-probable prefix whose
   mass reaches top_p (a token is kept iff the mass strictly before it is < top_p);
3. min-p: keep tokens with p >= min_p * max(p);
4. draw by the fixed-point inverse CDF (`sample_from_probs`: integer masses, so every device and
   every reduction order picks the same token for the same uniform).

Totality: every parameter value that `SamplingParams` accepts gives a distribution with mass and
a token in [0, V). The most probable token always survives the filters (a top_p so small that it
rounds to 0 in fp32 keeps exactly that token instead of nothing), a top_k past the vocabulary
means "off", and the temperature is clamped into fp32's finite range before the division.

Greedy rows (`top_k == 1`, which includes temperature 0) take the first argmax of the logits.
The returned logprob of each chosen token is `log_softmax(logits / temperature)` (temperature 1
for greedy rows), before top-k / top-p / min-p: SGLang's default (`srt/layers/logprobs.py`).
The logits the sampler sees are already adjusted (penalties, biases, grammar:
`srt/layers/logits_adjust.py`) when the request asks for that.

Randomness (no `torch.Generator` state on the device, no `.item()`): every uniform is a hash of
(request seed, counter, stream). The counter is the index, in the request's output, of the token
the uniform decides (0 for the first generated token); the stream separates the uses: the
sampler's own draw, and DSpark's draft proposal, acceptance coin and bonus draw. So a seeded
request draws the same uniforms whatever else is in the batch, across steps, TP ranks and graph
replays, with or without the overlap schedule. Rows without a seed get a fresh random key from a
host-side `torch.Generator` each time a batch record is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from sgl_dspark.kernels.sampling.reference import sample_inverse_cdf_ref, to_fixed_point
from sgl_dspark.srt.core.host_copy import to_device_packed
from sgl_dspark.srt.core.kernel_choice import KernelChoice

if TYPE_CHECKING:
    from sgl_dspark.srt.sampling.sampling_params import SamplingParams

# Domain constants of the uniforms: each use draws from its own stream, so the draws of one use
# stay independent of another's at the same (seed, counter).
SAMPLER_STREAM = 0x53A4_D1E5
DRAFT_STREAM = 0x2D7A_F70B  # DSpark draft proposals (Markov head)
ACCEPT_STREAM = 0x6C01_A5E9  # DSpark acceptance coins
BONUS_STREAM = 0x1B0E_5A11  # DSpark bonus / correction draws
_MASK32 = 0xFFFFFFFF
_MAX_KEY = 2**63 - 1
# The largest temperature that stays finite in fp32 (a larger one gives the same, uniform, result).
_MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32): split c so no product exceeds 2**48."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit avalanche mixer (xor-shift-multiply, Wellons' "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """One uniform per element from (seed, counter, stream); a pure function, the same on every
    device.

    Args:
        seeds: int64 in [0, 2**63), broadcastable with `counters` (e.g. [B, 1]).
        counters: int64 in [0, 2**63) (e.g. [B, W]: a row's counter plus the position).
        stream: domain constant (e.g. `SAMPLER_STREAM`) separating independent uses.

    Returns:
        float32 in [0, 1) of the broadcast shape, multiples of 2**-24.
    """
    assert seeds.dtype == torch.int64 and counters.dtype == torch.int64, (
        seeds.dtype,
        counters.dtype,
    )
    h = _mix32((seeds & _MASK32) ^ (stream & _MASK32))
    h = _mix32(h ^ ((seeds >> 32) & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ (counters & _MASK32))
    h = _mix32(h ^ ((counters >> 32) & _MASK32) ^ 0x85EBCA6B)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True, slots=True)
class SamplingBatchInfo:
    """Per-row sampling parameters of one batch, as device tensors (built once per batch).

    Greedy rows carry neutral filter values (temperature 1, top_k V, top_p 1, min_p 0).
    `all_greedy`/`need_*` are host flags that only skip work; they never change a row's result.
    """

    temperatures: torch.Tensor  # [B] fp32 > 0
    top_ps: torch.Tensor  # [B] fp32 in (0, 1]
    top_ks: torch.Tensor  # [B] int64 in [1, V]; V = off
    min_ps: torch.Tensor  # [B] fp32 in [0, 1]
    is_greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64: the request seed, or a fresh random key
    counters: torch.Tensor  # [B] int64: index in the request's output of the row's (first) token
    vocab_size: int
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @property
    def batch_size(self) -> int:
        return int(self.is_greedy.shape[0])

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        *,
        counters: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> SamplingBatchInfo:
        """Build the batch record for `params` (one per row).

        Args:
            params: one `SamplingParams` per logits row.
            vocab_size: V, the width of the logits.
            device: where the sampler runs.
            counters: per row, the index of the token being sampled in its request's output.
                Required when any row has a seed (else every step would redraw the same uniform).
            generator: CPU generator for the keys of unseeded rows (default: torch's global one).

        Raises:
            ValueError: `counters` missing or malformed, or `vocab_size` < 1.
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        batch = len(params)
        if counters is None:
            if any(p.seed is not None for p in params):
                raise ValueError("counters are required when a request has a seed")
            counters = [0] * batch
        counters = [int(c) for c in counters]
        if len(counters) != batch or any(not 0 <= c <= _MAX_KEY for c in counters):
            raise ValueError(f"counters must be {batch} ints in [0, 2**63), got {counters}")
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else min(p.temperature, _MAX_TEMPERATURE) for p, g in zip(params, greedy)]
        top_ks = [
            vocab_size if g or p.top_k < 0 else min(p.top_k, vocab_size)
            for p, g in zip(params, greedy)
        ]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        num_unseeded = sum(p.seed is None for p in params)
        random_keys = iter(
            torch.randint(0, _MAX_KEY, (num_unseeded,), generator=generator).tolist()
        )
        seeds = [p.seed if p.seed is not None else next(random_keys) for p in params]
        temps_t, top_ps_t, min_ps_t = to_device_packed(
            [temps, top_ps, min_ps], torch.float32, device
        )
        top_ks_t, seeds_t, counters_t, greedy_t = to_device_packed(
            [top_ks, seeds, counters, [int(g) for g in greedy]], torch.int64, device
        )
        return cls(
            temperatures=temps_t,
            top_ps=top_ps_t,
            top_ks=top_ks_t,
            min_ps=min_ps_t,
            is_greedy=greedy_t.bool(),
            seeds=seeds_t,
            counters=counters_t,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_min_p=any(m > 0.0 for m in min_ps),
        )

    def per_position(self, width: int) -> SamplingBatchInfo:
        """The record of `width` consecutive output positions per row (a DSpark verify window):
        row r * width + j has row r's parameters and seed and counter `counters[r] + j`."""
        counters = self.counters[:, None] + torch.arange(width, device=self.counters.device)
        return dataclasses.replace(
            self,
            temperatures=self.temperatures.repeat_interleave(width),
            top_ps=self.top_ps.repeat_interleave(width),
            top_ks=self.top_ks.repeat_interleave(width),
            min_ps=self.min_ps.repeat_interleave(width),
            is_greedy=self.is_greedy.repeat_interleave(width),
            seeds=self.seeds.repeat_interleave(width),
            counters=counters.reshape(-1),
        )

    def select(self, rows: torch.Tensor) -> SamplingBatchInfo:
        """The record of rows `rows` (a device int64 index) of this batch, in that order: each
        row keeps its parameters, seed (an unseeded row its key) and counter. The host flags
        stay the batch's: they only skip work, so every row's result is the one it has in the
        whole batch."""
        return dataclasses.replace(
            self,
            temperatures=self.temperatures[rows],
            top_ps=self.top_ps[rows],
            top_ks=self.top_ks[rows],
            min_ps=self.min_ps[rows],
            is_greedy=self.is_greedy[rows],
            seeds=self.seeds[rows],
            counters=self.counters[rows],
        )

    def uniforms(self, stream: int, width: int | None = None) -> torch.Tensor:
        """The rows' uniforms of `stream`: [B] at each row's counter, or [B, width] at counters
        `counters[r] + j` (one per position of a window)."""
        if width is None:
            return counter_uniform(self.seeds, self.counters, stream)
        positions = torch.arange(width, device=self.counters.device)
        return counter_uniform(self.seeds[:, None], self.counters[:, None] + positions, stream)


def processed_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution each row samples from (steps 1-3 of the module doc), renormalised.

    Args:
        logits: [B, V] fp32.
        info: the batch's `SamplingBatchInfo`.

    Returns:
        [B, V] fp32, rows summing to 1, zero outside the kept set.
    """
    probs = torch.softmax(logits / info.temperatures[:, None], dim=-1)
    if info.need_top_k or info.need_top_p:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        ranks = torch.arange(probs.shape[1], device=probs.device)
        keep_sorted = ranks[None, :] < info.top_ks[:, None]
        if info.need_top_p:
            kept = sorted_probs * keep_sorted
            cumulative = torch.cumsum(kept, dim=-1)
            mass_before = cumulative - kept
            top_ps = info.top_ps[:, None]
            # Compare against top_p * (top-k mass) == top-p on the renormalised top-k distribution.
            # The most probable token is always kept: a top_p that underflows fp32 keeps it alone.
            within = (mass_before < top_ps * cumulative[:, -1:]) | (top_ps >= 1.0)
            keep_sorted = keep_sorted & (within | (ranks[None, :] == 0))
        keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
    if info.need_min_p:
        threshold = probs.amax(dim=-1, keepdim=True) * info.min_ps[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by the fixed-point inverse CDF; never a zero-mass token.

    The masses become integers (`to_fixed_point`) and the token is the first whose integer CDF
    exceeds `uniform * total` (`sample_inverse_cdf_ref`): the same function the acceptance kernel
    implements, so a draw never depends on the device or on a float summation order.

    Args:
        probs: [B, V] fp32, non-negative (need not sum to 1; negative and NaN entries count as 0).
        uniforms: [B] fp32 in [0, 1).

    Returns:
        [B] int64 in [0, V) (0 for a row without mass).
    """
    # NaN would turn into an arbitrary integer mass (and a token past the vocabulary).
    masses = torch.nan_to_num(probs.float(), nan=0.0, posinf=0.0).clamp(min=0.0)
    return sample_inverse_cdf_ref(to_fixed_point(masses), uniforms)


class SamplerOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: torch.Tensor  # [B] fp32, log_softmax(logits / temperature) at the token


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


def greedy_argmax_impl(kernels: KernelChoice) -> Callable[[torch.Tensor], torch.Tensor]:
    """Greedy ids `[B]` int64 of logits `[B, V]` for the "sampling" family.

    torch: `torch.argmax`; triton: `vocab_argmax` (the split-vocabulary argmax kernel), equal to
    `torch.argmax` including ties (first index) and NaN rows.
    """
    if kernels.of("sampling") == "torch":
        return _torch_argmax
    # Imported only when chosen: the torch path never loads Triton.
    from sgl_dspark.kernels.sampling.vocab_argmax import vocab_argmax

    return vocab_argmax


def greedy_pick_impl(
    kernels: KernelChoice,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Greedy ids `[B]` int64 and their logprobs `[B]` fp32 (`log_softmax` at the ids) of
    logits `[B, V]` for the "sampling" family.

    torch: `torch.argmax` and `log_softmax` at the ids. triton: `vocab_greedy_logprobs`, whose
    argmax launches also sum the row's exponentials (the ids bit for bit, the logprobs within
    fp32 rounding; no softmax launch reads the logits again), except under batch invariance:
    its chunking, fixed by the batch size, would move a logprob's last bits with the batch,
    so there `vocab_argmax` and torch's `log_softmax`.
    """
    if kernels.of("sampling") == "torch" or kernels.batch_invariant:
        argmax = greedy_argmax_impl(kernels)

        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids = argmax(logits)
            return ids, token_logprobs(logits, ids)

        return pick
    from sgl_dspark.kernels.sampling.vocab_argmax import vocab_greedy_logprobs

    return vocab_greedy_logprobs


class Sampler(nn.Module):
    """Samples one token per logits row (semantics in the module doc). Stateless.

    `kernels` picks the greedy argmax implementation ("sampling" family) once, here.
    """

    def __init__(self, kernels: KernelChoice | None = None) -> None:
        super().__init__()
        kernels = kernels or KernelChoice()
        self.greedy_argmax = greedy_argmax_impl(kernels)
        self.greedy_pick = greedy_pick_impl(kernels)

    def forward(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        """Args: logits [B, V] fp32 (V == info.vocab_size). Returns `SamplerOutput`."""
        assert logits.dim() == 2 and tuple(logits.shape) == (info.batch_size, info.vocab_size), (
            tuple(logits.shape),
            info.batch_size,
            info.vocab_size,
        )
        assert logits.dtype == torch.float32, logits.dtype
        if info.all_greedy:
            return SamplerOutput(*self.greedy_pick(logits))
        greedy_ids = self.greedy_argmax(logits)
        uniforms = info.uniforms(SAMPLER_STREAM)
        sampled_ids = sample_from_probs(processed_probs(logits, info), uniforms)
        next_ids = torch.where(info.is_greedy, greedy_ids, sampled_ids)
        return SamplerOutput(
            next_ids, token_logprobs(logits / info.temperatures[:, None], next_ids)
        )


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B] fp32 log_softmax of logits [B, V] at ids [B]."""
    # log_softmax is one kernel where logsumexp decomposes into ~8 (a decode step's tail)
    return torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).squeeze(1)
