"""`benchmark/probe_launches.py`: what it counts as a launch (a torch op that runs a kernel, a
Triton launch; not a view, an allocation or a conversion to what a tensor already is), and the
toy model it counts keeps the benchmark model's layer structure."""

from __future__ import annotations

import torch
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS

from benchmark.probe_launches import LaunchCounter, toy_config


def test_counts_kernels_not_views_allocations_or_no_op_conversions() -> None:
    x = torch.randn(4, 6)
    counter = LaunchCounter()
    with counter:
        x.view(24).t()  # views
        torch.empty(3, 3)  # an allocation
        x.to(torch.float32).contiguous()  # already so: the input comes back
        y = x.t().contiguous()  # a copy kernel
        z = (y + 1).to(torch.bfloat16)  # an add, a conversion
        counter.count_triton("_some_kernel")
    assert z.dtype == torch.bfloat16
    assert counter.torch_ops == {"clone": 1, "add": 1, "_to_copy": 1}
    assert counter.triton == {"_some_kernel": 1}
    assert sum(counter.lines.values()) == 4


def test_toy_config_keeps_the_layer_structure() -> None:
    real, toy = BENCH_CONFIGS["dsv41_flash_rank"], toy_config("dsv41_flash_rank")
    for key in (
        "compress_ratios",
        "kv_source_layer_ids",
        "index_source_layer_ids",
        "candidate_source_layer_id",
        "engram_layer_ids",
        "n_routed_experts",
        "num_experts_per_tok",
        "quantization_config",
    ):
        assert toy[key] == real[key], key
    assert toy["hidden_size"] < real.get("hidden_size", 5120)
    assert len(toy["engram_num_embeddings"]) == len(real["engram_layer_ids"])
