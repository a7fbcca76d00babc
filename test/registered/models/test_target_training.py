"""The training forward of a DeepSeek-V4.1 target (`tools/target_training/forward.py`):

* on the fixtures (outputs of Hugging Face's V4.1 implementation, every quantiser active), its
  logits for the three prompts padded into one batch are within 1e-4 of HF's prefill logits;
* on random checkpoints whose top-k and candidate blocks really select (small `index_topk`),
  it equals the serving engine's prefill, rows of several lengths padded together;
* every parameter but the indexer's gets a finite, non-zero gradient (the top-k selection is not
  differentiable, so the indexer gets none), and the quantisers pass gradients straight through;
* the token batches cover every sequence once, under the token budget.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from runner_utils import Driver
from safetensors.torch import load_file
from sgl_dspark.srt.core.forward_batch import ForwardMode
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
from sgl_dspark.srt.models.source import resolve_model
from sgl_dspark.srt.quantization.fake_quant import fake_quant_fp4_latent
from sgl_dspark.tools.target_training.data import PAD_MULTIPLE, make_batches
from sgl_dspark.tools.target_training.forward import (
    RouterStats,
    V41TrainingForward,
    straight_through,
)
from sgl_dspark.tools.target_training.trainer import build_model, init_weights
from v41_random import RANDOM_CONFIGS, write_random_v41

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "deepseek_v41"
TOL = dict(atol=1e-4, rtol=0.0)


def _runner(model_dir: pathlib.Path) -> ModelRunner:
    cfg, weights = resolve_model(str(model_dir), torch.float32)
    rc = RunnerConfig(max_total_tokens=4096, max_running_requests=8, context_length=128)
    return ModelRunner(cfg, rc, weights=weights)


def _padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(len(s) for s in seqs) + 3  # padding past the longest row too
    ids = torch.full((len(seqs), S), pad, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in seqs])


@pytest.mark.parametrize("case", ["c1_hc2_sqrtsoftplus", "c2_hc4_sigmoid_engram"])
def test_matches_hf_prefill_logits_on_fixtures(case):
    d = FIXTURES / case
    vec = load_file(str(d / "vectors.safetensors"))
    prompts = [vec[f"{p}.input_ids"].tolist() for p in ("p0", "p1", "p2")]
    forward = V41TrainingForward(_runner(d).model)  # type: ignore[arg-type]
    ids, lengths = _padded(prompts, pad=5)
    with torch.no_grad():
        logits = forward(ids, lengths)
    for b, p in enumerate(("p0", "p1", "p2")):
        torch.testing.assert_close(logits[b, : len(prompts[b])], vec[f"{p}.prefill_logits"], **TOL)


@pytest.fixture(scope="module", params=list(RANDOM_CONFIGS))
def random_dir(request, tmp_path_factory):
    return write_random_v41(request.param, tmp_path_factory.mktemp(request.param), seed=1)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_matches_engine_prefill_with_selection(random_dir):
    runner = _runner(random_dir)
    drv = Driver(runner)
    seqs = [_ids(n, 50 + n) for n in (37, 1, 22, 9)]
    slots = [drv.new_request() for _ in seqs]
    served = drv.step(ForwardMode.EXTEND, list(zip(slots, seqs)))
    forward = V41TrainingForward(runner.model)  # type: ignore[arg-type]
    ids, lengths = _padded(seqs, pad=2)
    with torch.no_grad():
        logits = forward(ids, lengths)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b, : len(s)], served[b], **TOL)


def test_gradients_reach_every_parameter_but_the_indexer(random_dir):
    # built as the trainer builds it (the runner fuses projections for inference)
    hf_config = json.loads((random_dir / "config.json").read_text())
    model = build_model(hf_config, str(random_dir / "tokenizer.json"), "cpu")
    init_weights(model, seed=0)
    forward = V41TrainingForward(model)  # type: ignore[arg-type]
    ids, lengths = _padded([_ids(30, 1), _ids(17, 2)], pad=2)
    stats = RouterStats()
    logits = forward(ids, lengths, stats)
    real = torch.arange(ids.shape[1] - 1)[None, :] < lengths[:, None] - 1
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][real], ids[:, 1:][real])
    (loss + stats.balance_loss()).backward()
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_straight_through_values_and_gradient():
    x = torch.tensor([[0.3, -1.7, 2.2, 0.05] * 4], requires_grad=True)
    y = straight_through(x, fake_quant_fp4_latent)
    # the quantiser's values exactly: the 16-channel block's scale is 2.2 / 6 rounded to E4M3
    # (0.375), then 0.3/0.375 = 0.8 -> 1.0, -1.7/.375 = -4.53 -> -4, 2.2/.375 = 5.87 -> 6,
    # 0.05/.375 = 0.13 -> 0
    expected = torch.tensor([[0.375, -1.5, 2.25, 0.0] * 4])
    assert torch.equal(y.detach(), expected)
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_batches_cover_every_sequence_once_under_the_budget():
    g = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(4, 100, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 300, (500,), generator=g)
    ]
    budget = 2048
    batches = make_batches(seqs, budget, pad_id=2, seed=3)
    seen = []
    for b in batches:
        B, S = b.input_ids.shape
        assert S % PAD_MULTIPLE == 0 and S >= int(b.lengths.max())
        assert B * S <= budget or B == 1
        for row, n in zip(b.input_ids.tolist(), b.lengths.tolist()):
            assert all(t == 2 for t in row[n:])
            seen.append(tuple(row[:n]))
    assert sorted(seen) == sorted(tuple(s) for s in seqs)
    # another seed gives another order of the same sequences
    again = make_batches(seqs, budget, pad_id=2, seed=4)
    assert [b.input_ids.shape for b in again] != [b.input_ids.shape for b in batches]
