"""Each hooked SGLang function gives SGLang's values on CPU-runnable inputs.

The hooks are installed through SGLang's HookRegistry (as ``--enable-dspark-*`` does), and the
hooked function is called by its SGLang name. Where SGLang's own implementation runs on CPU it
is the reference (its original, under the hook); where it needs a GPU (CUDA JIT, TileLang), the
reference is SGLang's torch path for the same op (named in each test). A hook that hands a call
back to SGLang would make these comparisons vacuous, so `decline` raises here."""

from __future__ import annotations

import importlib
import inspect
import types

import pytest
import torch
from sgl_dspark_plugin import plugin
from sgl_dspark_plugin.hooks import HOOKS, _common

SHAPES = [(1, 64), (3, 200), (8, 1000), (37, 4099)]


class Declined(AssertionError):
    pass


@pytest.fixture(scope="module", autouse=True)
def hooks_installed():
    plugin.install([spec.name for spec in HOOKS], apply_now=True)


@pytest.fixture(autouse=True)
def decline_fails(monkeypatch):
    def fail(hook, reason):
        raise Declined(f"{hook} handed the call to SGLang: {reason}")

    monkeypatch.setattr(_common, "decline", fail)
    for module in ("activation", "argmax", "mhc", "moe_reduce", "router", "verify_budget"):
        monkeypatch.setattr(f"sgl_dspark_plugin.hooks.{module}.decline", fail)


def _attr(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.contiguous().view(torch.int16).to(torch.int32)
    ib = b.contiguous().view(torch.int16).to(torch.int32)
    return int((ia - ib).abs().max()) if a.numel() else 0


# ---- greedy argmax ------------------------------------------------------------------------


@pytest.mark.parametrize("rows, vocab", SHAPES + [(5, 129280 // 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_equals_sglang(rows, vocab, dtype):
    hooked = _attr("sglang.kernels.ops.speculative.dspark.dspark_accept._row_argmax")
    original = inspect.unwrap(hooked)
    gen = torch.Generator().manual_seed(rows * 7919 + vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    if rows > 2:  # a tie (lower index wins), a NaN (wins), an all -inf row (index 0)
        logits[0, vocab // 3] = logits[0, vocab // 2] = 100.0
        logits[1, vocab - 1] = float("nan")
        logits[2] = float("-inf")
    got = hooked(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, original(logits)), "SGLang's default path is torch.argmax"
    assert torch.equal(got, torch.argmax(logits, dim=-1))


# ---- SiLU-mul-clamp ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows, width", [(1, 128), (4, 1024), (9, 4096), (33, 262)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_clamp_equals_sglang_torch_path(rows, width, dtype):
    from sglang.srt.layers.quantization.expert_pack import _clamped_swiglu

    hooked = _attr("sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp")
    limit = 10.0
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, width, generator=gen) * 8).to(dtype)
    output = torch.full((rows, width // 2), float("nan"), dtype=dtype)
    assert hooked(gate_up, output, limit) is None
    inter = width // 2
    # SGLang's CPU path of the same op (the CUDA kernel needs a GPU): clamp, F.silu(g) * u.
    want = _clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)
    assert not torch.isnan(output).any()
    if dtype == torch.float32:
        torch.testing.assert_close(output, want, rtol=2e-6, atol=1e-6)
    else:  # SGLang's torch path rounds silu(g) to bf16 before the product: double rounding
        exact = (
            torch.nn.functional.silu(gate_up[:, :inter].float().clamp(max=limit))
            * gate_up[:, inter:].float().clamp(-limit, limit)
        ).to(dtype)
        assert _bf16_ulps(output, exact) <= 1
        torch.testing.assert_close(output.float(), want.float(), rtol=1.6e-2, atol=1e-5)
    clamped = gate_up[:, :inter].float() > limit
    assert clamped.any(), "inputs must exercise the clamp"


# ---- MoE route-reduce epilogue ------------------------------------------------------------


@pytest.mark.parametrize("tokens, topk, hidden", [(1, 6, 256), (5, 6, 1000), (32, 8, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 2.5, None])
def test_moe_route_reduce_equals_sglang(tokens, topk, hidden, dtype, scale):
    hooked = _attr("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.moe_combine_topk")
    original = inspect.unwrap(hooked)
    gen = torch.Generator().manual_seed(tokens * 31 + topk)
    cache3 = torch.randn(tokens, topk, hidden, generator=gen).to(dtype)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    got = hooked(cache3, out, scale)
    assert got is out and not torch.isnan(out).any()
    # SGLang's CPU path is its Triton moe_sum_reduce (interpreted here) when vllm is absent.
    want = original(cache3.clone(), torch.empty_like(out), scale)
    if dtype == torch.float32:  # two fp32 summation orders: a few ulps of the terms' magnitude
        magnitude = float(cache3.abs().sum(1).max()) * (1.0 if scale is None else scale)
        bound = 2 * topk * torch.finfo(torch.float32).eps * magnitude
        torch.testing.assert_close(out, want, rtol=0, atol=bound)
    else:
        assert _bf16_ulps(out, want) <= 1
    exact = (cache3.double().sum(1) * (1.0 if scale is None else scale)).to(dtype)
    torch.testing.assert_close(out.float(), exact.float(), rtol=1.6e-2, atol=1e-3)


# ---- router gate with pad fill ------------------------------------------------------------


def _sglang_gate_reference(logits, bias, topk, renormalize, scale, apply_scale, n_valid):
    """SGLang's torch gate and its padded-row fill (what its CUDA fused gate does in one
    launch: zero weights and id -1 past ``num_token_non_padded``)."""
    from sglang.srt.layers.moe import topk as sglang_topk

    weights, ids = sglang_topk.biased_topk_impl(
        logits,
        logits,
        bias,
        topk,
        renormalize,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=scale,
        apply_routed_scaling_factor_on_output=apply_scale,
    )
    sglang_topk._mask_topk_ids_padded_region(ids, n_valid, -1)
    sglang_topk._zero_topk_weights_padded_region(weights, n_valid)
    return weights, ids


def _by_expert(weights, ids):
    order = torch.argsort(ids.long(), dim=1, stable=True)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("tokens, experts, topk", [(1, 64, 6), (7, 384, 6), (20, 256, 8)])
@pytest.mark.parametrize("renormalize, apply_scale", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("padded", [0, 3])
def test_router_gate_equals_sglang(
    monkeypatch, tokens, experts, topk, renormalize, apply_scale, padded
):
    from sglang.srt.layers.moe import topk as sglang_topk

    # SGLang masks padded rows inside its gate on CUDA; this CPU run takes the same branch.
    monkeypatch.setattr(sglang_topk, "_fused_gate_masks_padded_rows", lambda s: s == "sqrtsoftplus")
    hooked = _attr("sglang.srt.layers.moe.topk.biased_topk_jit_kernel_impl")
    gen = torch.Generator().manual_seed(tokens * 13 + experts)
    logits = torch.randn(tokens, experts, generator=gen) * 3
    bias = (torch.randn(experts, generator=gen) * 0.1).to(torch.bfloat16)
    n_valid = torch.tensor([max(tokens - padded, 0)], dtype=torch.int32) if padded else None
    scale = 1.5
    weights, ids = hooked(
        logits,
        logits,
        bias,
        topk,
        renormalize,
        "sqrtsoftplus",
        num_token_non_padded=n_valid,
        routed_scaling_factor=scale,
        apply_routed_scaling_factor_on_output=apply_scale,
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    want_w, want_ids = _sglang_gate_reference(
        logits, bias.float(), topk, renormalize, scale, apply_scale, n_valid
    )
    got_w, got_ids = _by_expert(weights, ids)
    want_w, want_ids = _by_expert(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=1e-7)
    if padded:
        assert (ids[tokens - padded :] == -1).all() and (weights[tokens - padded :] == 0).all()


# ---- mHC boundary ---------------------------------------------------------------------------


def _mhc_case(rows, mult, hidden, dtype, seed):
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.models.deepseek_v4_boundary import HcReadCall, HcUpdate, ReadState

    gen = torch.Generator().manual_seed(seed)
    eps = 1e-6
    layer = types.SimpleNamespace(
        boundary_pre_from_prev=False,
        hc_eps=1e-6,
        hc_sinkhorn_iters=20,
        rms_norm_eps=eps,
        hc_mult=mult,
        hc_attn_fn=torch.randn((2 + mult) * mult, mult * hidden, generator=gen) * 0.05,
        hc_attn_scale=torch.rand(3, generator=gen) + 0.5,
        hc_attn_base=torch.randn((2 + mult) * mult, generator=gen) * 0.3,
    )
    read = HcReadCall.__new__(HcReadCall)
    read.layer, read.attention, read.call, read.batch = layer, True, None, None
    update = HcUpdate(layer, attention=False)
    norm = RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    streams = torch.randn(rows, mult, hidden, generator=gen).to(dtype)
    post = torch.rand(rows, mult, generator=gen) * 2
    comb = torch.softmax(torch.randn(rows, mult, mult, generator=gen), dim=-1)
    y = torch.randn(rows, hidden, generator=gen).to(dtype)
    return read, update, y, ReadState(streams, post, comb), norm, layer


@pytest.mark.parametrize("rows, mult, hidden", [(1, 4, 64), (5, 4, 256), (17, 2, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_boundary_equals_sglang_torch_chain(rows, mult, hidden, dtype):
    from sglang.kernels.ops.layernorm.mhc import _mhc_post_torch, _mhc_pre_torch

    hooked = _attr("sglang.srt.models.deepseek_v4_boundary.HcReadCall").update_and_read
    read, update, y, state, norm, layer = _mhc_case(rows, mult, hidden, dtype, rows * mult)
    x, new_state = hooked(read, update, y, state, norm)
    # SGLang's torch chain for the same boundary (hc_post, then hc_pre's torch mix + Sinkhorn +
    # collapse, then the RMSNorm's native path): its hc_pre needs TileLang on a GPU.
    streams = _mhc_post_torch(y, state.streams, state.post.unsqueeze(-1), state.comb)
    post2, comb2, collapsed = _mhc_pre_torch(
        streams,
        layer.hc_attn_fn,
        layer.hc_attn_scale,
        layer.hc_attn_base,
        layer.rms_norm_eps,
        layer.hc_eps,
        layer.hc_eps,
        2.0,
        layer.hc_sinkhorn_iters,
    )
    want_x = norm.forward_native(collapsed)
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_state.streams, streams, **tol)
        torch.testing.assert_close(x, want_x, **tol)
    else:
        assert _bf16_ulps(new_state.streams, streams) <= 1
        torch.testing.assert_close(x.float(), want_x.float(), rtol=2e-2, atol=2e-2)
        tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new_state.post, post2.squeeze(-1), **tol)
    torch.testing.assert_close(new_state.comb, comb2, **tol)
    assert new_state.quantized is None


# ---- verify budget ----------------------------------------------------------------------------


def _tables():
    from sglang.srt.speculative.dspark_components.dspark_sps import (
        SpsAdditiveCostTable,
        SpsCostTable,
    )

    return [
        SpsCostTable(
            sample_batch_tokens=[1, 8, 16, 32, 64, 128],
            sample_steps_per_sec=[900.0, 860.0, 700.0, 520.0, 300.0, 170.0],
            max_batch_tokens=128,
        ),
        SpsAdditiveCostTable(
            bias_seconds=4e-4,
            bs_probes=[1, 4, 16, 64],
            alpha_seconds=[1e-5, 4e-5, 2e-4, 9e-4],
            m_probes=[1, 16, 64, 256],
            theta_seconds=[2e-5, 2e-4, 1.1e-3, 4.5e-3],
        ),
    ]


@pytest.mark.parametrize("table", _tables(), ids=["diagonal", "additive"])
@pytest.mark.parametrize("requests, gamma", [(1, 5), (6, 7), (24, 5)])
def test_verify_budget_equals_sglang(table, requests, gamma):
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig

    hooked = _attr(
        "sglang.srt.speculative.dspark_components.dspark_planner.compute_verify_token_budget"
    )
    original = inspect.unwrap(hooked)
    gen = torch.Generator().manual_seed(requests * 100 + gamma)
    confidence = torch.rand(requests, gamma, generator=gen) ** 0.3
    survival = torch.cumprod(confidence, dim=1)
    survival[0, -1] = 1e-9  # below the eps: never a candidate
    cfg = DSparkScheduleConfig(gamma=gamma)
    got = hooked(history_survival_probs=survival, sps_table=table, cfg=cfg)
    want = original(history_survival_probs=survival, sps_table=table, cfg=cfg)
    assert got.budget == want.budget
    assert got.predicted_theta == pytest.approx(want.predicted_theta, rel=1e-12)
    assert got.predicted_step_seconds == pytest.approx(want.predicted_step_seconds, rel=1e-12)
