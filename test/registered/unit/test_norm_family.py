"""The "norm" kernel family wired into the model: what each choice binds (the torch path is the
kernel's reference, `rms_norm_ref`, itself), the RMSNorm module against it, the state-dict keys, and the tiny model end to end (`norm=triton` gives torch's greedy tokens over 30 decode
steps in fp32).

The Triton RMSNorm is within a tolerance of the reference (another fp32 summation order for the
mean square, see test_rmsnorm.py), so the end-to-end check compares greedy tokens plus a loose logprob bound.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.norm import RMSNorm, rms_norm_impl
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.tiny import tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
TORCH, TRITON = KernelChoice("torch"), KernelChoice("torch", (("norm", "triton"),))


def test_choice_binds_implementations() -> None:
    assert rms_norm_impl(TORCH) is rms_norm_ref
    assert rms_norm_impl(KernelChoice("triton", (("norm", "torch"),))) is rms_norm_ref
    assert rms_norm_impl(TRITON) is not rms_norm_ref
    assert KernelChoice("triton").of("norm") == "triton"
    assert KernelChoice.parse("torch", "norm=triton") == TRITON
    with pytest.raises(ValueError, match="norm='cuda'"):
        KernelChoice.parse("torch", "norm=cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_module_equals_kernel_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for shape in [(7, 100), (5, 4, 64), (1, 1024)]:
        x = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE)
        module = RMSNorm(shape[-1], 1e-6).to(DEVICE)
        module.weight.data.copy_(w)
        assert torch.equal(module(x), rms_norm_ref(x, w, 1e-6))


def test_triton_binding_normalises_like_torch() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 4, 64, generator=gen).to(DEVICE)
    w = (1 + 0.3 * torch.randn(64, generator=gen)).to(DEVICE)
    fused = rms_norm_impl(TRITON)
    for weight in (w, None):
        torch.testing.assert_close(
            fused(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), rtol=1e-6, atol=1e-30
        )
    # Non-contiguous input (a transposed view) is made contiguous by the binding.
    xt = torch.randn(64, 9, generator=gen).to(DEVICE).t()
    torch.testing.assert_close(fused(xt, w, 1e-6), rms_norm_ref(xt, w, 1e-6), rtol=1e-6, atol=1e-30)


def test_model_binds_the_family_and_keeps_parameter_names() -> None:
    cfg = tiny_config()
    torch_model = DeepseekV4ForCausalLM(cfg, TORCH)
    triton_model = DeepseekV4ForCausalLM(cfg, TRITON)
    assert torch_model.state_dict().keys() == triton_model.state_dict().keys()
    assert "model.layers.0.self_attn.q_a_norm.weight" in torch_model.state_dict()
    assert "model.layers.0.self_attn.kv_norm.weight" in torch_model.state_dict()
    assert "model.norm.weight" in torch_model.state_dict()
    assert torch_model.rms_norm is rms_norm_ref and triton_model.rms_norm is not rms_norm_ref
    for layer in torch_model.model.layers:
        assert layer.self_attn.rms_norm is rms_norm_ref
    for layer in triton_model.model.layers:
        assert layer.self_attn.rms_norm is not rms_norm_ref


def _generate(**kw) -> tuple[list[list[int]], list[list[float]], Engine]:
    engine = Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        device=DEVICE,
        dtype="float32",
        context_length=128,
        **kw,
    )
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(40, 134, (n,), generator=gen).tolist() for n in (3, 11, 20)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 30}
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    tokens = [o["output_ids"] for o in outs]
    logprobs = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return tokens, logprobs, engine


def test_tiny_model_greedy_tokens_match_torch() -> None:
    want_tokens, want_lp, base = _generate(kernel_backend="torch")
    got_tokens, got_lp, engine = _generate(
        kernel_backend="torch", kernel_backend_overrides="norm=triton"
    )
    assert base.runner.model.rms_norm is rms_norm_ref
    assert engine.runner.model.rms_norm is not rms_norm_ref
    assert engine.runner.model.model.layers[0].self_attn.rms_norm is not rms_norm_ref
    assert all(len(seq) == 30 for seq in want_tokens)
    assert len({t for seq in want_tokens for t in seq}) > 5  # not a degenerate repetition
    assert got_tokens == want_tokens
    torch.testing.assert_close(
        torch.tensor(got_lp), torch.tensor(want_lp), rtol=1e-4, atol=1e-4
    )  # fp32, reordered sums in every norm
    base.shutdown()
    engine.shutdown()
