"""The parallel runtime's single-process parts: layouts and flags, shard specs, loading an
expert-parallel rank's slice of a checkpoint (without reading other ranks' experts), the
split of a step's rows between greedy picks and whole rows, and the single-GPU path calling
no `torch.distributed` function at all."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sgl_dspark.srt.distributed import ParallelLayout, get_parallel_state, replicated
from sgl_dspark.srt.distributed.sharding import mark_shard, shard_for
from sgl_dspark.srt.layers.vocab_parallel import RowSplit, split_rows
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


def test_row_split_groups_positions_and_merges_back_in_step_order():
    class Reader:
        sharded = True

    cpu = torch.device("cpu")
    split = split_rows(Reader(), [True, False, True, False, True], cpu)
    assert split is not None
    assert (split.greedy, split.whole) == ((1, 3), (0, 2, 4))
    assert split.greedy_t.tolist() == [1, 3] and split.whole_t.tolist() == [0, 2, 4]
    # Each group's results in group order, [n, 2] rows: back in step order.
    greedy = torch.tensor([[11, 12], [31, 32]])
    whole = torch.tensor([[1, 2], [21, 22], [41, 42]])
    assert split.merge(greedy, whole).tolist() == [[1, 2], [11, 12], [21, 22], [31, 32], [41, 42]]
    # One way for the whole step: all of one kind, or one rank (whole rows already).
    assert split_rows(Reader(), [True, True], cpu) is None
    assert split_rows(Reader(), [False, False], cpu) is None
    Reader.sharded = False
    assert split_rows(Reader(), [True, False], cpu) is None
    # An empty group merges too (a step whose sampled requests are all greedy).
    alone = RowSplit([0, 1], [], cpu)
    assert alone.merge(torch.tensor([5, 6]), torch.tensor([], dtype=torch.int64)).tolist() == [5, 6]


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


_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}


def _quantised_checkpoint(tmp_path, expert_dtype: str):
    from sgl_dspark.srt.configs.model_config import ModelConfig
    from sgl_dspark.srt.model_executor.weights import build_on_meta
    from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, tiny_weights

    cfg = ModelConfig.from_hf_dict({**TINY_HF_CONFIG, "quantization_config": _QUANT})
    model = build_on_meta(lambda: DeepseekV4ForCausalLM(cfg))
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    state = dict(tiny_weights(cfg, shapes, seed=3))
    save_released_checkpoint(state, cfg, str(tmp_path), True, expert_dtype)
    return cfg


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_an_expert_parallel_rank_keeps_its_experts_quantised(tmp_path, monkeypatch, expert_dtype):
    """The lazy plan of an expert-parallel rank: its quantised stacks are the full stacks'
    experts [2, 6), as stored, and no other expert is read."""
    from sgl_dspark.srt.model_loader.loader import CheckpointWeights

    cfg = _quantised_checkpoint(tmp_path, expert_dtype)
    stacked = ("experts.gate_up_proj", "experts.down_proj")
    full = {
        name: (t.fmt, t.shape, t.quantized("cpu"))
        for name, t in CheckpointWeights(str(tmp_path), cfg)
        if name.endswith(stacked)
    }
    assert full
    read: list[str] = []
    real_get = loader_module.SafetensorsReader.get

    def get(self, name, rows=None):
        read.append(name)
        return real_get(self, name, rows)

    monkeypatch.setattr(loader_module.SafetensorsReader, "get", get)
    for name, t in CheckpointWeights(str(tmp_path), cfg, experts=(2, 4)):
        if name not in full:
            continue
        fmt, shape, whole = full[name]
        assert t.fmt == fmt is not None
        assert t.shape == (4, *shape[1:])
        part = t.quantized("cpu")
        assert part.fmt == whole.fmt
        assert torch.equal(part.data.view(torch.uint8), whole.data[2:6].view(torch.uint8))
        assert torch.equal(part.scale, whole.scale[2:6])
    experts_read = {n.split(".experts.")[1].split(".")[0] for n in read if ".experts." in n}
    assert experts_read == {"2", "3", "4", "5"}, experts_read


def test_a_tensor_parallel_slice_of_a_checkpoint_tensor_is_its_narrowed_dense_tensor(tmp_path):
    """Row and column slices of every 2-D tensor (FP8 blocks of 32 cut on and off their
    borders, plain tensors), dequantised, equal the narrowed whole tensor. Kept as stored, a
    row slice (on or inside a scale block) and a column slice on scale-group borders
    dequantise to the same values; a column slice that cuts a scale group is refused, and the
    error names the flag."""
    from sgl_dspark.kernels.linear.reference import dequantize_weight_ref
    from sgl_dspark.srt.model_loader.loader import CheckpointWeights

    cfg = _quantised_checkpoint(tmp_path, "fp8")
    checked = {"fp8": 0, "plain": 0, "on_block": 0, "off_block": 0, "refused": 0}
    for name, t in CheckpointWeights(str(tmp_path), cfg):
        if len(t.shape) != 2 or t.item.kind != "plain":
            continue
        whole = t.dense("cpu", torch.float32)
        for dim in (0, 1):
            size = t.shape[dim]
            for parts in (2, 4):
                if size % parts:
                    continue
                step = size // parts
                for part in range(parts):
                    sliced = t.narrow(dim, part * step, step)
                    want = whole.narrow(dim, part * step, step)
                    assert torch.equal(sliced.dense("cpu", torch.float32), want), (name, dim)
                    if t.fmt != "fp8":
                        continue
                    stop = (part + 1) * step
                    if dim == 1 and ((part * step) % 32 or (stop % 32 and stop != size)):
                        with pytest.raises(ValueError, match="--weight-format bf16"):
                            sliced.quantized("cpu")
                        checked["refused"] += 1
                        continue
                    kept = sliced.quantized("cpu")
                    assert kept.fmt == "fp8" and kept.data.shape == want.shape
                    got = dequantize_weight_ref(kept, torch.float32)
                    assert torch.equal(got, want), (name, dim, part, step)
                    checked["off_block" if (part * step) % 32 else "on_block"] += dim == 0
        checked["fp8" if t.fmt == "fp8" else "plain"] += 1
    assert checked["fp8"] > 3 and checked["plain"] > 0, checked
    # Row slices on and inside scale blocks, and column slices that cut a group, all occurred.
    assert checked["on_block"] and checked["off_block"] and checked["refused"], checked


def test_materialise_creates_only_the_marked_slice():
    from sgl_dspark.srt.model_executor.weights import build_on_meta, materialise

    class Sliced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = torch.nn.Parameter(torch.zeros(2, 4))
            self.cols = torch.nn.Parameter(torch.zeros(6, 2))
            mark_shard(self.rows, 0, 1, 3)
            mark_shard(self.cols, 1, 1, 2)

    full = torch.arange(24.0).view(6, 4)
    model = materialise(
        build_on_meta(Sliced), [("rows", full), ("cols", full)], "cpu", torch.float32, False
    )
    assert torch.equal(model.rows, full[2:4])
    assert torch.equal(model.cols, full[:, 2:])
    with pytest.raises(ValueError, match="does not split into 3 shards"):
        materialise(
            build_on_meta(Sliced), [("rows", full[:5]), ("cols", full)], "cpu", torch.float32, False
        )
