"""`benchmark/bench_native.py` and the benchmark models it loads.

* Sizes (meta builds, nothing allocated): the routed experts of `dsv41_flash_rank` and
  `dsv4_flash_rank` equal the count from their dimensions (layers x experts x 3 x D x I, 2 bytes
  in bf16; MXFP4 codes plus one scale byte per 32), the dsv41 rank does not fit one H200 in
  bf16 and does as stored, and the stored sizes meet the issue's ratios (experts <= 0.27x,
  dense <= 0.55x: a few dense tensors stay bf16 as released); every tensor those sizes count as
  stored FP8 / MXFP4 belongs to a module that keeps it packed with `--weight-format native`.
* The decode mode runs end to end on the toy config on CPU (plain, DSpark full / static /
  online width with its profiled SPS table) and writes one row per system and batch size;
  CPU numbers are meaningless, this keeps the GPU script working; with `--profile` it also
  writes each engine's bs 1 step profile.
* Every measured batch size is graphed on a GPU: the engine's default graph limit stops at 32
  requests, past which a step would run eagerly and time the host's launches instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from sgl_dspark.srt.configs.dspark_config import DSparkConfig  # noqa: E402
from sgl_dspark.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_dspark.srt.core.kernel_choice import KernelChoice  # noqa: E402
from sgl_dspark.srt.layers.quantized import quantizable  # noqa: E402
from sgl_dspark.srt.model_executor.weights import build_on_meta  # noqa: E402
from sgl_dspark.srt.model_loader.dummy import DummyWeights  # noqa: E402
from sgl_dspark.srt.models.bench_configs import BENCH_DRAFT_KEYS  # noqa: E402
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel  # noqa: E402
from sgl_dspark.srt.models.registry import model_entry  # noqa: E402

from benchmark.bench_native import engine_args, model_sizes, quantized_raw  # noqa: E402

H200_BYTES = 141e9
H100_BYTES = 80e9


@pytest.mark.parametrize(
    "name,d,inter,layers",
    [("dsv41_flash_rank", 5120, 2304, 40), ("dsv4_flash_rank", 4096, 2048, 40)],
)
def test_rank_model_sizes(name: str, d: int, inter: int, layers: int) -> None:
    sizes = model_sizes(name, quantized_raw(name))
    (target_key,) = [k for k in sizes if "target" in k]
    (draft_key,) = [k for k in sizes if "draft" in k]
    assert f"({layers} layers)" in target_key and "(3 stages)" in draft_key
    target = sizes[target_key]
    weights = 96 * 3 * d * inter * layers
    assert target["bf16"]["experts"] == 2 * weights
    assert target["native"]["experts"] == weights // 2 + weights // 32
    assert target["native"]["experts"] <= 0.27 * target["bf16"]["experts"]
    assert target["native"]["dense"] <= 0.55 * target["bf16"]["dense"]
    # Token embedding and heads stay bf16; V4.1's Engram tables are stored as FP8 rows with
    # one exponent byte per 32 channels (E + E / 32 bytes a row against 2 E in bf16).
    raw = quantized_raw(name)
    table_rows, e = sum(raw.get("engram_num_embeddings", [])), raw.get("engram_head_dim", 0)
    assert (name == "dsv41_flash_rank") == (table_rows > 0)
    saved = table_rows * (2 * e - (e + e // 32))
    assert target["native"]["embeddings"] == target["bf16"]["embeddings"] - saved
    if name == "dsv41_flash_rank":
        total = {f: sum(sum(sizes[k][f].values()) for k in sizes) for f in ("bf16", "native")}
        assert total["bf16"] > H200_BYTES > total["native"]


def test_ep8_rank_differs_only_in_its_expert_share() -> None:
    """The EP8 rank model is the EP4 one with half the routed experts (target and draft), so its
    bs 1 step reads the same bytes, and it fits an 80 GB H100 as stored."""
    ep4, ep8 = quantized_raw("dsv41_flash_rank"), quantized_raw("dsv41_flash_rank_ep8")
    assert {k for k in ep4 if ep4[k] != ep8.get(k)} == {"n_routed_experts"}
    assert (ep4["n_routed_experts"], ep8["n_routed_experts"]) == (96, 48)
    draft4, draft8 = BENCH_DRAFT_KEYS["dsv41_flash_rank"], BENCH_DRAFT_KEYS["dsv41_flash_rank_ep8"]
    assert {k for k in draft4 if draft4[k] != draft8[k]} == {"dspark_n_routed_experts"}
    assert draft8["dspark_n_routed_experts"] * 2 == draft4["dspark_n_routed_experts"]
    sizes4, sizes8 = (
        model_sizes(n, quantized_raw(n)) for n in ("dsv41_flash_rank", "dsv41_flash_rank_ep8")
    )
    key4, key8 = ([k for k in s if "target" in k][0] for s in (sizes4, sizes8))
    assert 2 * sizes8[key8]["native"]["experts"] == sizes4[key4]["native"]["experts"]
    total8 = sum(sum(sizes8[k]["native"].values()) for k in sizes8)
    assert total8 < H100_BYTES < sum(sum(sizes4[k]["native"].values()) for k in sizes4)


@pytest.mark.parametrize("name", ["dsv41_flash_rank", "dsv4_flash_rank"])
def test_every_tensor_stored_quantised_is_kept_packed(name: str) -> None:
    """What the size table counts as stored is what the loader keeps: every tensor the released
    formats store FP8 or MXFP4 (target and draft) belongs to a module that declares it
    quantisable, else `--weight-format native` would dequantise it at load."""
    raw = quantized_raw(name)
    cfg = ModelConfig.from_hf_dict(raw)
    models = [(cfg, build_on_meta(lambda: model_entry(cfg).build_model(cfg, KernelChoice())))]
    dcfg = DSparkConfig.from_dict({**raw, **BENCH_DRAFT_KEYS[name]}, cfg)
    models.append((dcfg.stage_config, build_on_meta(lambda: DSparkDraftModel(dcfg))))
    for model_cfg, model in models:
        stored = 0
        for tensor, source in DummyWeights(model_cfg).for_model(model):
            if source.fmt is None:
                continue
            owner, _, attr = tensor.rpartition(".")
            assert quantizable(model.get_submodule(owner), attr), tensor
            stored += 1
        assert stored > 0


def _decode_on_cpu(tmp_path: Path, *args: str) -> list[dict]:
    """`bench_native.py decode` on the toy config on CPU with `args`; its rows."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmark" / "bench_native.py"),
        "decode",
        "--config",
        "toy",
        "--device",
        "cpu",
        "--input-len",
        "8",
        *args,
        "--out-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "native_decode_toy.json").read_text())["rows"]


def test_decode_mode_runs_on_cpu(tmp_path: Path) -> None:
    rows = _decode_on_cpu(
        tmp_path,
        *("--dspark", "--batch-sizes", "2", "--static-widths", "2:2", "--online-widths", "2"),
        *("--output-len", "3"),
    )
    systems = [(r["system"], r.get("bs")) for r in rows]
    assert systems == [
        (s, bs)
        for s in ("plain", "dspark_full", "dspark_static_2:2", "dspark_online_2")
        for bs in (2,)
    ], systems
    for row in rows:
        assert "error" not in row, row
        assert len(row["ids"]) == row["bs"] and all(len(ids) == 3 for ids in row["ids"])
        assert row["memory_gb"]["experts"] > 0 and row["memory_gb"]["kv"] > 0
    assert "| plain | 2 |" in (tmp_path / "native_decode_toy.md").read_text()


def test_decode_profile_writes_the_engines_table(tmp_path: Path) -> None:
    """`--profile` adds, after an engine's rows, a profile of its decode steps at each batch size
    (host ops on a CPU; device kernels too on a GPU) named by its system and batch size."""
    # The context (prompt + output + 64) must hold the profile's 80 new tokens.
    rows = _decode_on_cpu(
        tmp_path, "--systems", "plain", "--batch-sizes", "1,2", "--output-len", "24", "--profile"
    )
    assert [r["system"] for r in rows] == ["plain", "plain"], rows
    assert all("error" not in r for r in rows), rows
    for bs in (1, 2):
        text = (tmp_path / f"profile_plain_bs{bs}.txt").read_text()
        assert text.startswith("8 steps, ") and "ms/step wall" in text
        assert "aten::" in text  # the host ops of the profiled steps


def test_timed_runs_report_the_median_wall_and_the_first_runs_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`time_engine(..., runs=R)`: the warm-up and the three 1-token calls, then R timed
    generations whose median wall comes back (one disturbed run does not move it)."""
    from benchmark import bench_engine

    class FakeEngine:
        def __init__(self) -> None:
            self.calls: list[int] = []

        def generate(self, input_ids: list, sampling_params: dict) -> list[dict]:
            n = sampling_params["max_new_tokens"]
            self.calls.append(n)
            return [{"output_ids": [len(self.calls)] * n} for _ in input_ids]

    # Each call's wall: warm-up, three 1-token calls, then the timed runs (one disturbed).
    walls = iter([9.0, 0.5, 0.4, 0.6, 2.0, 5.0, 2.2])
    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += next(walls) if perf_counter.started else 0.0
        perf_counter.started = not perf_counter.started
        return clock[0]

    perf_counter.started = False  # type: ignore[attr-defined]
    monkeypatch.setattr(bench_engine.time, "perf_counter", perf_counter)
    engine = FakeEngine()
    wall, first, ids = bench_engine.time_engine(engine, [[1, 2]], 4, "cpu", runs=3)
    assert engine.calls == [4, 1, 1, 1, 4, 4, 4]
    assert (wall, first) == pytest.approx((2.2, 0.5))
    assert ids == [[5] * 4]  # the first timed run's (the fifth call)


def test_engine_args_graph_every_measured_batch() -> None:
    import argparse

    a = argparse.Namespace(
        input_len=8,
        output_len=4,
        device="cuda",
        weight_format="native",
        kv_cache_dtype="auto",
        engine_args="{}",
    )
    kw = engine_args(a, Path("model"), [1, 8, 64])
    assert (kw["max_running_requests"], kw["cuda_graph_max_bs"]) == (64, 64)
    a.engine_args = json.dumps({"cuda_graph_max_bs": 8})  # the caller's choice wins
    assert engine_args(a, Path("model"), [1, 64])["cuda_graph_max_bs"] == 8
    a.device, a.engine_args = "cpu", "{}"
    assert "cuda_graph_max_bs" not in engine_args(a, Path("model"), [1, 64])
