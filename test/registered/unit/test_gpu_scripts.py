"""The one-call GPU scripts (`benchmark/gpu/v41_h200.sh`, `native_h200.sh`,
`serving_h200.sh`): they parse, a dry
run prints every command with its time limit and runs or writes nothing, every engine
configuration runs in a process of its own with its rows added to one table, each documented
device call fits the call budget, and the V4.1 benchmark stage runs for real on a toy config on
CPU (rows of every system, the SPS table handed from the full-width process to the confidence
one, results packed under $OUT)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GPU = ROOT / "benchmark" / "gpu"
SCRIPTS = ("v41_h200.sh", "native_h200.sh", "serving_h200.sh")
CALL_BUDGET = 570  # stages.sh's default


def _dry_run(
    script: str, stages: str | None, tmp_path: Path, knobs: dict[str, str] | None = None
) -> list[tuple[str, int, int, list[str]]]:
    """(stage, stage budget, command limit, command) of every command the dry run prints, with
    the script's environment knobs `knobs`; a stage without commands (env) appears with limit
    0 and no command."""
    out = tmp_path / "out"
    args = ["bash", str(GPU / script), "--dry-run"] + ([stages] if stages else [])
    env = {**os.environ, **(knobs or {}), "OUT": str(out), "WORK_ROOT": str(tmp_path / "work_root")}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not out.exists() and not (tmp_path / "work_root").exists(), "a dry run wrote files"
    commands, stage, budget = [], "", 0
    for line in proc.stdout.splitlines():
        if m := re.match(r"## stage (\w+): budget (\d+) s", line):
            stage, budget = m.group(1), int(m.group(2))
            commands.append((stage, budget, 0, []))
        elif line.startswith("timeout "):
            cmd, _, log = line.partition(" > ")
            assert log.startswith(str(tmp_path / "work_root" / "work")), line
            words = shlex.split(cmd)
            commands.append((stage, budget, int(words[1]), words[2:]))
    return commands


def _flag(words: list[str], name: str) -> str:
    values = [words[i + 1] for i, w in enumerate(words) if w == name]
    assert len(values) == 1, (name, words)
    return values[0]


@pytest.mark.parametrize("script", SCRIPTS + ("stages.sh",))
def test_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def test_v41_bench_runs_each_engine_in_its_own_process(tmp_path: Path) -> None:
    commands = _dry_run("v41_h200.sh", None, tmp_path)
    assert {stage for stage, _, _, _ in commands} == {"env", "kernels", "graphs", "bench"}
    bench = [words for stage, _, _, words in commands if stage == "bench" and words]
    assert all(words[:2] == ["python3", "benchmark/bench_engine.py"] for words in bench)
    systems = [_flag(words, "--systems") for words in bench]
    assert systems == ["graph", "dspark_full", "dspark_static", "dspark_confidence"]
    for words in bench:  # one table, one SPS table, the same model and sizes
        assert "--append" in words
        assert _flag(words, "--config") == "v41_flash_slice"
        assert _flag(words, "--batch-sizes") == "1,8,32"
        assert _flag(words, "--out-dir") == _flag(bench[0], "--out-dir")
        assert _flag(words, "--sps-table") == _flag(bench[0], "--sps-table")
        assert _flag(words, "--static-widths") and _flag(words, "--confidence-modes")


def test_native_engines_run_in_their_own_processes(tmp_path: Path) -> None:
    stages = "env,tests,gemm,ab,rank,rank_dspark,v4_kv,sweep"
    commands = _dry_run("native_h200.sh", stages, tmp_path)
    ab = [words for stage, _, _, words in commands if stage == "ab" and words]
    assert [_flag(w, "--formats") for w in ab] == ["bf16", "native"]
    assert all("--append" in w and _flag(w, "--config") == "dsv4_flash_slice" for w in ab)
    dspark = [words for stage, _, _, words in commands if stage == "rank_dspark" and words]
    assert [_flag(w, "--systems") for w in dspark] == [
        "dspark_full",
        "dspark_static",
        "dspark_online",
    ]
    assert len({_flag(w, "--sps-table") for w in dspark}) == 1
    assert len({_flag(w, "--out-dir") for w in dspark}) == 1


def test_probe_regs_passes_its_shapes(tmp_path: Path) -> None:
    commands = _dry_run("native_h200.sh", "probe_regs", tmp_path, {"PROBE_REGS_SHAPES": "o_b"})
    probe = [words for stage, _, _, words in commands if stage == "probe_regs" and words]
    assert len(probe) == 1
    assert probe[0][:2] == ["python3", "benchmark/kernels/probe_fma_gemv.py"]
    assert _flag(probe[0], "--shapes") == "o_b"


def test_probe_fp4_passes_its_shapes(tmp_path: Path) -> None:
    commands = _dry_run("native_h200.sh", "probe_fp4", tmp_path, {"PROBE_FP4_SHAPES": "down_7"})
    probe = [words for stage, _, _, words in commands if stage == "probe_fp4" and words]
    assert len(probe) == 1
    assert probe[0][:2] == ["python3", "benchmark/kernels/probe_w_first_fp4.py"]
    assert _flag(probe[0], "--shapes") == "down_7"


def test_probe_tma_passes_its_shapes(tmp_path: Path) -> None:
    commands = _dry_run("native_h200.sh", "probe_tma", tmp_path, {"PROBE_TMA_SHAPES": "down"})
    probe = [words for stage, _, _, words in commands if stage == "probe_tma" and words]
    assert len(probe) == 1
    assert probe[0][:2] == ["python3", "benchmark/kernels/probe_tma_linear.py"]
    assert _flag(probe[0], "--shapes") == "down"


def test_rank_profile_serial_takes_its_batch_size(tmp_path: Path) -> None:
    commands = _dry_run(
        "native_h200.sh", "rank_profile_serial", tmp_path, {"RANK_PROFILE_BS": "32"}
    )
    runs = [w for stage, _, _, w in commands if stage == "rank_profile_serial" and w]
    assert len(runs) == 1
    assert _flag(runs[0], "--batch-sizes") == "32"


def test_rank_ab_warms_each_side_then_times_abba(tmp_path: Path) -> None:
    """`rank_ab` with RANK_AB_WARM=1: one short untimed engine per side first (its own
    directory, which the summary does not read), then the timed rounds base, head, head, base,
    each side on its own tree with its own engine arguments."""
    base = tmp_path / "base_tree"
    base.mkdir()
    knobs = {
        "RANK_AB_BASE": str(base),
        "RANK_AB_WARM": "1",
        "RANK_AB_WARM_S": "150",
        "RANK_AB_HEAD_ARGS": '{"programmatic_launch_max_bs": 0}',
        "RANK_CONFIG": "dsv41_flash_rank_ep8",
    }
    commands = _dry_run("native_h200.sh", "rank_ab", tmp_path, knobs)
    runs = [(limit, words) for stage, _, limit, words in commands if words]
    engines = [(limit, w) for limit, w in runs if "decode" in w]
    sides = ["base" if w[3].startswith(str(base)) else "head" for _, w in engines]
    assert sides == ["base", "head", "base", "head", "head", "base"]
    warm, timed = engines[:2], engines[2:]
    assert all(limit == 150 and _flag(w, "--output-len") == "8" for limit, w in warm)
    assert all(_flag(w, "--out-dir").split("/")[-2] == "rank_ab_warm" for _, w in warm)
    assert all(_flag(w, "--output-len") == "128" for _, w in timed)
    assert all(_flag(w, "--out-dir").split("/")[-2] == "rank_ab" for _, w in timed)
    for (_, w), side in zip(engines, sides):
        assert _flag(w, "--config") == "dsv41_flash_rank_ep8"
        want = '{"programmatic_launch_max_bs": 0}' if side == "head" else "{}"
        assert _flag(w, "--engine-args") == want
    summary = runs[-1][1]
    assert summary[:2] == ["python3", "benchmark/gpu/abba_summary.py"]
    assert summary[2].endswith("/rank_ab")


def test_serving_ab_arms_differ_by_one_flag(tmp_path: Path) -> None:
    """Each serving A/B compares two launches of the demo server that differ by exactly the
    feature under test, on the same GSM8K workloads at 1, 8 and 32 requests in flight."""
    commands = _dry_run("serving_h200.sh", "env,dspark,deterministic", tmp_path)
    runs = {stage: words for stage, _, _, words in commands if words}
    assert set(runs) == {"dspark", "deterministic"}
    expected_extra = {
        "dspark": ["--speculative-algorithm", "DSpark"],
        "deterministic": ["--enable-deterministic-inference"],
    }
    for stage, words in runs.items():
        assert words[:3] == ["python3", "-m", "benchmark.ab"]
        assert _flag(words, "--metric") == "tok_per_s_per_user"
        baseline = shlex.split(_flag(words, "--baseline-cmd"))
        candidate = shlex.split(_flag(words, "--candidate-cmd"))
        assert baseline[:5] == ["python3", "-m", "sgl_dspark.launch_server", "--model-path", "demo"]
        assert candidate[: len(baseline)] == baseline
        assert candidate[len(baseline) :] == expected_extra[stage]
        loads = [words[i + 1] for i, w in enumerate(words) if w == "--workload"]
        assert [re.search(r"conc=(\d+)", w).group(1) for w in loads] == ["1", "8", "32"]  # type: ignore[union-attr]
        assert all(w.startswith("gsm8k:path=") and "out=256" in w for w in loads)
        assert int(_flag(words, "--replicates")) >= 4


@pytest.mark.parametrize("script", SCRIPTS)
def test_documented_calls_fit_the_call_budget(script: str, tmp_path: Path) -> None:
    """Every stage set the script's header names as one device call: its stage budgets sum to
    at most the call budget, and its commands' limits stay within their stage's budget."""
    header = (GPU / script).read_text().split("source ")[0]
    calls = re.findall(r"^#\s+(env(?:,\w+)+)\s", header, flags=re.M)
    assert calls, "the header names no call"
    for call in calls:
        budgets: dict[str, int] = {}
        for stage, budget, limit, _ in _dry_run(script, call, tmp_path / call):
            budgets[stage] = budget
            assert limit <= budget, (call, stage)
        assert set(budgets) == set(call.split(",")), call
        assert sum(budgets.values()) <= CALL_BUDGET, (call, budgets)


def test_v41_bench_stage_on_cpu(tmp_path: Path) -> None:
    out, work_root = tmp_path / "out", tmp_path / "work_root"
    toy = (
        "--config v41_toy --device cpu --batch-sizes 1,2 --input-len 8 --output-len 2 "
        "--gamma 2 --accept-len 2 --draft-experts 4 --draft-top-k 1 --static-widths 1:2,2:3"
    )
    env = {
        **os.environ,
        "OUT": str(out),
        "WORK_ROOT": str(work_root),
        "V41_BENCH_OVERRIDES": toy,
        "LIMIT_SCALE": "20",  # the limits are the GPU's; a shared CPU is far slower
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python3 = this one
    }
    proc = subprocess.run(
        ["bash", str(GPU / "v41_h200.sh"), "bench"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert summary.count(": exit 0 after") == 4, summary
    with tarfile.open(out / "results.tgz") as tar:
        table = json.load(tar.extractfile("work/v41_bench/engine.json"))  # type: ignore[arg-type]
        names = tar.getnames()
    assert "work/v41_bench/sps.json" in names and "work/v41_bench/dspark_full.log" in names
    rows = {(r["system"], r["bs"]) for r in table["rows"]}
    systems = ("ours_cuda_graph", "dspark_full", "dspark_static_1:2,2:3", "dspark_confidence_async")
    assert rows == {(s, bs) for s in systems for bs in (1, 2)}
    assert all("error" not in r and len(r["ids"]) == r["bs"] for r in table["rows"])
    assert all(len(ids) == 2 for r in table["rows"] for ids in r["ids"])
    assert "| dspark_confidence_async | 2 |" in summary


@pytest.mark.parametrize(
    "stage,knob,script",
    [
        ("attn_shape", "ATTN_SHAPE_M", "probe_attention_shape.py"),
        ("row_blocks", "ROW_BLOCKS_M", "probe_row_blocks.py"),
    ],
)
def test_probe_stage_passes_its_batch_sizes(
    stage: str, knob: str, script: str, tmp_path: Path
) -> None:
    commands = _dry_run("native_h200.sh", stage, tmp_path, {knob: "8,32"})
    probe = [words for name, _, _, words in commands if name == stage and words]
    assert len(probe) == 1
    assert probe[0][:2] == ["python3", f"benchmark/kernels/{script}"]
    assert _flag(probe[0], "--m") == "8,32"


def test_probe_w8a8_passes_its_shapes_and_variants(tmp_path: Path) -> None:
    knobs = {"PROBE_W8A8_SHAPES": "o_b", "PROBE_W8A8_ONLY": "BN128"}
    commands = _dry_run("native_h200.sh", "probe_w8a8", tmp_path, knobs)
    probe = [words for stage, _, _, words in commands if stage == "probe_w8a8" and words]
    assert len(probe) == 1
    assert probe[0][:2] == ["python3", "benchmark/kernels/probe_w8a8_decode.py"]
    assert _flag(probe[0], "--shapes") == "o_b" and _flag(probe[0], "--only") == "BN128"
