"""DeepSeek-V4.1 weights kept as stored (`--weight-format native`) against the same checkpoint
dequantised at load (`--weight-format bf16`): a V4.1 fixture with Engram saved quantised as
released (FP8 32 x 32 projections, the output projections and `engram.wkv` among them; Engram
tables as FP8 rows scaled per 32 channels; MXFP4 experts). The output projections, `engram.wkv`
and the Engram tables stay packed on the device; with the torch kernels (which dequantise per
call to the very weights the bf16 format loads) every logit is the same bits, and so with the
Triton Engram gather (it decodes the selected rows exactly); with the Triton linear kernels (the
interpreter on CPU: they sum their fp32 partials per scale group) the same greedy tokens and
logits within LOGITS_TOL. The loader's row-chunked host copy of a table reads the same bytes as
one whole read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_utils import checkpoint_runner, greedy_logits
from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.srt.layers.quantized import is_quantized
from sgl_dspark.srt.model_executor.weights import host_copy_of
from sgl_dspark.srt.models.source import resolve_model
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
        assert is_quantized(layer.engram.embed)
        assert layer.engram.embed.weight.dtype == torch.float8_e4m3fn
    assert not any(is_quantized(m) for m in dense.model.modules())
    for a, b in zip(greedy_logits(native, PROMPT, 2)[1], greedy_logits(dense, PROMPT, 2)[1]):
        assert torch.equal(a, b)


def _native_against_bf16(checkpoint: Path, overrides: str) -> list[tuple[torch.Tensor, ...]]:
    """Greedy decoding of the checkpoint loaded native and bf16 with the kernel families
    `overrides`: the same tokens asserted, each step's (native, bf16) logits returned."""
    native = checkpoint_runner(checkpoint, "native", overrides)
    dense = checkpoint_runner(checkpoint, "bf16", overrides)
    (tokens_n, got), (tokens_d, want) = (
        greedy_logits(native, PROMPT, 2),
        greedy_logits(dense, PROMPT, 2),
    )
    assert tokens_n == tokens_d
    return list(zip(got, want))


def test_triton_linears_on_packed_projections(checkpoint: Path) -> None:
    for a, b in _native_against_bf16(checkpoint, "linear=triton"):
        torch.testing.assert_close(a, b, **LOGITS_TOL)


def test_triton_gather_on_packed_engram_tables(checkpoint: Path) -> None:
    for a, b in _native_against_bf16(checkpoint, "engram=triton"):
        assert torch.equal(a, b)


@pytest.mark.parametrize("packed", [True, False])
def test_host_copy_in_row_chunks_reads_the_whole_table(checkpoint: Path, packed: bool) -> None:
    _, weights = resolve_model(str(checkpoint), torch.float32)
    tables = 0
    for name, source in weights:  # read while the checkpoint's files are open
        if not name.endswith("engram.embed.weight"):
            continue
        tables += 1
        rows = source.shape[0]
        whole = host_copy_of(source, packed, torch.float32, pin=False)
        # Chunks of 128 rows (the smallest step): several of them.
        chunked = host_copy_of(source, packed, torch.float32, pin=False, chunk_bytes=1)
        assert rows >= 2 * 128, rows
        if packed:
            assert isinstance(whole, QuantizedWeight) and isinstance(chunked, QuantizedWeight)
            assert torch.equal(whole.data.view(torch.uint8), chunked.data.view(torch.uint8))
            assert torch.equal(whole.scale, chunked.scale)
        else:
            assert isinstance(whole, torch.Tensor) and isinstance(chunked, torch.Tensor)
            assert torch.equal(whole, chunked)
    assert tables
