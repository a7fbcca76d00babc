"""Checkpoint weights under parallelism on spawned gloo ranks (one world of 2 for the module),
from quantised checkpoints of the tiny model loaded lazily tensor by tensor:

- expert parallelism with native FP8 / MXFP4 experts: each rank holds its half of the routed
  experts, still quantised, and the `exact` combine gives logits bit-identical to one rank;
- tensor parallelism with `--weight-format bf16`: each rank materialises only its slices of the
  FP8 attention projections and of the vocabulary, within 1e-5 of one rank with the same greedy
  output;
- tensor parallelism with `--weight-format native`: each rank keeps its slices of the FP8
  attention projections as stored (its rows and their scale rows; the output projection's
  input channels on scale-group borders), within 1e-5 of one native rank with the same greedy
  output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_engines import PROMPTS, greedy_params, record_logits
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.distributed import ParallelLayout, init_parallel_state
from sgl_dspark.srt.entrypoints.engine import Engine
from sgl_dspark.srt.layers.quantized import module_weight
from sgl_dspark.srt.managers.replicated_scheduler import ReplicatedScheduler
from sgl_dspark.srt.model_executor.weights import build_on_meta
from sgl_dspark.srt.model_loader import save_released_checkpoint
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, tiny_weights
from sgl_dspark.srt.server_args import ServerArgs
from worlds import run_world

_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}

RUNS = {  # tag: (expert dtype of the checkpoint, layout, weight format)
    "fp4_ep1": ("fp4", ParallelLayout(1, 1), "native"),
    "fp4_ep2": ("fp4", ParallelLayout(1, 2), "native"),
    "fp8_ep1": ("fp8", ParallelLayout(1, 1), "native"),
    "fp8_ep2": ("fp8", ParallelLayout(1, 2), "native"),
    "fp8_tp1": ("fp8", ParallelLayout(1, 1), "bf16"),
    "fp8_tp2": ("fp8", ParallelLayout(2, 1), "bf16"),
    "fp8_tp2_native": ("fp8", ParallelLayout(2, 1), "native"),
}


def _save(out: Path, expert_dtype: str) -> str:
    cfg = ModelConfig.from_hf_dict({**TINY_HF_CONFIG, "quantization_config": _QUANT})
    model = build_on_meta(lambda: DeepseekV4ForCausalLM(cfg))
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    state = dict(tiny_weights(cfg, shapes, seed=3))
    save_released_checkpoint(state, cfg, str(out), True, expert_dtype)
    return str(out)


def _run(rank: int, out_dir: Path, tag: str, path: str, layout: ParallelLayout, fmt: str) -> None:
    init_parallel_state(layout, "exact")
    if rank >= layout.world_size:
        return
    args = ServerArgs(
        model_path=path,
        device="cpu",
        dtype="float32",
        weight_format=fmt,
        context_length=128,
        max_total_tokens=1024,
        max_running_requests=4,
        chunked_prefill_size=16,
        tp_size=layout.tp_size,
        ep_size=layout.ep_size,
        skip_tokenizer_init=True,
    ).resolved()
    engine = Engine.for_rank(args)
    logits = record_logits(engine)
    model = engine.runner.model
    experts = model.model.layers[1].mlp.experts
    stack = module_weight(experts, "gate_up_proj")
    attn = model.model.layers[1].self_attn
    info = {
        "stack_kind": type(stack).__name__,
        "stack_experts": int(stack.shape[0]) if isinstance(stack, torch.Tensor) else None,
        "num_local": experts.num_local,
        "q_b_rows": int(module_weight(attn.q_b_proj).shape[0]),
        "q_b_kind": type(module_weight(attn.q_b_proj)).__name__,
        "o_b_kind": type(module_weight(attn.o_b_proj)).__name__,
        "o_b_cols": int(module_weight(attn.o_b_proj).shape[-1]),
        "head_rows": int(model.lm_head.weight.shape[0]),
        "memory": dict(engine.runner.memory_report),
    }
    if not isinstance(stack, torch.Tensor):
        info["stack_experts"] = int(stack.data.shape[0])
    scheduler = engine.scheduler
    if rank > 0:
        assert isinstance(scheduler, ReplicatedScheduler)
        scheduler.serve_forever()
        engine.executor.close()
        torch.save(info, out_dir / f"{tag}_rank{rank}.pt")
        return
    outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy_params())
    if isinstance(scheduler, ReplicatedScheduler):
        scheduler.close()
    engine.executor.close()
    info.update(output_ids=[o["output_ids"] for o in outs], logits=logits)
    torch.save(info, out_dir / f"{tag}_rank0.pt")


def _world(rank: int, out_dir: Path, paths: dict[str, str]) -> None:
    for tag, (expert_dtype, layout, fmt) in RUNS.items():
        _run(rank, out_dir, tag, paths[expert_dtype], layout, fmt)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("native_world")
    paths = {d: _save(base / d, d) for d in ("fp4", "fp8")}
    out = base / "out"
    out.mkdir()
    run_world(2, _world, out, paths)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_each_expert_parallel_rank_holds_half_the_experts_quantised(results, expert_dtype):
    one = results[f"{expert_dtype}_ep1_rank0"]
    assert one["stack_kind"] == "QuantizedWeight"
    for rank in (0, 1):
        got = results[f"{expert_dtype}_ep2_rank{rank}"]
        assert got["stack_kind"] == "QuantizedWeight"
        assert got["num_local"] * 2 == one["num_local"]
        # Rank 0 folds the shared expert in as one more local expert when the formats match.
        assert got["stack_experts"] in (got["num_local"], got["num_local"] + 1)
        assert got["memory"]["experts"] < one["memory"]["experts"]


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_native_experts_exact_combine_is_bit_identical_to_one_rank(results, expert_dtype):
    ref, got = results[f"{expert_dtype}_ep1_rank0"], results[f"{expert_dtype}_ep2_rank0"]
    assert len(got["logits"]) == len(ref["logits"]) > 3
    for i, (a, b) in enumerate(zip(ref["logits"], got["logits"])):
        assert torch.equal(a, b), f"forward {i}: max diff {(a - b).abs().max()}"
    assert got["output_ids"] == ref["output_ids"]


def test_tensor_parallel_ranks_materialise_their_slices_of_fp8_weights(results):
    ref = results["fp8_tp1_rank0"]
    for rank in (0, 1):
        got = results[f"fp8_tp2_rank{rank}"]
        assert got["q_b_rows"] * 2 == ref["q_b_rows"]
        assert got["head_rows"] * 2 == ref["head_rows"]
    got = results["fp8_tp2_rank0"]
    assert len(got["logits"]) == len(ref["logits"]) > 3
    for a, b in zip(ref["logits"], got["logits"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    assert got["output_ids"] == ref["output_ids"]


def test_tensor_parallel_ranks_keep_their_slices_of_fp8_weights_as_stored(results):
    ref = results["fp8_ep1_rank0"]  # one rank, native
    assert ref["q_b_kind"] == ref["o_b_kind"] == "QuantizedWeight"
    for rank in (0, 1):
        got = results[f"fp8_tp2_native_rank{rank}"]
        assert got["q_b_kind"] == got["o_b_kind"] == "QuantizedWeight"
        assert got["q_b_rows"] * 2 == ref["q_b_rows"]
        assert got["o_b_cols"] * 2 == ref["o_b_cols"]  # row-parallel: input channels split
        assert got["memory"]["dense"] < ref["memory"]["dense"]
    got = results["fp8_tp2_native_rank0"]
    assert len(got["logits"]) == len(ref["logits"]) > 3
    for a, b in zip(ref["logits"], got["logits"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    assert got["output_ids"] == ref["output_ids"]
