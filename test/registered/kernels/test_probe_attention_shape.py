"""`benchmark/kernels/probe_attention_shape.py`: the V4.1 decode attention over gathered keys with
its launch shape overridden, on the CPU interpreter at small widths, against the reference
(`sink_attention_ref`, then the inverse rope), for launch shapes that hold more heads a program,
wider key tiles and other warp counts than the library's, split and single pass, with masked
keys; the override is undone when its block ends, also on an error. The GPU runs the probe
itself, which checks every shape the same way before timing it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from sgl_dspark.kernels.attention import window_sparse  # noqa: E402
from sgl_dspark.srt.layers.attention import create_attention_backend  # noqa: E402

from benchmark.kernels import probe_attention_shape as probe  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="the interpreter form; GPUs run the probe"
    ),
]


@pytest.mark.parametrize("shape", [None, (16, 16, 8), (32, 16, 8), (16, 32, 8), (32, 32, 2)])
@pytest.mark.parametrize("batch_invariant", [False, True])  # split (few programs); one pass
def test_every_launch_shape_matches_the_reference(shape, batch_invariant):
    x = probe.layer_inputs(3, "cpu", seed=5, heads=32, head_dim=64)
    x["valid"][1, 100:] = False  # a token with a masked tail
    want = probe.reference(x)
    with probe.launch_shape(shape):
        got = probe.attend(x, create_attention_backend("triton", batch_invariant))
    assert got.shape == want.shape and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_override_is_undone():
    default = window_sparse._attention_meta
    with probe.launch_shape((32, 16, 8)):
        assert window_sparse._attention_meta(64, 512) == (32, 16, 8)
    assert window_sparse._attention_meta is default
    with pytest.raises(RuntimeError), probe.launch_shape((16, 16, 8)):
        raise RuntimeError("a failing variant")
    assert window_sparse._attention_meta is default
    assert default(64, 512) == (16, 16, 4)  # the library's shape at V4.1's heads
