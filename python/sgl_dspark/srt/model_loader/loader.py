"""Read a DeepSeek-V4 checkpoint directory and yield HF-named, dequantised tensors.

The whole checkpoint is validated from the safetensors headers before any tensor data is read
(`plan_checkpoint`), so naming, scale and dtype errors surface at once, each as a ValueError that
names the tensor. `load_checkpoint` then reads one output tensor at a time.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from sgl_dspark.kernels.linear.reference import QuantizedWeight
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
    fp8_block_to_runtime,
    mxfp4_scale_shape,
    mxfp4_to_runtime,
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
# Bytes per element of the stored dtypes wider than one byte.
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2}
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


def _output_dtype(hf_name: str, dtype: torch.dtype) -> torch.dtype:
    if is_integer_buffer(hf_name):
        return torch.int64
    return torch.float32 if is_fp32_param(hf_name) else dtype


def _part_rows(item: LoadItem, index: int, rows: int) -> tuple[int | None, slice]:
    """Where part `index` of `item` lands in the output: (expert or None, row slice)."""
    if item.kind == "plain":
        return None, slice(None)
    if item.kind == "gate_up":
        start = (index % 2) * rows
        return index // 2, slice(start, start + rows)
    return index, slice(None)


def _scale_rows(rows: slice, count: int, block_rows: int) -> slice:
    """The scale rows of a part whose weight rows are `rows` (its first row starts a block)."""
    if rows.start is None:
        return slice(None)
    start = rows.start // block_rows
    return slice(start, start + count)


class CheckpointTensor:
    """One model tensor of an open checkpoint, read part by part straight onto a device when
    asked: `dense(device, dtype)` dequantised, or `quantized(device)` kept as stored (FP8 /
    MXFP4 in the runtime layout of `kernels/linear/reference.py`). Host memory holds one stored
    part (one expert's matrix, or one plain tensor) at a time."""

    def __init__(self, reader: SafetensorsReader, item: LoadItem) -> None:
        self._reader = reader
        self.item = item
        infos = reader.infos
        self.part_shape = _dequantized_shape(item.parts[0], infos)
        rows, *rest = self.part_shape
        if item.kind == "plain":
            self.shape: tuple[int, ...] = self.part_shape
        elif item.kind == "gate_up":
            self.shape = (len(item.parts) // 2, 2 * rows, *rest)
        else:
            self.shape = (len(item.parts), rows, *rest)
        formats = {(p.fmt, p.block) for p in item.parts}
        fmt, block = next(iter(formats))
        # The stored format when every part shares it (FP8 with one block, MXFP4 with one group).
        self.fmt: str | None = fmt if len(formats) == 1 and fmt in ("fp8", "fp4") else None
        self._block = block
        # (dim, start, length): a plain tensor narrowed to a tensor-parallel rank's slice.
        self._slice: tuple[int, int, int] | None = None
        self.nbytes = sum(
            math.prod(infos[name].shape) * _DTYPE_BYTES.get(infos[name].dtype, 1)
            for p in item.parts
            for name in (p.weight, p.scale)
            if name is not None
        )

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """This tensor's slice [start, start + length) along `dim` (a parallel rank's part).
        An expert stack is sliced along its expert dim only, and reads only those experts. A
        plain tensor reads only the slice's rows (and scale rows) when the slice lies on block
        borders, else its stored part whole, on the host for a plain dtype; the device holds
        the slice only, except for a quantised part cut inside its blocks, which is
        dequantised whole on the device first."""
        if self.item.kind != "plain":
            if dim != 0:
                raise ValueError(
                    f"{self.item.hf_name!r}: an expert stack splits along its expert dim only"
                )
            per_expert = 2 if self.item.kind == "gate_up" else 1
            parts = self.item.parts[start * per_expert : (start + length) * per_expert]
            return CheckpointTensor(self._reader, self.item._replace(parts=parts))
        if self._slice is not None:
            raise ValueError(f"{self.item.hf_name!r} is already a slice")
        out = CheckpointTensor(self._reader, self.item)
        shape = list(self.shape)
        out.nbytes = self.nbytes * length // shape[dim]
        shape[dim] = length
        out.shape = tuple(shape)
        out._slice = (dim, start, length)
        return out

    def _read_slice(self, part: StoredPart, device: torch.device | str) -> torch.Tensor:
        """The slice (`narrow`) of plain part `part` on `device`, dequantised (float32) when
        stored quantised."""
        assert self._slice is not None
        dim, start, length = self._slice
        stop = start + length
        if part.fmt not in ("fp8", "fp4"):
            if dim == 0:
                return self._reader.get(part.weight, rows=slice(start, stop)).to(device)
            return self._reader.get(part.weight).narrow(dim, start, length).contiguous().to(device)
        assert part.scale is not None
        block = part.block[dim]  # FP8: (rows, cols) per scale; MXFP4: (1, group)
        full = self.part_shape[dim]
        packed = 2 if part.fmt == "fp4" and dim == 1 else 1  # two FP4 values per byte
        if start % block == 0 and (length % block == 0 or stop == full):
            s_start, s_stop = start // block, -(-stop // block)
            if dim == 0:
                stored = self._reader.get(part.weight, rows=slice(start, stop))
                scale = self._reader.get(part.scale, rows=slice(s_start, s_stop))
            else:
                stored = self._reader.get(part.weight)[:, start // packed : stop // packed]
                scale = self._reader.get(part.scale)[:, s_start:s_stop]
            stored, scale = stored.contiguous().to(device), scale.contiguous().to(device)
            if part.fmt == "fp8":
                return dequantize_fp8_block(stored, scale, part.block)
            return dequantize_mxfp4(stored, scale, part.block[1])
        whole = self._reader.get(part.weight).to(device)
        scale = self._reader.get(part.scale).to(device)
        if part.fmt == "fp8":
            whole = dequantize_fp8_block(whole, scale, part.block)
        else:
            whole = dequantize_mxfp4(whole, scale, part.block[1])
        return whole.narrow(dim, start, length)

    def dense(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor on `device` in `dtype` (quantised parts dequantised exactly on the
        device, then rounded once to `dtype`)."""
        out = torch.empty(self.shape, dtype=dtype, device=device)
        if self._slice is not None:
            return out.copy_(self._read_slice(self.item.parts[0], device))
        rows = self.part_shape[0]
        for i, part in enumerate(self.item.parts):
            stored = self._reader.get(part.weight).to(device)
            if part.fmt == "fp8":
                assert part.scale is not None
                scale = self._reader.get(part.scale).to(device)
                stored = dequantize_fp8_block(stored, scale, part.block)
            elif part.fmt == "fp4":
                assert part.scale is not None
                scale = self._reader.get(part.scale).to(device)
                stored = dequantize_mxfp4(stored, scale, part.block[1])
            expert, row_slice = _part_rows(self.item, i, rows)
            target = out if expert is None else out[expert]
            target[row_slice].copy_(stored)
        return out

    def quantized(self, device: torch.device | str) -> QuantizedWeight:
        """The tensor kept as stored, on `device`; ValueError (naming the tensor) when it is not
        stored in one quantised format or its format has no native support."""
        if self.fmt is None:
            raise ValueError(f"{self.item.hf_name!r} is not stored in one quantised format")
        if self._slice is not None:
            return self._quantized_slice(device)
        rows = self.part_shape[0]
        block_rows = self._block[0] if self.fmt == "fp8" else 1
        if len(self.item.parts) > 1 and rows % block_rows:
            block_rows = 1  # the parts' blocks do not tile the stack: one scale row per row
        data = scale = None
        for i, part in enumerate(self.item.parts):
            assert part.scale is not None
            stored = self._reader.get(part.weight).to(device)
            stored_scale = self._reader.get(part.scale).to(device)
            what = f"tensor {part.weight!r}"
            if part.fmt == "fp8":
                qw = fp8_block_to_runtime(stored, stored_scale, part.block, what)
            else:
                qw = mxfp4_to_runtime(stored, stored_scale, part.block[1], what)
            if block_rows == 1:
                qw = qw.per_row()
            if data is None or scale is None:
                lead, n = self.shape[:-2], self.shape[-2]
                data = torch.empty(
                    (*lead, n, qw.data.shape[-1]), dtype=qw.data.dtype, device=device
                )
                scale_rows = -(-n // block_rows)
                scale = torch.empty(
                    (*lead, scale_rows, qw.scale.shape[-1]), dtype=torch.uint8, device=device
                )
            expert, row_slice = _part_rows(self.item, i, rows)
            (data if expert is None else data[expert])[row_slice].copy_(qw.data)
            scale_slice = _scale_rows(row_slice, qw.scale.shape[-2], block_rows)
            (scale if expert is None else scale[expert])[scale_slice].copy_(qw.scale)
        assert data is not None and scale is not None
        fmt = "fp8" if self.fmt == "fp8" else "mxfp4"
        return QuantizedWeight(data, scale, fmt, self._block[1], block_rows)

    def _quantized_slice(self, device: torch.device | str) -> QuantizedWeight:
        """The slice (`narrow`) of a plain quantised tensor kept as stored, reading only its
        rows (and their scale rows) for a row slice. Rows may be cut anywhere: a slice whose
        first row lies inside an FP8 scale block takes one scale row per weight row. Input
        channels are cut on scale-group borders only (a ValueError naming the tensor
        otherwise: a group's scale would be shared by two ranks' channels)."""
        assert self._slice is not None and self.fmt is not None
        part = self.item.parts[0]
        assert part.scale is not None
        dim, start, length = self._slice
        stop = start + length
        block = part.block[dim]  # FP8: (rows, cols) per scale; MXFP4: (1, group)
        what = f"tensor {part.weight!r} [{start}:{stop}] along dim {dim}"
        fp8 = self.fmt == "fp8"
        if dim == 1:
            if start % block or (stop % block and stop != self.part_shape[1]):
                raise ValueError(
                    f"{what}: the slice cuts its {block}-channel scale groups, so it is not "
                    "kept as stored; run with --weight-format bf16"
                )
            packed = 1 if fp8 else 2  # two FP4 values per byte
            stored = self._reader.get(part.weight)[:, start // packed : stop // packed]
            scale = self._reader.get(part.scale)[:, start // block : -(-stop // block)]
            row_block = part.block
        else:
            s_start, s_stop = start // block, -(-stop // block)
            stored = self._reader.get(part.weight, rows=slice(start, stop))
            scale = self._reader.get(part.scale, rows=slice(s_start, s_stop))
            row_block = part.block
            if start % block:
                # Each weight row takes its block's scale row (a block of one row).
                first = start - s_start * block
                scale = scale.repeat_interleave(block, dim=0)[first : first + length]
                row_block = (1, part.block[1])
        stored, scale = stored.contiguous().to(device), scale.contiguous().to(device)
        if fp8:
            return fp8_block_to_runtime(stored, scale, row_block, what)
        return mxfp4_to_runtime(stored, scale, part.block[1], what)


class CheckpointWeights:
    """A checkpoint's tensors as `(hf_name, CheckpointTensor)`, validated from the headers when
    built (`plan_checkpoint`); iterating opens the files, and each tensor is read when asked.
    `experts=(first, count)`: the routed-expert stacks hold only those experts (an
    expert-parallel rank's slice), and the other experts are never read."""

    def __init__(
        self,
        model_path: str,
        config: ModelConfig,
        names: NameTable = V4_NAMES,
        experts: tuple[int, int] | None = None,
    ) -> None:
        self.model_path = model_path
        with SafetensorsReader(model_path) as reader:
            plan = plan_checkpoint(reader, config, names)
        self.plan = plan._replace(items=tuple(_local_experts(i, experts) for i in plan.items))
        formats = Counter(p.fmt for item in self.plan.items for p in item.parts)
        logger.info(
            "checkpoint %s: %s names, %d tensors (%d fp8, %d mxfp4 parts), %d tensors skipped",
            model_path,
            self.plan.scheme,
            len(self.plan.items),
            formats["fp8"],
            formats["fp4"],
            len(self.plan.dropped),
        )

    def __len__(self) -> int:
        return len(self.plan.items)

    def __iter__(self) -> Iterator[tuple[str, CheckpointTensor]]:
        with SafetensorsReader(self.model_path) as reader:
            for item in self.plan.items:
                yield item.hf_name, CheckpointTensor(reader, item)


def _local_experts(item: LoadItem, experts: tuple[int, int] | None) -> LoadItem:
    """`item` reduced to experts [first, first + count) for an expert-parallel rank, which then
    reads none of the other ranks' experts (plain items unchanged)."""
    if experts is None or item.kind == "plain":
        return item
    first, count = experts
    per_expert = 2 if item.kind == "gate_up" else 1
    return item._replace(parts=item.parts[first * per_expert : (first + count) * per_expert])


def load_checkpoint(
    model_path: str,
    config: ModelConfig,
    dtype: torch.dtype,
    names: NameTable = V4_NAMES,
    experts: tuple[int, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of the checkpoint in `model_path`, dequantised
    on the host (`CheckpointWeights` reads the same tensors lazily, onto any device, optionally
    kept as stored).

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
    weights = CheckpointWeights(model_path, config, names, experts)
    return ((name, t.dense("cpu", _output_dtype(name, dtype)).contiguous()) for name, t in weights)


def load_state_dict(
    model_path: str, config: ModelConfig, dtype: torch.dtype, names: NameTable = V4_NAMES
) -> dict[str, torch.Tensor]:
    """`dict(load_checkpoint(...))`: the whole HF-named state dict in memory."""
    return dict(load_checkpoint(model_path, config, dtype, names))


__all__ = [
    "CheckpointPlan",
    "CheckpointTensor",
    "CheckpointWeights",
    "LoadItem",
    "StoredPart",
    "load_checkpoint",
    "load_state_dict",
    "plan_checkpoint",
]
