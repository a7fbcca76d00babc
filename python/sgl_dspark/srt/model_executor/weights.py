"""Build a model on the meta device and materialise each tensor straight onto its device.

The model's constructor runs under `torch.device("meta")`: parameters get shapes, no memory.
Derived buffers that constructors compute (rope frequencies, expert-sort tables, Engram hash
constants) are built on the host explicitly and moved to the device afterwards. Each parameter
and persistent buffer is then created on the device from its source:

* a `torch.Tensor` (tests, built-in models): copied over in the target dtype;
* a checkpoint tensor (`model_loader.CheckpointTensor`): read part by part (one expert's matrix
  at a time) onto the device, where it is dequantised, or, with `native`, kept as stored
  (FP8 / MXFP4 in the runtime layout) when its module reads it through
  `layers/quantized.py::module_weight`;
* a random tensor (`dummy.DummyTensor`, `--load-format dummy`): generated on the device, in the
  checkpoint's declared formats when `native`.

Host memory holds one stored part at a time, whatever the model size. Tensors named by
`host_resident` (the Engram hash tables with `--engram-table-location host`) are instead filled
into page-locked host memory, in row chunks of a tensor that can be read by rows, and stay
there: the kernels that read them do so over the bus. The dtype of a dense
tensor: integer buffers keep theirs, HF's fp32 parameters (mHC, sinks, biases, norms) stay fp32,
every other float tensor takes the runtime dtype.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sized
from typing import TypeVar

import torch
from torch import nn
from tqdm import tqdm

from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.srt.distributed.sharding import shard_spec
from sgl_dspark.srt.layers.quantized import quantizable, store_quantized
from sgl_dspark.srt.model_loader.sources import LazyTensor, WeightFactory, WeightSource

logger = logging.getLogger(__name__)

# Parameters HF keeps in fp32 when the model runs in bf16: mHC, sinks, biases, norms.
_FP32_PARAM_SUFFIXES = (
    "attn_hc.fn",
    "attn_hc.base",
    "attn_hc.scale",
    "ffn_hc.fn",
    "ffn_hc.base",
    "ffn_hc.scale",
    "hc_head.hc_fn",
    "hc_head.hc_base",
    "hc_head.hc_scale",
    "sinks",
    "position_bias",
    "e_score_correction_bias",
    "norm.weight",
)
# Parameter names (substrings) counted as embeddings / output heads in the load report.
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "markov_head", "engram.embed")

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_PARAM_SUFFIXES) or "layernorm" in name


# The runner's weight formats: "native" keeps quantised sources as stored where the module allows
# it, "bf16" dequantises every tensor to the runtime dtype (named after the usual one).
WEIGHT_FORMATS = ("native", "bf16")


def build_on_meta(build: Callable[[], ModuleT]) -> ModuleT:
    """`build()` with every factory function on the meta device (no parameter memory)."""
    with torch.device("meta"):
        return build()


def _target_dtype(name: str, meta: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if not meta.is_floating_point():
        return meta.dtype
    return torch.float32 if keeps_fp32(name) else dtype


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def materialise(
    model: ModuleT,
    weights: Iterable[tuple[str, WeightSource]],
    device: torch.device | str,
    dtype: torch.dtype,
    native: bool,
    what: str = "model",
    host_resident: Callable[[str], bool] | None = None,
) -> ModuleT:
    """Create every parameter and persistent buffer of the meta-built `model` on `device` from
    `weights` (module doc), then move its derived buffers there. Every tensor must be provided
    once with the model's shape, and no unknown name may appear (ValueError naming the tensor).
    `native`: keep quantised sources as stored where their module allows it. `host_resident`:
    names of tensors to place in page-locked host memory instead (a GPU `device` only)."""
    device = torch.device(device)
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update({k: v for k, v in model.named_buffers() if k in model.state_dict()})
    seen: set[str] = set()
    total = len(weights) if isinstance(weights, Sized) else None
    bar = tqdm(
        weights,
        total=total,
        desc=f"Loading {what}",
        unit="tensor",
        disable=not logger.isEnabledFor(logging.INFO),
        mininterval=2.0,
    )
    start = time.perf_counter()
    for name, source in bar:
        if name not in targets:
            raise ValueError(f"checkpoint tensor {name!r} does not belong to the {what}")
        if name in seen:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        meta = targets[name]
        source = _rank_slice(name, source, meta)
        if tuple(source.shape) != tuple(meta.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, "
                f"the {what} expects {tuple(meta.shape)}"
            )
        module, attr = _owner(model, name)
        keep_packed = (
            native
            and not isinstance(source, torch.Tensor)
            and source.fmt is not None
            and quantizable(module, attr)
        )
        if host_resident is not None and host_resident(name):
            target = _target_dtype(name, meta, dtype)
            host = host_copy_of(source, keep_packed, target, generate_on=device)
            if isinstance(host, QuantizedWeight):
                store_quantized(module, attr, host)
            else:
                _assign(module, attr, host, meta)
        elif isinstance(source, torch.Tensor):
            tensor = source.to(device=device, dtype=_target_dtype(name, meta, dtype))
            _assign(module, attr, tensor.contiguous(), meta)
        elif keep_packed:
            store_quantized(module, attr, source.quantized(device))
        else:
            _assign(module, attr, source.dense(device, _target_dtype(name, meta, dtype)), meta)
        seen.add(name)
    bar.close()
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]}{more}")
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            raise ValueError(
                f"{what} buffer {name!r} is still on the meta device: a constructor must build "
                "derived buffers on the host (device='cpu')"
            )
        if buf.device != device:
            module, attr = _owner(model, name)
            module._buffers[attr] = buf.to(device)
    report = load_report(model)
    logger.info(
        "loaded %s in %.1f s on %s: %s",
        what,
        time.perf_counter() - start,
        device,
        ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in report.items()),
    )
    return model.eval()


# Rows read per step when filling a page-locked host tensor from a source that reads by rows:
# host memory then holds one chunk beside the destination, not a second copy of the table.
_HOST_CHUNK_BYTES = 1 << 28
_CHUNK_ROW_MULTIPLE = 128


def host_copy_of(
    source: WeightSource,
    keep_packed: bool,
    dtype: torch.dtype,
    pin: bool = True,
    chunk_bytes: int = _HOST_CHUNK_BYTES,
    generate_on: torch.device | str = "cpu",
) -> torch.Tensor | QuantizedWeight:
    """`source` in host memory, page-locked when `pin`: kept as stored when `keep_packed`, else
    dense in `dtype`. A lazy source that reads by rows (`narrow`: a checkpoint tensor) and holds
    more than `chunk_bytes` is read in row chunks straight into the destination. A source that
    cannot be read by rows (random weights) is made on `generate_on`, the device a device-placed
    copy would be made on, so that its values do not depend on the placement."""

    def read(src: WeightSource, device: torch.device | str) -> torch.Tensor | QuantizedWeight:
        if isinstance(src, torch.Tensor):
            return src.to(device=device, dtype=dtype)
        return src.quantized(device) if keep_packed else src.dense(device, dtype)

    narrow = None if isinstance(source, torch.Tensor) else getattr(source, "narrow", None)
    nbytes = int(source.nbytes)
    if narrow is None or nbytes <= chunk_bytes:
        generated = narrow is None and not isinstance(source, torch.Tensor)
        whole = read(source, generate_on if generated else "cpu")
        if not pin:
            return _map(whole, lambda t: t.cpu())
        return _map(whole, lambda t: _empty_host(t.shape, t.dtype, pin).copy_(t))
    rows = source.shape[0]
    # Whole scale blocks per chunk (every FP8 block height divides 128), so each chunk reads
    # as stored.
    step = max(_CHUNK_ROW_MULTIPLE, chunk_bytes * rows // nbytes)
    step -= step % _CHUNK_ROW_MULTIPLE
    out: torch.Tensor | QuantizedWeight | None = None
    for start in range(0, rows, step):
        part = read(narrow(0, start, min(step, rows - start)), "cpu")
        if out is None:
            out = _empty_like(part, rows, pin)
        _copy_rows(out, part, start)
    assert out is not None
    return out


def _map(
    t: torch.Tensor | QuantizedWeight, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | QuantizedWeight:
    if isinstance(t, QuantizedWeight):
        return t._replace(data=fn(t.data), scale=fn(t.scale))
    return fn(t)


def _empty_host(shape: Iterable[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


def _empty_like(
    part: torch.Tensor | QuantizedWeight, rows: int, pin: bool
) -> torch.Tensor | QuantizedWeight:
    """An empty host tensor (page-locked when `pin`) of `rows` rows in `part`'s format."""

    def empty(t: torch.Tensor, n: int) -> torch.Tensor:
        return _empty_host((n, *t.shape[1:]), t.dtype, pin)

    if isinstance(part, QuantizedWeight):
        scale_rows = -(-rows // part.block_rows)
        return part._replace(data=empty(part.data, rows), scale=empty(part.scale, scale_rows))
    return empty(part, rows)


def _copy_rows(
    out: torch.Tensor | QuantizedWeight, part: torch.Tensor | QuantizedWeight, start: int
) -> None:
    if isinstance(out, QuantizedWeight):
        assert isinstance(part, QuantizedWeight)
        out.data[start : start + part.data.shape[0]].copy_(part.data)
        first = start // out.block_rows
        out.scale[first : first + part.scale.shape[0]].copy_(part.scale)
    else:
        assert isinstance(part, torch.Tensor)
        out[start : start + part.shape[0]].copy_(part)


def _rank_slice(name: str, source: WeightSource, meta: torch.Tensor) -> WeightSource:
    """`source` narrowed to the slice a parallel rank's parameter holds (`ShardSpec`), before
    anything is read: a lazy source then reads (or moves to the device) only that slice. A
    source that already has the slice's size (an expert-parallel checkpoint plan) is kept."""
    spec = shard_spec(meta)
    if spec is None or len(source.shape) <= spec.dim:
        return source
    size = source.shape[spec.dim]
    if size == meta.shape[spec.dim]:
        return source
    if size % spec.parts:
        raise ValueError(
            f"checkpoint tensor {name!r}: dimension {spec.dim} of size {size} does not split "
            f"into {spec.parts} shards"
        )
    step = size // spec.parts
    if isinstance(source, torch.Tensor):
        return source.narrow(spec.dim, spec.part * step, step)
    narrow = getattr(source, "narrow", None)
    if narrow is None:
        raise ValueError(f"checkpoint tensor {name!r}: its source cannot be read by slices")
    sliced: WeightSource = narrow(spec.dim, spec.part * step, step)
    return sliced


def _assign(module: nn.Module, attr: str, tensor: torch.Tensor, meta: torch.Tensor) -> None:
    if isinstance(meta, nn.Parameter):
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    else:
        module._buffers[attr] = tensor


def load_report(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters and buffers by kind: routed experts (the stacked expert
    weights and their scales), embeddings (token embeddings and output heads), dense (the
    rest), and host (page-locked host tensors of a GPU model: not on the device). Tensors that
    share storage (fused views) count once."""
    from sgl_dspark.srt.layers.moe.experts import RoutedExperts

    expert_ids = {
        id(t)
        for m in model.modules()
        if isinstance(m, RoutedExperts)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    }
    kinds = {"experts": 0, "embeddings": 0, "dense": 0, "host_pinned": 0}
    seen: set[tuple[int, int]] = set()
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.is_meta or key in seen:
            continue
        seen.add(key)
        kind = (
            "host_pinned"
            if t.device.type == "cpu" and t.is_pinned()
            else "experts"
            if id(t) in expert_ids
            else "embeddings"
            if any(s in name for s in _EMBEDDING_NAMES)
            else "dense"
        )
        kinds[kind] += t.untyped_storage().nbytes()
    return kinds


__all__ = [
    "WEIGHT_FORMATS",
    "LazyTensor",
    "WeightFactory",
    "WeightSource",
    "build_on_meta",
    "host_copy_of",
    "keeps_fp32",
    "load_report",
    "materialise",
]
