"""DeepSeek-V4.1 weights kept as stored (`--weight-format native`) against the same checkpoint
dequantised at load (`--weight-format bf16`): a V4.1 fixture with Engram saved quantised as
released (FP8 32 x 32 projections, the output projections and `engram.wkv` among them; MXFP4
experts). The output projections and `engram.wkv` stay packed on the device; with the torch
kernels (which dequantise per call to the very weights the bf16 format loads) every logit is
the same bits, with the Triton linear kernels (the interpreter on CPU: they sum their fp32
partials per scale group) the same greedy tokens and logits within LOGITS_TOL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_utils import checkpoint_runner, greedy_logits
from sgl_dspark.srt.layers.quantized import is_quantized
from test_v41_checkpoint import C2, QUANT, _model_dir, _quantised

pytestmark = [  # the Triton interpreter's numpy calls (see test_moe_grouped_gemm.py)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
PROMPT = [5, 77, 19, 300, 4, 61]
LOGITS_TOL = dict(rtol=1e-4, atol=1e-4)  # fp32 activations, as test_native_weights.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    stored, _ = _quantised(C2, 32)
    return _model_dir(C2, tmp_path_factory.mktemp("v41_native"), stored, QUANT)


def test_released_fp8_projections_stay_packed(checkpoint: Path) -> None:
    native, dense = checkpoint_runner(checkpoint, "native"), checkpoint_runner(checkpoint, "bf16")
    layers = native.model.model.layers
    engram_layers = [layer for layer in layers if layer.engram is not None]
    assert engram_layers, "the fixture has an Engram layer"
    for layer in layers:
        for proj in (layer.self_attn.o_a_proj, layer.self_attn.o_b_proj):
            assert is_quantized(proj)
    for layer in engram_layers:
        assert is_quantized(layer.engram.wkv)
    assert not any(is_quantized(m) for m in dense.model.modules())
    for a, b in zip(greedy_logits(native, PROMPT, 2)[1], greedy_logits(dense, PROMPT, 2)[1]):
        assert torch.equal(a, b)


def test_triton_linears_on_packed_projections(checkpoint: Path) -> None:
    native = checkpoint_runner(checkpoint, "native", "linear=triton")
    dense = checkpoint_runner(checkpoint, "bf16", "linear=triton")
    (tokens_n, got), (tokens_d, want) = (
        greedy_logits(native, PROMPT, 2),
        greedy_logits(dense, PROMPT, 2),
    )
    assert tokens_n == tokens_d
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **LOGITS_TOL)
