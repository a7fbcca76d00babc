"""`benchmark/bench_engine.py` runs end to end on a toy config on CPU (HF generate, ours eager and
"graph" mode, DSpark full and static) and writes a table with one row per system and batch size.
Numbers from CPU are meaningless; this only keeps the GPU benchmark script working. The error
row of a failing engine configuration (shared with `bench_native.py`) is checked on a stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def test_bench_engine_toy_cpu(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmark" / "bench_engine.py"),
        "--config",
        "toy",
        "--device",
        "cpu",
        "--batch-sizes",
        "1,2",
        "--input-len",
        "10",
        "--output-len",
        "3",
        "--gamma",
        "2",
        "--accept-len",
        "2",
        "--draft-layers",
        "1",
        "--static-cases",
        "2:2,1:2",
        "--bs1-block-size",
        "1",
        "--out-dir",
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    data = json.loads((tmp_path / "engine.json").read_text())
    seen = {(r["system"], r["bs"]) for r in data["rows"]}
    for system in ("hf_generate", "ours_eager", "ours_cuda_graph", "dspark_full"):
        assert {(system, 1), (system, 2)} <= seen, system
    assert {("dspark_static_w2", 2), ("dspark_static_w2", 1)} <= seen
    # The bs 1 runtime's block size is varied at bs 1 only.
    assert {s for s in seen if s[0].endswith("_bs1_block1")} == {("dspark_static_w2_bs1_block1", 1)}
    for r in data["rows"]:
        assert r["tok_s_total"] > 0 and len(r["ids"]) == r["bs"]
        assert all(len(ids) == 3 for ids in r["ids"])  # ignore_eos: exactly output-len tokens
    table = (tmp_path / "engine.md").read_text()
    assert table.count("| dspark_full |") == 2 and "x HF" in table


def test_bench_engine_v41_toy_cpu(tmp_path):
    """The DeepSeek-V4.1 path: no HF baseline, a random model built per engine, a draft with its
    own expert count, byte floors that grow with the batch and the speculative width."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmark" / "bench_engine.py"),
        *("--config", "v41_toy", "--device", "cpu", "--batch-sizes", "1,2"),
        *("--input-len", "10", "--output-len", "3", "--gamma", "2", "--accept-len", "2"),
        *("--draft-experts", "4", "--draft-top-k", "1", "--static-cases", "", "--skip-eager"),
        *("--out-dir", str(tmp_path)),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    data = json.loads((tmp_path / "engine.json").read_text())
    rows = {(r["system"], r["bs"]): r for r in data["rows"]}
    assert set(rows) == {(s, b) for s in ("ours_cuda_graph", "dspark_full") for b in (1, 2)}
    for r in rows.values():
        assert all(len(ids) == 3 for ids in r["ids"])
    floor = {k: r["floor_bytes_per_step"] for k, r in rows.items()}
    assert floor[("ours_cuda_graph", 1)] < floor[("ours_cuda_graph", 2)]
    assert floor[("ours_cuda_graph", 1)] < floor[("dspark_full", 1)] < floor[("dspark_full", 2)]
    assert data["meta"]["draft_experts"] == 4


def test_bench_one_batch_random_model_with_triton_moe():
    """`bench_one_batch.random_model` (also the GPU e2e script's model) with the triton MoE: the
    experts' sort table, built from a host tensor in the constructor, must survive the build (a
    build on "meta" could not make it: "Cannot copy out of meta tensor"), and seeded random
    weights must be set."""
    sys.path.insert(0, str(ROOT))
    from sgl_dspark.kernels.moe.sort import prepare_moe_sort
    from sgl_dspark.srt.configs.model_config import ModelConfig
    from sgl_dspark.srt.core.kernel_choice import KernelChoice
    from sgl_dspark.srt.layers.moe.experts import RoutedExperts
    from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS

    from benchmark.bench_one_batch import random_model

    cfg = ModelConfig.from_hf_dict(BENCH_CONFIGS["toy"])
    model = random_model(cfg, "cpu", kernels=KernelChoice(backend="triton"))
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts
    for m in experts:
        want = prepare_moe_sort(torch.ones(m.n_experts, dtype=torch.int32)).local_table
        assert torch.equal(m.sort_table, want) and bool((m.expert_mask == 1).all())
        assert m.gate_up_proj.abs().sum() > 0  # the random init ran


def test_a_failing_engine_becomes_an_error_row_and_is_shut_down(capsys):
    """`run_or_error_row` (both engine benchmarks): a failure in the load or the measurement is
    one row naming the system and the error, with the caller's extra fields; an engine that
    loaded is shut down either way; a configuration that succeeds adds no row of its own."""
    sys.path.insert(0, str(ROOT))
    from benchmark.bench_engine import run_or_error_row

    class FakeEngine:
        shutdowns = 0

        def shutdown(self) -> None:
            FakeEngine.shutdowns += 1

    def failing_load() -> FakeEngine:
        raise RuntimeError("no memory for the pool")

    def failing_body(engine: FakeEngine) -> None:
        raise ValueError("bad width")

    rows: list[dict] = []
    seen: list[FakeEngine] = []
    run_or_error_row("a", failing_load, seen.append, rows.append, "cpu", {"accept_len": 2})
    run_or_error_row("b", FakeEngine, failing_body, rows.append, "cpu", {})
    run_or_error_row("c", FakeEngine, seen.append, rows.append, "cpu", {"accept_len": 3})
    assert rows == [
        {"system": "a", "error": "RuntimeError: no memory for the pool", "accept_len": 2},
        {"system": "b", "error": "ValueError: bad width"},
    ]
    assert len(seen) == 1 and FakeEngine.shutdowns == 2
    assert "bad width" in capsys.readouterr().err  # the traceback, for the log
