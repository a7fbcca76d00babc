"""The greedy token's logprob in the argmax launches (`vocab_greedy_logprobs`) against
`greedy_logprobs_ref` (torch.argmax and log_softmax at it): the ids exact (ties, NaN), the
logprobs within fp32 rounding (another order of the sum of exponentials, Triton's exp / log),
NaN exactly where log_softmax gives NaN (a row with a NaN, a +inf, or only -inf), over forced
chunkings that put the row's maximum, -inf runs and empty chunks on chunk boundaries."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.sampling.reference import greedy_logprobs_ref
from sgl_dspark.kernels.sampling.vocab_argmax import vocab_greedy_logprobs
from test_vocab_argmax import DEVICE, _random_logits

# The interpreter's numpy warns where the kernel's exp overflows or a log sees 0, on the rows
# whose results the kernel then sets to NaN or whose terms it drops (what the tests check).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _check(logits: torch.Tensor, num_chunks: int | None = None) -> None:
    ids, logprobs = vocab_greedy_logprobs(logits, num_chunks=num_chunks)
    want_ids, want = greedy_logprobs_ref(logits)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(logprobs), nan)
    torch.testing.assert_close(logprobs[~nan], want[~nan], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "rows,width,dtype,mode,num_chunks",
    [
        (1, 5, torch.float32, "randn", None),
        (1, 129280, torch.float32, "randn", None),  # V4's vocabulary at one row: 253 chunks
        (3, 4099, torch.bfloat16, "randn", None),
        (4, 1000, torch.float32, "ties", 7),
        (5, 3000, torch.float32, "nan", 4),
        (6, 2048, torch.float32, "inf", 3),
        (2, 37, torch.float32, "randn", 64),  # more chunks than columns: empty chunks
        (9, 777, torch.float16, "randn", 1),  # one chunk: the first launch writes both
    ],
)
def test_ids_exact_and_logprobs_within_rounding(
    rows: int, width: int, dtype: torch.dtype, mode: str, num_chunks: int | None
) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    _check(_random_logits(rows, width, dtype, gen, mode), num_chunks)


def test_rows_whose_max_is_not_finite_and_far_from_zero() -> None:
    """A NaN, a +inf, only -inf (NaN logprobs, as log_softmax); a row whose max is -200 with a
    whole chunk of -inf (that chunk adds exactly 0, though exp(0 - max) overflows); a row of
    large magnitudes; a single-column chunk holding the maximum."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 2000, generator=gen) * 2
    x[0, 1999] = float("nan")
    x[1, :] = float("-inf")
    x[2, 3] = float("inf")
    x[3, :] = -200.0 + torch.randn(2000, generator=gen)
    x[3, :1000] = float("-inf")
    x[4] *= 1e4
    x[5, 1500] = 50.0
    for chunks in (None, 2, 4):
        _check(x.to(DEVICE), chunks)
    narrow = x[:, 1480:1520].contiguous()  # one column a chunk
    _check(narrow.to(DEVICE), narrow.shape[1])


def test_empty_batch_and_bad_input() -> None:
    ids, logprobs = vocab_greedy_logprobs(torch.zeros(0, 9, device=DEVICE))
    assert ids.shape == (0,) and logprobs.shape == (0,)
    with pytest.raises(ValueError, match="logits"):
        vocab_greedy_logprobs(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="logits"):
        vocab_greedy_logprobs(torch.zeros(2, 8, 2, device=DEVICE)[..., 0])
