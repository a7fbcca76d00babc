"""`--engram-table-location host`: DeepSeek-V4.1's Engram hash tables in page-locked host memory,
read in place by the gather kernel through unified addressing (inside the CUDA graphs too).

On a GPU: a random V4.1 model loaded with the released formats (`--load-format dummy`: FP8
projections and Engram tables, MXFP4 experts) and kept as stored gives the same greedy tokens
with its tables on the host as on the device; the host tables are page-locked, packed, and
counted as host bytes, not device bytes. Everywhere: the flag is refused by name where it
cannot work (a CPU device, the torch gather)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.layers.quantized import is_quantized
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS, released_quantization
from sgl_dspark.srt.server_args_checks import check_engram_table_location

PROMPTS = [[(11 * i + 5 * j) % 400 + 20 for j in range(12 + 3 * i)] for i in range(3)]


def _model_dir(tmp_path: Path) -> Path:
    raw = dict(BENCH_CONFIGS["v41_toy"])
    raw["quantization_config"] = released_quantization(32)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def _engine(path: Path, location: str, device: str) -> Engine:
    return Engine(
        model_path=str(path),
        device=device,
        skip_tokenizer_init=True,
        load_format="dummy",
        weight_format="native" if device == "cuda" else "bf16",
        engram_table_location=location,
        context_length=128,
        max_running_requests=4,
        max_total_tokens=1024,
    )


def test_the_flag_is_refused_where_it_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="--engram-table-location host needs --device cuda"):
        _engine(_model_dir(tmp_path), "host", "cpu")
    with pytest.raises(ValueError, match="triton engram kernels"):
        check_engram_table_location("host", "cuda", "torch")
    check_engram_table_location("host", "cuda", "triton")
    check_engram_table_location("device", "cpu", "torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked tables need a GPU")
def test_host_tables_give_the_device_tables_tokens(tmp_path):
    path = _model_dir(tmp_path)
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    outputs, reports = {}, {}
    for location in ("device", "host"):
        engine = _engine(path, location, "cuda")
        try:
            outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
            outputs[location] = [o["output_ids"] for o in outs]
            reports[location] = dict(engine.runner.memory_report)
            tables = [
                layer.engram.embed
                for layer in engine.runner.model.model.layers
                if layer.engram is not None
            ]
            assert tables
            for embed in tables:
                assert is_quantized(embed)
                assert embed.weight.dtype == torch.float8_e4m3fn
                on_host = location == "host"
                assert embed.weight.is_cuda != on_host
                assert embed.weight.is_pinned() == on_host
                assert embed.weight_scale.is_pinned() == on_host
        finally:
            engine.shutdown()
    assert all(len(o) == 16 for o in outputs["device"])
    assert outputs["host"] == outputs["device"]
    assert reports["device"]["host_pinned"] == 0 and reports["host"]["host_pinned"] > 0
    moved = reports["device"]["embeddings"] - reports["host"]["embeddings"]
    assert moved == reports["host"]["host_pinned"]
