"""MoE layers under expert parallelism on spawned gloo ranks (one world of 4 for the module).
The Triton path (the kernels' local-expert tables, under the Triton interpreter): `exact` gives
the bits of one rank, with the shared expert folded in as expert E (the GPU default) and
separate, on the per-token (few tokens) and the sorted paths; `fast` stays within rounding.
DeepSeek-V4.1's experts (route weight before the down projection, torch path) likewise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed import ParallelLayout, init_parallel_state, replicated
from sgl_dspark.srt.layers.moe import RoutedExperts
from sgl_dspark.srt.model_executor.model_runner import load_weights
from sgl_dspark.srt.models.deepseek_v4 import add_moe_and_mixers
from sgl_dspark.srt.models.tiny import tiny_config, tiny_weights
from torch import nn
from worlds import run_world

TOKENS = (3, 9)  # per-token path on one rank (<= 4 tokens) and the sorted path
LAYOUTS = {"ep1": (1, "exact"), "ep2": (2, "exact"), "ep4": (4, "exact"), "ep4_fast": (4, "fast")}


def _moe(cfg: ModelConfig) -> nn.Module:
    layer = nn.Module()
    add_moe_and_mixers(layer, cfg, False, KernelChoice.parse("triton", None))
    return layer.mlp


def _world(rank: int, out_dir: Path) -> None:
    cfg = tiny_config()
    with replicated():
        full = _moe(cfg)
    weights = tiny_weights(cfg, [(k, tuple(v.shape)) for k, v in full.state_dict().items()], 3)
    g = torch.Generator().manual_seed(9)
    inputs = {t: torch.randn(t, cfg.hidden_size, generator=g) for t in TOKENS}
    ids = {t: torch.randint(40, 200, (t,), generator=g) for t in TOKENS}
    results: dict[str, torch.Tensor] = {}
    for name, (ep, combine) in LAYOUTS.items():
        init_parallel_state(ParallelLayout(1, ep), combine)
        if rank >= ep:
            continue
        for folded in (False, True):
            moe = _moe(cfg)
            load_weights(moe, weights)
            if folded:
                moe.fuse_weights()
                assert moe.experts.folded
            for t in TOKENS:
                results[f"{name}_{'folded' if folded else 'separate'}_{t}"] = moe(inputs[t], ids[t])
    # DeepSeek-V4.1's experts (the route weight before the down projection), torch path.
    with replicated():
        whole = RoutedExperts(8, cfg.hidden_size, 64, 10.0, KernelChoice(), True)
    expert_weights = [
        (k, 0.05 * torch.randn(v.shape, generator=g)) for k, v in whole.state_dict().items()
    ]
    route_ids = torch.randint(0, 8, (TOKENS[1], 2), generator=g)
    route_weights = torch.rand(TOKENS[1], 2, generator=g)
    for name, (ep, combine) in LAYOUTS.items():
        init_parallel_state(ParallelLayout(1, ep), combine)
        if rank >= ep:
            continue
        experts = RoutedExperts(8, cfg.hidden_size, 64, 10.0, KernelChoice(), True)
        load_weights(experts, expert_weights)
        results[f"{name}_v41_torch"] = experts(inputs[TOKENS[1]], route_ids, route_weights)
    if rank == 0:
        torch.save(results, out_dir / "moe.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ep_triton_world")
    run_world(4, _world, out)
    return torch.load(out / "moe.pt")


@pytest.mark.parametrize("name", ["ep2", "ep4"])
@pytest.mark.parametrize("shared", ["folded", "separate"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_exact_combine_gives_the_bits_of_one_rank(results, name, shared, tokens):
    ref = results[f"ep1_{shared}_{tokens}"]
    got = results[f"{name}_{shared}_{tokens}"]
    assert ref.abs().max() > 0
    if tokens <= 4 and not torch.cuda.is_available():
        # One rank runs the per-token path here, `exact` the sorted one: compiled, both give
        # the same bits; the interpreter's fp32 dots are numpy's BLAS, whose sums may depend
        # on the tile a row sits in (it does on some CPUs), so on a CPU: within rounding.
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
        return
    assert torch.equal(got, ref), (got - ref).abs().max()


@pytest.mark.parametrize("shared", ["folded", "separate"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fast_combine_is_within_rounding(results, shared, tokens):
    ref = results[f"ep1_{shared}_{tokens}"]
    got = results[f"ep4_fast_{shared}_{tokens}"]
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["ep2", "ep4"])
def test_v41_experts_exact_combine_gives_the_bits_of_one_rank(results, name):
    ref = results["ep1_v41_torch"]
    assert ref.abs().max() > 0
    assert torch.equal(results[f"{name}_v41_torch"], ref)
    torch.testing.assert_close(
        results["ep4_fast_v41_torch"], ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item()
    )
