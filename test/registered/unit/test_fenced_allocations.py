"""The opt-in allocation fence of the kernel tests (`fenced_allocations.py`): a fenced tensor
keeps its values and is followed by NaN, and a read one element past its end (what an unmasked
load past a row does in the interpreter) sees the NaN."""

from __future__ import annotations

import torch
from fenced_allocations import FENCE, fence


def test_fenced_tensor_keeps_its_values_and_is_followed_by_nan():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    got = fence(x)
    assert torch.equal(got, x) and got.is_contiguous() and got.shape == x.shape
    storage = torch.empty(0).set_(got.untyped_storage()).view(-1)  # the whole buffer, as float32
    assert storage.numel() == x.numel() + FENCE
    assert torch.isnan(storage[x.numel() :]).all()
    past_the_end = got.flatten().as_strided((1,), (1,), x.numel())
    assert torch.isnan(past_the_end).all()


def test_tensors_that_cannot_be_fenced_are_returned_as_they_are():
    ints = torch.arange(6)
    strided = torch.randn(4, 4).t()
    scalar = torch.tensor(1.5)
    for t in (ints, strided, scalar):
        assert fence(t) is t
