"""Weights kept as stored (FP8 block-scaled, MXFP4) inside the model's modules.

A module lists the parameters that may hold a quantised weight (`mark_quantizable`): the
layers whose every read of the weight goes through `module_weight` (the linear groups, the
output projections, the experts). The model runner's materialiser (`model_executor/
weights.py`) stores such a parameter as its packed data under the parameter's own name, with
the E8M0 scales beside it as `<name>_scale` (`store_quantized`); every other parameter is
dequantised at load. `module_weight` hands the readers a `QuantizedWeight` or the plain tensor,
and the linear / MoE implementations dequantise where they compute: inside the Triton kernels,
or per call in the torch backend (`kernels/linear/reference.py` defines the format).
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight

WeightLike = torch.Tensor | QuantizedWeight
_QUANTIZABLE = "_quantizable_params"
_FORMATS = "_quantized_formats"


def mark_quantizable(module: nn.Module, *names: str) -> None:
    """Declare that every read of these parameters of `module` goes through `module_weight`,
    so the materialiser may keep them packed."""
    current = getattr(module, _QUANTIZABLE, ())
    object.__setattr__(module, _QUANTIZABLE, tuple(dict.fromkeys((*current, *names))))


def quantizable(module: nn.Module, name: str) -> bool:
    return name in getattr(module, _QUANTIZABLE, ())


def store_quantized(module: nn.Module, name: str, weight: QuantizedWeight) -> None:
    """Make `module.<name>` the packed data and `module.<name>_scale` the scales (parameters
    without gradient, so the module's `state_dict`, `.to()` and byte counts see them)."""
    if not quantizable(module, name):
        raise ValueError(f"{type(module).__name__}.{name} is not declared quantizable")
    check_quantized_weight(weight, name)
    setattr(module, name, nn.Parameter(weight.data, requires_grad=False))
    setattr(module, f"{name}_scale", nn.Parameter(weight.scale, requires_grad=False))
    formats = dict(getattr(module, _FORMATS, {}))
    formats[name] = (weight.fmt, weight.group)
    object.__setattr__(module, _FORMATS, formats)


def is_quantized(module: nn.Module, name: str = "weight") -> bool:
    return name in getattr(module, _FORMATS, {})


def module_weight(module: nn.Module, name: str = "weight") -> WeightLike:
    """`module.<name>` as its readers take it: a `QuantizedWeight` when stored packed (views of
    the module's current parameters), else the tensor."""
    tensor = getattr(module, name)
    fmt = getattr(module, _FORMATS, {}).get(name)
    if fmt is None:
        return tensor
    return QuantizedWeight(tensor, getattr(module, f"{name}_scale"), *fmt)


def replace_weight(module: nn.Module, name: str, weight: WeightLike) -> None:
    """Point `module.<name>` (and its scales) at new storage of the same format, e.g. views of
    a fused tensor (the parameter objects stay, their `.data` changes)."""
    param = getattr(module, name)
    if isinstance(weight, QuantizedWeight):
        assert is_quantized(module, name), name
        param.data = weight.data
        getattr(module, f"{name}_scale").data = weight.scale
    else:
        assert not is_quantized(module, name), name
        param.data = weight


def weight_kind(weight: WeightLike) -> tuple[object, ...]:
    """Weights of one kind can be stacked into one tensor: dtype and device for plain tensors,
    format, group and device for quantised ones."""
    if isinstance(weight, QuantizedWeight):
        return ("quantized", weight.fmt, weight.group, weight.data.device)
    return ("plain", weight.dtype, weight.device)


def cat_weights(weights: list[WeightLike], dim: int) -> WeightLike:
    """Weights of one kind stacked along `dim` (rows: -2, experts: 0)."""
    first = weights[0]
    if isinstance(first, QuantizedWeight):
        qs = [w for w in weights if isinstance(w, QuantizedWeight)]
        return QuantizedWeight(
            torch.cat([w.data for w in qs], dim=dim),
            torch.cat([w.scale for w in qs], dim=dim),
            first.fmt,
            first.group,
        )
    return torch.cat([w for w in weights if isinstance(w, torch.Tensor)], dim=dim)


def split_rows(weight: WeightLike, sizes: list[int]) -> list[WeightLike]:
    """Row blocks (dim -2) of a weight, as views."""
    if isinstance(weight, QuantizedWeight):
        datas = weight.data.split(sizes, dim=-2)
        scales = weight.scale.split(sizes, dim=-2)
        return [QuantizedWeight(d, s, weight.fmt, weight.group) for d, s in zip(datas, scales)]
    return list(weight.split(sizes, dim=-2))


def index_weight(weight: WeightLike, index: int | slice) -> WeightLike:
    """`weight[index]` along the leading (expert) dim, as a view."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(weight.data[index], weight.scale[index], weight.fmt, weight.group)
    return weight[index]


def unsqueeze_weight(weight: WeightLike) -> WeightLike:
    """A leading dim of one (one matrix as a stack of one expert)."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(weight.data[None], weight.scale[None], weight.fmt, weight.group)
    return weight[None]


def split_rows_into_groups(weight: WeightLike, groups: int) -> WeightLike:
    """`[G * R, K]` -> `[G, R, K]` views (the grouped output projection's weight)."""
    if isinstance(weight, QuantizedWeight):
        return weight.split_rows(groups)
    return weight.view(groups, weight.shape[0] // groups, -1)


def weight_ptr(weight: WeightLike) -> int:
    return (weight.data if isinstance(weight, QuantizedWeight) else weight).data_ptr()


__all__ = [
    "WeightLike",
    "cat_weights",
    "index_weight",
    "is_quantized",
    "mark_quantizable",
    "module_weight",
    "quantizable",
    "replace_weight",
    "split_rows",
    "split_rows_into_groups",
    "store_quantized",
    "unsqueeze_weight",
    "weight_kind",
    "weight_ptr",
]
