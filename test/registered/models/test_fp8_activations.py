"""FP8 activations (`--fp8-activations on`) on a tiny DeepSeek-V4 saved quantised as released
(dense FP8 with 32 x 32 blocks and `scale_fmt: ue8m0`, routed experts MXFP4): a prefill of more
rows than the decode-size kernels take runs the W8A8 GEMMs, reading the FP8 form the mHC
boundary and the SiLU-mul-clamp epilogue wrote.

The reference is the same native model with FP8 activations off and every FP8 projection of
those rows fed `dequantize(quantize_act_fp8_ref(x))` (the same activation quantisation, applied
in torch before the per-call dequantised GEMM): the logits agree to fp32 summation order
(LOGITS_TOL relative to their spread) and the greedy tokens are equal. Against the model with
exact activations the logits move by E4M3's rounding amplified through routing (a tiny random
model flips top-k choices): that comparison is the kernels' (`test_fp8_gemm.py`, with a derived
bound per GEMM). On CPU the kernels run in the Triton interpreter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_utils import Driver
from sgl_dspark.kernels.fp8 import act_quant, w8a8
from sgl_dspark.kernels.fp8.reference import (
    Fp8ActFormat,
    dequantize_act_fp8_ref,
    quantize_act_fp8_ref,
)
from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardMode
from sgl_dspark.srt.layers import fp8_linear, fused_linear
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
from sgl_dspark.srt.model_loader.loader import CheckpointWeights
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG
from test_native_weights import _save, pytestmark  # noqa: F401

LOGITS_TOL = dict(rtol=1e-4, atol=1e-4)
FMT = Fp8ActFormat(32, True)  # the checkpoint's weight block along K, ue8m0 scales
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(20)]  # 20 rows: above the decode-size kernels
# Two layers (a sliding and a CSA one) keep the interpreter's time down.
TWO_LAYERS = {
    **TINY_HF_CONFIG,
    "num_hidden_layers": 2,
    "layer_types": TINY_HF_CONFIG["layer_types"][:2],
    "mlp_layer_types": TINY_HF_CONFIG["mlp_layer_types"][:2],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("fp8act"), "fp4", TWO_LAYERS)


def _runner(path: Path, fp8: str) -> ModelRunner:
    cfg = ModelConfig.from_pretrained(str(path))
    rc = RunnerConfig(
        max_total_tokens=256,
        max_running_requests=1,
        context_length=32,
        kernel_backend_overrides="linear=triton,moe=triton,mhc=triton",
        weight_format="native",
        fp8_activations=fp8,
    )
    return ModelRunner(cfg, rc, weights=CheckpointWeights(str(path), cfg))


def _prefill(runner: ModelRunner) -> torch.Tensor:
    driver = Driver(runner)
    return driver.step(ForwardMode.EXTEND, [(driver.new_request(), PROMPT)])[0]


def _fake_quant_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8-off model's GEMMs on FP8 weights above decode sizes see their inputs quantised
    and dequantised as the W8A8 path quantises them."""

    def fake_quant(x: torch.Tensor, weight: object) -> torch.Tensor:
        wide = x.numel() // x.shape[-1] > fp8_linear.Fp8Linear(FMT).max_m
        if isinstance(weight, QuantizedWeight) and weight.fmt == "fp8" and wide:
            act = quantize_act_fp8_ref(x, FMT.group, FMT.ue8m0)
            return dequantize_act_fp8_ref(act, FMT.group).to(x.dtype)
        return x

    linear, grouped = (
        fused_linear._wide_quantized_linear,
        fused_linear._wide_quantized_grouped_linear,
    )
    monkeypatch.setattr(
        fused_linear, "_wide_quantized_linear", lambda x, w: linear(fake_quant(x, w), w)
    )
    monkeypatch.setattr(
        fused_linear, "_wide_quantized_grouped_linear", lambda x, w: grouped(fake_quant(x, w), w)
    )


def test_w8a8_model_equals_the_same_activation_quantisation_in_torch(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"gemm": 0, "quantize": 0, "attached": 0}

    def counting(name: str, fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            if name != "attached" or result is not None:
                calls[name] += 1
            return result

        return wrapped

    with monkeypatch.context() as patch:
        patch.setattr(w8a8, "w8a8_linear", counting("gemm", w8a8.w8a8_linear))
        patch.setattr(w8a8, "w8a8_grouped_linear", counting("gemm", w8a8.w8a8_grouped_linear))
        patch.setattr(
            act_quant, "quantize_act_fp8", counting("quantize", act_quant.quantize_act_fp8)
        )
        patch.setattr(fp8_linear, "attached_fp8", counting("attached", fp8_linear.attached_fp8))
        # Built under the patches: the model's FP8 linears keep the quantiser they were built
        # with.
        on = _runner(checkpoint, "on")
        assert on.kernels.fp8_activations == FMT and not on.kernels.mx_moe_block  # no MX on CPU
        logits_on = _prefill(on)
    # The W8A8 GEMMs ran; the attention input and the shared expert's gate-up read the mHC
    # boundary's FP8 form, the shared expert's down projection the SiLU epilogue's: fewer
    # quantiser launches than GEMMs.
    assert calls["gemm"] > 0 and calls["attached"] > 0
    assert 0 < calls["quantize"] < calls["gemm"], calls
    _fake_quant_inputs(monkeypatch)
    off = _runner(checkpoint, "off")
    assert off.kernels.fp8_activations is None
    logits_ref = _prefill(off)
    scale = logits_ref.float().std()
    torch.testing.assert_close(logits_on / scale, logits_ref / scale, **LOGITS_TOL)
    assert torch.equal(logits_on.argmax(-1), logits_ref.argmax(-1))
