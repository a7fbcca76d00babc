"""The parallel runtime's single-process parts: layouts and flags, shard specs, loading an
expert-parallel rank's slice of a checkpoint (without reading other ranks' experts), and the
single-GPU path calling no `torch.distributed` function at all."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sgl_dspark.srt.distributed import ParallelLayout, get_parallel_state, replicated
from sgl_dspark.srt.distributed.sharding import mark_shard, shard_for
from sgl_dspark.srt.model_loader import load_checkpoint, save_released_checkpoint
from sgl_dspark.srt.model_loader import loader as loader_module
from sgl_dspark.srt.server_args import ServerArgs, make_parser


def test_layout_world_is_the_larger_size_and_sizes_must_divide():
    assert ParallelLayout(4, 4).world_size == 4
    assert ParallelLayout(1, 8).world_size == 8
    assert ParallelLayout(2, 4).world_size == 4
    with pytest.raises(ValueError, match="--tp-size 2 and --ep-size 3"):
        ParallelLayout(2, 3)
    with pytest.raises(ValueError, match="--ep-size must be >= 1"):
        ParallelLayout(1, 0)


def test_parallel_flags_parse_with_sglang_names():
    args = ServerArgs.from_cli_args(["--model-path", "tiny", "--tp", "4", "--ep", "4"])
    assert (args.tp_size, args.ep_size, args.ep_combine) == (4, 4, "exact")
    args = ServerArgs.from_cli_args(
        ["--model-path", "tiny", "--tp-size", "2", "--dist-init-addr", "10.0.0.1:5000"]
    )
    assert (args.tp_size, args.dist_init_addr, args.nnodes) == (2, "10.0.0.1:5000", 1)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2"], "several hosts are not supported"),
        (["--node-rank", "1"], "--node-rank must be 0"),
        (["--tp-size", "2", "--ep-size", "3"], "the smaller must divide the larger"),
        (["--dist-init-addr", "nowhere"], "--dist-init-addr must be host:port"),
        (["--ep-combine", "sloppy"], "invalid choice"),
    ],
)
def test_bad_parallel_flags_exit_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        ServerArgs.from_cli_args(["--model-path", "tiny", *flags], make_parser())
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_shard_for_narrows_to_the_marked_slice():
    full = torch.arange(24.0).view(6, 4)
    param = torch.nn.Parameter(torch.empty(2, 4))
    mark_shard(param, 0, 1, 3)
    assert torch.equal(shard_for(param, full), full[2:4])
    assert torch.equal(shard_for(param, full[2:4]), full[2:4])  # already the slice
    cols = torch.nn.Parameter(torch.empty(6, 2))
    mark_shard(cols, 1, 0, 2)
    assert torch.equal(shard_for(cols, full), full[:, :2])
    whole = torch.nn.Parameter(torch.empty(6, 4))
    mark_shard(whole, 0, 0, 1)  # one shard: nothing marked
    assert shard_for(whole, full) is full
    odd = torch.nn.Parameter(torch.empty(1, 4))
    mark_shard(odd, 0, 0, 4)
    with pytest.raises(ValueError, match="does not split into 4 shards"):
        shard_for(odd, full)


def _tiny_state() -> tuple[object, dict[str, torch.Tensor]]:
    from sgl_dspark.srt.models.source import resolve_model

    cfg, weights = resolve_model("tiny", torch.float32, seed=4)
    return cfg, dict(weights)


@pytest.mark.parametrize("quantize", [False, True])
def test_an_expert_parallel_rank_reads_only_its_experts(tmp_path, monkeypatch, quantize):
    cfg, state = _tiny_state()
    save_released_checkpoint(state, cfg, str(tmp_path), quantize=quantize, expert_dtype="fp4")
    full = dict(load_checkpoint(str(tmp_path), cfg, torch.float32))
    read: list[str] = []
    real_get = loader_module.SafetensorsReader.get

    def get(self, name):
        read.append(name)
        return real_get(self, name)

    monkeypatch.setattr(loader_module.SafetensorsReader, "get", get)
    part = dict(load_checkpoint(str(tmp_path), cfg, torch.float32, experts=(2, 4)))
    assert set(part) == set(full)
    stacked = [n for n in full if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked
    for name, tensor in full.items():
        expected = tensor[2:6] if name in stacked else tensor
        assert torch.equal(part[name], expected), name
    experts_read = {n.split(".experts.")[1].split(".")[0] for n in read if ".experts." in n}
    assert experts_read == {"2", "3", "4", "5"}, experts_read


def test_one_gpu_calls_no_torch_distributed_function(monkeypatch):
    from sgl_dspark import Engine

    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed was called on one GPU")

    for name in (
        "init_process_group",
        "new_group",
        "all_reduce",
        "all_gather",
        "broadcast",
        "broadcast_object_list",
        "barrier",
    ):
        monkeypatch.setattr(dist, name, refuse)
    assert get_parallel_state().is_single
    with Engine(model_path="tiny", device="cpu", max_total_tokens=1024, context_length=128) as e:
        out = e.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4})
    assert len(out["output_ids"]) == 4
    with replicated():
        assert get_parallel_state().is_single
