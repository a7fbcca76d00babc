"""The DSpark draft's context-KV write (the runner's tap hook) against the unfused composition it
replaces, and the draft's rope table against per-forward cos/sin.

`write_context_kv` stores, per stage, rope(kv_norm(kv_proj(main_norm(main_proj(F))))) at the
given slots in one rope launch per stage (the norm and the scatter inside it on Triton). The
torch kernels are the composition itself (bit for bit); the Triton path is inexact (its small-M GEMM
and the norm's reduction order), so it is compared with a tolerance. Pool rows outside the slots
are poisoned and must stay untouched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.rotary import apply_rope_tail, rope_cos_sin
from sgl_dspark.srt.model_executor.model_runner import load_weights
from sgl_dspark.srt.models.deepseek_v4 import stream_means
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, tiny_weights

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _draft(kernel_backend: str, seed: int = 5) -> DSparkDraftModel:
    target = ModelConfig.from_hf_dict(TINY_HF_CONFIG)
    raw = {
        **TINY_HF_CONFIG,
        "dspark_block_size": 4,
        "dspark_markov_rank": 8,
        "dspark_noise_token_id": 3,
        "dspark_target_layer_ids": [1, 3, 4],
    }
    dcfg = DSparkConfig.from_dict(raw, target)
    model = DSparkDraftModel(dcfg, KernelChoice(kernel_backend))
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    load_weights(model, tiny_weights(dcfg.stage_config, shapes, seed=seed))
    return model.to(DEVICE).eval()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_context_kv_store_equals_unfused(kernel_backend: str, rows: int) -> None:
    draft = _draft(kernel_backend)
    gen = torch.Generator().manual_seed(rows)
    d, dh = draft.cfg.hidden_size, draft.cfg.head_dim
    num_slots = rows + 11
    feats = torch.randn(rows, draft.dcfg.num_stages * d, generator=gen).to(DEVICE)
    positions = torch.randint(0, 300, (rows,), generator=gen).to(DEVICE)
    slots = (torch.randperm(num_slots - 1, generator=gen)[:rows] + 1).to(DEVICE)
    pools = [
        torch.full((num_slots, dh), float("nan"), device=DEVICE)
        for _ in range(draft.dcfg.num_stages)
    ]
    with torch.no_grad():
        draft.write_context_kv(feats, positions, pools, slots)
        main_x = _rms(
            F.linear(feats, draft.main_proj.weight), draft.main_norm.weight, draft.main_norm.eps
        )
        cos, sin = rope_cos_sin(positions, draft.inv_freq)
        untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        for stage, pool in zip(draft.model.layers, pools, strict=True):
            attn = stage.self_attn
            want = apply_rope_tail(
                _rms(F.linear(main_x, attn.kv_proj.weight), attn.kv_norm.weight, attn.kv_norm.eps),
                cos,
                sin,
            )
            got = pool[slots]
            if kernel_backend == "torch":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.isnan(pool[untouched]).all()


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_rope_table_gives_the_computed_bits(kernel_backend: str) -> None:
    """The table (built before any capture) changes launches, not bits: the block forward and
    the context-KV write equal the per-forward cos/sin path exactly."""
    computed, tabled = _draft(kernel_backend), _draft(kernel_backend)
    tabled.build_rope_table(320)
    gen = torch.Generator().manual_seed(3)
    cfg = computed.cfg
    rows, num_slots = 40, 64
    feats = torch.randn(rows, computed.dcfg.num_stages * cfg.hidden_size, generator=gen)
    positions = torch.arange(rows) + 250
    slots = torch.randperm(num_slots - 1, generator=gen)[:rows] + 1
    ctx_slots = slots[:32].view(2, 16)
    # Block rows past the context's end, as the last block of a full context has.
    block_pos = torch.tensor([[290], [316]]) + torch.arange(4)
    embeds = torch.randn(2, 4, cfg.hidden_size, generator=gen)
    args = [t.to(DEVICE) for t in (feats, positions, slots, ctx_slots, block_pos, embeds)]
    feats, positions, slots, ctx_slots, block_pos, embeds = args
    ctx_valid = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
    out = {}
    for name, draft in (("computed", computed), ("tabled", tabled)):
        pools = [
            torch.zeros(num_slots, cfg.head_dim, device=DEVICE)
            for _ in range(draft.dcfg.num_stages)
        ]
        with torch.no_grad():
            draft.write_context_kv(feats, positions, pools, slots)
            out[name] = [*pools, *draft(embeds, block_pos, pools, ctx_slots, ctx_valid)]
    assert all(torch.equal(a, b) for a, b in zip(out["computed"], out["tabled"], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_stream_means_equal_per_layer_means(dtype: torch.dtype) -> None:
    """The hook's features (one stack and one mean over every tap layer's streams) are the
    per-layer `hidden_taps` side by side, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    taps = [torch.randn(9, 4, 32, generator=gen).to(dtype) for _ in range(3)]
    stacked = stream_means(torch.stack(taps, dim=1), dim=2).reshape(9, -1)
    assert torch.equal(stacked, torch.cat([stream_means(t) for t in taps], dim=-1))
