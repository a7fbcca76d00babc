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

Host memory holds one stored part at a time, whatever the model size. The dtype of a dense
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
) -> ModuleT:
    """Create every parameter and persistent buffer of the meta-built `model` on `device` from
    `weights` (module doc), then move its derived buffers there. Every tensor must be provided
    once with the model's shape, and no unknown name may appear (ValueError naming the tensor).
    `native`: keep quantised sources as stored where their module allows it."""
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
        if isinstance(source, torch.Tensor):
            tensor = source.to(device=device, dtype=_target_dtype(name, meta, dtype))
            _assign(module, attr, tensor.contiguous(), meta)
        elif native and source.fmt is not None and quantizable(module, attr):
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
    rest). Tensors that share storage (fused views) count once."""
    from sgl_dspark.srt.layers.moe.experts import RoutedExperts

    expert_ids = {
        id(t)
        for m in model.modules()
        if isinstance(m, RoutedExperts)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    }
    kinds = {"experts": 0, "embeddings": 0, "dense": 0}
    seen: set[tuple[int, int]] = set()
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.is_meta or key in seen:
            continue
        seen.add(key)
        kind = (
            "experts"
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
    "keeps_fp32",
    "load_report",
    "materialise",
]
