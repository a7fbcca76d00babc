"""Read a DeepSeek-V4 checkpoint directory and yield HF-named, dequantised tensors.

The whole checkpoint is validated from the safetensors headers before any tensor data is read
(`plan_checkpoint`), so naming, scale and dtype errors surface at once, each as a ValueError that
names the tensor. `load_checkpoint` then reads one output tensor at a time.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from sgl_dspark.srt.model_loader.name_mapping import (
    V4_NAMES,
    NameTable,
    detect_naming_scheme,
    is_fp32_param,
    is_integer_buffer,
    parse_checkpoint_name,
    released_expert_name,
)
from sgl_dspark.srt.model_loader.quantization import (
    MXFP4_GROUP,
    dequantize_fp8_block,
    dequantize_mxfp4,
    fp8_block_scale_shape,
    mxfp4_scale_shape,
)
from sgl_dspark.srt.model_loader.weight_utils import SafetensorsReader, TensorInfo

if TYPE_CHECKING:
    from sgl_dspark.srt.configs.model_config import ModelConfig

logger = logging.getLogger(__name__)

StoredFormat = Literal["plain", "fp8", "fp4", "integer"]
ItemKind = Literal["plain", "gate_up", "down"]

_PLAIN_DTYPES = frozenset({"F32", "BF16", "F16", "F64"})
_INTEGER_DTYPES = frozenset({"I64", "I32", "I16", "U8", "I8", "U16", "U32"})
_SCALE_DTYPES = frozenset({"F8_E8M0", "U8", "F32", "BF16", "F16"})
_DEFAULT_BLOCK = (128, 128)
# MXFP4 scale groups a checkpoint may declare through its scale shapes (32 is the MX standard;
# some DeepSeek-V4.1 expert checkpoints are described with 16).
_FP4_GROUPS = (MXFP4_GROUP, 16)


class StoredPart(NamedTuple):
    """One stored weight and, when quantised, its scale (stored names) and scale block: FP8
    (rows, cols) per scale, FP4 (1, channels) per scale."""

    weight: str
    scale: str | None
    fmt: StoredFormat
    block: tuple[int, int] = _DEFAULT_BLOCK


class LoadItem(NamedTuple):
    """One output tensor. `plain`: parts = (p,); `gate_up`: parts = (w1_0, w3_0, w1_1, ...);
    `down`: parts = (w2_0, w2_1, ...)."""

    hf_name: str
    kind: ItemKind
    parts: tuple[StoredPart, ...]


class CheckpointPlan(NamedTuple):
    scheme: str
    items: tuple[LoadItem, ...]
    dropped: tuple[str, ...]  # stored names deliberately not loaded (MTP, unused tensors)
    block: tuple[int, int]


def _stored_format(name: str, hf_name: str, info: TensorInfo) -> StoredFormat:
    if is_integer_buffer(hf_name):
        if info.dtype not in _INTEGER_DTYPES:
            raise ValueError(f"tensor {name!r}: integer buffer stored as {info.dtype}")
        return "integer"
    if info.dtype == "F8_E4M3":
        return "fp8"
    if info.dtype in ("U8", "I8"):
        return "fp4"
    if info.dtype in _PLAIN_DTYPES:
        return "plain"
    raise ValueError(
        f"tensor {name!r}: unsupported stored dtype {info.dtype} (supported: F32/BF16/F16, "
        "F8_E4M3 with block scales, U8/I8 packed MXFP4)"
    )


def _check_part(
    weight: str,
    scale: str | None,
    hf_name: str,
    infos: dict[str, TensorInfo],
    block: tuple[int, int],
) -> StoredPart:
    fmt = _stored_format(weight, hf_name, infos[weight])
    if fmt in ("plain", "integer"):
        if scale is not None:
            raise ValueError(
                f"tensor {scale!r}: scale for {weight!r}, which is stored unquantised "
                f"({infos[weight].dtype})"
            )
        return StoredPart(weight, None, fmt)
    if scale is None:
        raise ValueError(f"tensor {weight!r}: {infos[weight].dtype} weight has no scale tensor")
    scale_info = infos[scale]
    if scale_info.dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"tensor {scale!r}: unsupported scale dtype {scale_info.dtype} "
            f"(supported: {sorted(_SCALE_DTYPES)})"
        )
    shape = infos[weight].shape
    if fmt == "fp8":
        candidates = {block: fp8_block_scale_shape(shape, block)}
    else:
        candidates = {(1, g): mxfp4_scale_shape(shape, g) for g in _FP4_GROUPS}
    for part_block, expected in candidates.items():
        if scale_info.shape == expected:
            return StoredPart(weight, scale, fmt, part_block)
    raise ValueError(
        f"tensor {scale!r}: scale shape {list(scale_info.shape)} does not match "
        f"{fmt} weight {weight!r} of shape {list(shape)} (expected one of "
        f"{[list(e) for e in candidates.values()]})"
    )


def _dequantized_shape(part: StoredPart, infos: dict[str, TensorInfo]) -> tuple[int, ...]:
    shape = infos[part.weight].shape
    return (*shape[:-1], 2 * shape[-1]) if part.fmt == "fp4" else shape


def plan_checkpoint(
    reader: SafetensorsReader, config: ModelConfig, names: NameTable = V4_NAMES
) -> CheckpointPlan:
    """Map and validate every stored tensor of an open checkpoint (headers only), with the
    tensor names of the model's architecture (`names`)."""
    infos = reader.infos
    block = config.quantization.weight_block_size if config.quantization else _DEFAULT_BLOCK
    num_experts = config.n_routed_experts
    weights: dict[str, str] = {}
    scales: dict[str, str] = {}
    expert_parts: dict[str, dict[tuple[int, str, str], str]] = {}
    order: dict[str, None] = {}  # HF names in first-seen order
    dropped: list[str] = []
    all_mapped = []
    for name in infos:
        mapped = parse_checkpoint_name(name, config.num_hidden_layers, num_experts, names)
        if mapped is None:
            dropped.append(name)
            continue
        all_mapped.append(mapped)
        order.setdefault(mapped.hf_name)
        if mapped.expert is not None:
            slots = expert_parts.setdefault(mapped.hf_name, {})
            key = (mapped.expert.expert, mapped.expert.proj, mapped.role)
            if key in slots:
                raise ValueError(f"tensors {slots[key]!r} and {name!r} map to the same expert slot")
            slots[key] = name
            continue
        target = weights if mapped.role == "weight" else scales
        if mapped.hf_name in target:
            raise ValueError(
                f"tensors {target[mapped.hf_name]!r} and {name!r} map to the same name"
            )
        target[mapped.hf_name] = name
    scheme = detect_naming_scheme(all_mapped)
    for hf_name, slots in expert_parts.items():
        stacked = weights.get(hf_name) or scales.get(hf_name)
        if stacked is not None:
            raise ValueError(
                f"tensor {stacked!r} and per-expert tensor {next(iter(slots.values()))!r} both "
                f"provide {hf_name!r}"
            )
    for hf_name, scale_name in scales.items():
        if hf_name not in weights:
            raise ValueError(
                f"tensor {scale_name!r}: scale without a weight (expected {hf_name!r})"
            )

    items = []
    for hf_name in order:
        if hf_name in expert_parts:
            items.append(_plan_experts(hf_name, expert_parts[hf_name], num_experts, infos, block))
            continue
        scale: str | None = scales.get(hf_name)
        if (
            scale is not None
            and names.reads_scale_only_if_fp8(hf_name)
            and infos[weights[hf_name]].dtype != "F8_E4M3"
        ):
            dropped.append(scale)  # the scale of an FP8 table, stored with a plain one
            scale = None
        part = _check_part(weights[hf_name], scale, hf_name, infos, names.block_of(hf_name, block))
        items.append(LoadItem(hf_name, "plain", (part,)))
    return CheckpointPlan(scheme, tuple(items), tuple(dropped), block)


def _plan_experts(
    hf_name: str,
    slots: dict[tuple[int, str, str], str],
    num_experts: int,
    infos: dict[str, TensorInfo],
    block: tuple[int, int],
) -> LoadItem:
    layer = int(hf_name.split(".")[2])
    gate_up = hf_name.endswith("gate_up_proj")
    projs = ("w1", "w3") if gate_up else ("w2",)
    parts = []
    for expert in range(num_experts):
        for proj in projs:
            weight = slots.get((expert, proj, "weight"))
            if weight is None:
                missing = released_expert_name(layer, expert, proj)  # type: ignore[arg-type]
                raise ValueError(
                    f"tensor {missing!r} is missing: {hf_name!r} needs all "
                    f"n_routed_experts={num_experts} experts"
                )
            parts.append(
                _check_part(weight, slots.get((expert, proj, "scale")), hf_name, infos, block)
            )
    for i, proj in enumerate(projs):
        found = {_dequantized_shape(p, infos) for p in parts[i :: len(projs)]}
        if len(found) != 1:
            raise ValueError(
                f"{hf_name!r}: experts' {proj} weights have different shapes {sorted(found)}"
            )
    return LoadItem(hf_name, "gate_up" if gate_up else "down", tuple(parts))


def _read_part(reader: SafetensorsReader, part: StoredPart) -> torch.Tensor:
    tensor = reader.get(part.weight)
    if part.fmt == "fp8":
        assert part.scale is not None
        return dequantize_fp8_block(tensor, reader.get(part.scale), part.block)
    if part.fmt == "fp4":
        assert part.scale is not None
        return dequantize_mxfp4(tensor, reader.get(part.scale), part.block[1])
    return tensor


def _output_dtype(hf_name: str, dtype: torch.dtype) -> torch.dtype:
    if is_integer_buffer(hf_name):
        return torch.int64
    return torch.float32 if is_fp32_param(hf_name) else dtype


def _materialise(reader: SafetensorsReader, item: LoadItem) -> torch.Tensor:
    tensors = [_read_part(reader, p) for p in item.parts]
    if item.kind == "plain":
        return tensors[0]
    if item.kind == "gate_up":
        return torch.stack(
            [torch.cat(tensors[i : i + 2], dim=0) for i in range(0, len(tensors), 2)]
        )
    return torch.stack(tensors)


def _local_experts(item: LoadItem, experts: tuple[int, int] | None) -> LoadItem:
    """`item` reduced to experts [first, first + count) for an expert-parallel rank, which then
    reads none of the other ranks' experts (plain items unchanged)."""
    if experts is None or item.kind == "plain":
        return item
    first, count = experts
    per_expert = 2 if item.kind == "gate_up" else 1
    return item._replace(parts=item.parts[first * per_expert : (first + count) * per_expert])


def _iter_plan(
    model_path: str,
    plan: CheckpointPlan,
    dtype: torch.dtype,
    experts: tuple[int, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    with SafetensorsReader(model_path) as reader:
        for item in plan.items:
            tensor = _materialise(reader, _local_experts(item, experts))
            yield item.hf_name, tensor.to(_output_dtype(item.hf_name, dtype)).contiguous()


def load_checkpoint(
    model_path: str,
    config: ModelConfig,
    dtype: torch.dtype,
    names: NameTable = V4_NAMES,
    experts: tuple[int, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of the checkpoint in `model_path`.

    Accepts released names (per-expert `w1/w2/w3`, `.scale`) or HF names. FP8 and MXFP4 weights
    are dequantised (exactly, in float32) and cast to `dtype`; HF's float32 tensors (mHC, sinks,
    position biases, norms, router bias; see `is_fp32_param`) stay float32, `tid2eid` is int64.
    Routed experts come stacked: `gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`. MTP tensors
    are skipped. `experts=(first, count)`: only those routed experts are read and stacked (an
    expert-parallel rank's slice).

    The checkpoint is validated from its headers before this returns; ValueError names the
    tensor for: no safetensors files, unexpected names, missing experts, a quantised weight
    without scale (or a scale without quantised weight), scale shape mismatch, unsupported
    dtypes (e.g. F8_E5M2).
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    with SafetensorsReader(model_path) as reader:
        plan = plan_checkpoint(reader, config, names)
    formats = Counter(p.fmt for item in plan.items for p in item.parts)
    logger.info(
        "checkpoint %s: %s names, %d tensors (%d fp8, %d mxfp4 parts), %d tensors skipped",
        model_path,
        plan.scheme,
        len(plan.items),
        formats["fp8"],
        formats["fp4"],
        len(plan.dropped),
    )
    return _iter_plan(model_path, plan, dtype, experts)


def load_state_dict(
    model_path: str, config: ModelConfig, dtype: torch.dtype, names: NameTable = V4_NAMES
) -> dict[str, torch.Tensor]:
    """`dict(load_checkpoint(...))`: the whole HF-named state dict in memory."""
    return dict(load_checkpoint(model_path, config, dtype, names))


__all__ = [
    "CheckpointPlan",
    "LoadItem",
    "StoredPart",
    "load_checkpoint",
    "load_state_dict",
    "plan_checkpoint",
]
