"""Benchmark cases for the greedy Markov-head draft loop (``sgl_dspark.kernels.spec.markov``).

``CASES`` is a list of dicts with keys (the convention of ``run_all.py``):
    name         str
    make_inputs  (M, device) -> dict of keyword arguments
    reference    (**inputs) -> output   (``markov_sample`` without uniforms: every row greedy, the torch path)
    launcher     (**inputs) -> output   (``markov_greedy``: gamma + 1 launches, graph-capturable)
    check        (reference_output, launcher_output) -> None, raises AssertionError on mismatch
    bytes_moved  (M) -> int, the minimal HBM traffic (bandwidth floor)
    m_values     the batch sizes the case is meant for (``run_all.py`` may sweep its own list)
M is the batch size B (requests, one draft chain each). Shapes: the 910M benchmark model
(``mid_910m``: V = 32000, Markov rank r = 64 as ``tools/init_dspark_draft.py`` writes it) and
DeepSeek-V4-Flash (V = 129280, r = 256), both with gamma = 7, bf16 W1/W2 and
fp32 base logits (``compute_logits`` returns fp32).

Inputs plant a clear winner in every base-logit row (margin ~10 over the bias and the rest of
the row), so the kernel's reordered dot product cannot flip a draft: drafts and embeddings must
be equal, step logits equal up to one bf16 ulp of the bias.
"""

from __future__ import annotations

from typing import Any

import torch
from sgl_dspark.kernels.spec.markov import markov_greedy
from sgl_dspark.kernels.spec.reference import MarkovGreedyOutput
from sgl_dspark.srt.speculative.dspark.sampling import MarkovSampleOutput, markov_sample

GAMMA = 7
# name, vocab, markov rank
_MODELS = (("mid_910m", 32000, 64), ("dsv4_flash", 129280, 256))
_BASE_DTYPE = torch.float32
_WEIGHT_DTYPE = torch.bfloat16
_M_VALUES = (1, 4, 8, 32)


def _make_inputs(batch: int, device: str, vocab: int, rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4242 + batch)
    base = torch.randn(batch, GAMMA, vocab, generator=gen) * 2
    winners = torch.randint(0, vocab, (batch, GAMMA, 1), generator=gen)
    base.scatter_add_(2, winners, torch.full((batch, GAMMA, 1), 24.0))
    w1 = torch.randn(vocab, rank, generator=gen).to(_WEIGHT_DTYPE)
    w2 = (torch.randn(vocab, rank, generator=gen) / rank**0.5).to(_WEIGHT_DTYPE)  # bias ~ N(0,1)
    tensors = dict(
        base_logits=base.to(_BASE_DTYPE),
        w1=w1,
        w2=w2,
        anchors=torch.randint(0, vocab, (batch,), generator=gen),
        temperature=torch.ones(batch),
        greedy=torch.ones(batch, dtype=torch.bool),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def _reference(base_logits, w1, w2, anchors, temperature, greedy) -> MarkovSampleOutput:
    return markov_sample(base_logits, w1, w2, anchors, temperature, greedy)


def _launcher(base_logits, w1, w2, anchors, temperature, greedy) -> MarkovGreedyOutput:
    return markov_greedy(base_logits, w1, w2, anchors)


def _check(want: MarkovSampleOutput, got: MarkovGreedyOutput) -> None:
    assert torch.equal(want.drafts, got.drafts), "drafts differ"
    assert torch.equal(want.markov_embeds, got.embeds), "embeds differ"
    # Same chain, so only the bias rounding differs: one bf16 ulp (<= 2^-7 |bias|), and
    # |bias| <= |z| + |U| with |U| < 40 for these inputs.
    tol = 2.0**-7 * (want.step_logits.abs() + 40.0)
    diff = (want.step_logits - got.step_logits).abs()
    assert bool((diff <= tol).all()), f"step_logits differ by up to {diff.max().item():.3g}"


def _bytes(batch: int, vocab: int, rank: int) -> int:
    w2_elem = torch.tensor([], dtype=_WEIGHT_DTYPE).element_size()
    base_elem = torch.tensor([], dtype=_BASE_DTYPE).element_size()
    return GAMMA * (vocab * rank * w2_elem + batch * vocab * (base_elem + 4))


CASES = [
    {
        "name": f"markov_greedy_{model}_g{GAMMA}",
        "make_inputs": lambda m, device, v=vocab, r=rank: _make_inputs(m, device, v, r),
        "reference": _reference,
        "launcher": _launcher,
        "check": _check,
        "bytes_moved": lambda m, v=vocab, r=rank: _bytes(m, v, r),
        "m_values": _M_VALUES,
    }
    for model, vocab, rank in _MODELS
]
