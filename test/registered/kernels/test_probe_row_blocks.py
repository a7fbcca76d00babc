"""`benchmark/kernels/probe_row_blocks.py` on the CPU interpreter at small shapes: every variant
of the quantised linear above 16 rows (the library's, one row block a program, two at other
pipeline depths and warp counts) runs, plain and grouped, and the probe finds each one's bits
equal to one block a program's; the override of the launch shape is undone when its block ends,
also on an error. The GPU runs the probe itself at V4.1-Flash's shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import sgl_dspark.kernels.linear.quantized as quantized  # noqa: E402

from benchmark.kernels import bench_quant_gemm  # noqa: E402
from benchmark.kernels import probe_row_blocks as probe  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="the interpreter form; GPUs run the probe"
    ),
]


def test_every_variant_gives_the_one_block_bits(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_quant_gemm.SETUP, "device", "cpu")
    monkeypatch.setattr(bench_quant_gemm.SETUP, "working_set", 1)  # one weight copy
    monkeypatch.setattr(probe, "SHAPES", (("plain", 40, 96, 1), ("grouped", 24, 64, 2)))
    out = tmp_path / "rows.md"
    monkeypatch.setattr(sys, "argv", ["probe", "--m", "20,33", "--out", str(out)])
    probe.main()
    rows = [
        line
        for line in out.read_text().splitlines()
        if line.startswith("| plain") or line.startswith("| grouped")
    ]
    assert len(rows) == 2 * 2 * len(probe.VARIANTS)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "yes", row  # bits as one block a program
        assert float(cells[4]) < 2e-2, row  # within the GEMM tolerance of the reference
    assert "NO" not in capsys.readouterr().out


def test_the_override_is_undone():
    default = quantized._quantized_meta
    with probe.launch_shape(1, {"num_stages": 2}):
        meta = quantized._quantized_meta("fp8", 5120, 8192, 1, 132, 32)
        assert meta["ROW_BLOCKS"] == 1 and meta["num_stages"] == 2
        assert meta["BLOCK_K"] == default("fp8", 5120, 8192, 1, 132, 32)["BLOCK_K"]
    assert quantized._quantized_meta is default and quantized._ROW_BLOCKS_ABOVE_TILE == 2
    with pytest.raises(RuntimeError), probe.launch_shape(1, {}):
        raise RuntimeError("a failing variant")
    assert quantized._quantized_meta is default and quantized._ROW_BLOCKS_ABOVE_TILE == 2
    assert default("fp8", 5120, 8192, 1, 132, 16)["ROW_BLOCKS"] == 1
    assert default("fp8", 5120, 8192, 1, 132, 17)["ROW_BLOCKS"] == 2


def test_one_block_a_program_keeps_its_own_pipeline():
    """Above 16 rows the narrow FP8 shape takes three stages for two blocks a program (two
    activation tiles a stage) and four for one; 16 rows keep four."""
    meta = quantized._quantized_meta
    assert meta("fp8", 5120, 8192, 1, 132, 16)["num_stages"] == 4
    assert meta("fp8", 5120, 8192, 1, 132, 32)["num_stages"] == 3
    with probe.launch_shape(1, {}):
        assert quantized._quantized_meta("fp8", 5120, 8192, 1, 132, 32)["num_stages"] == 4
