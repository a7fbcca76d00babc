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
    _record_format(module, name, weight)


def _record_format(module: nn.Module, name: str, weight: QuantizedWeight) -> None:
    formats = dict(getattr(module, _FORMATS, {}))
    formats[name] = (weight.fmt, weight.group, weight.block_rows)
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
        _record_format(module, name, weight)
    else:
        assert not is_quantized(module, name), name
        param.data = weight


def weight_kind(weight: WeightLike) -> tuple[object, ...]:
    """Weights of one kind can be stacked into one tensor: dtype and device for plain tensors,
    format, scale group and device for quantised ones."""
    if isinstance(weight, QuantizedWeight):
        return ("quantized", weight.fmt, weight.group, weight.data.device)
    return ("plain", weight.dtype, weight.device)


def cat_weights(weights: list[WeightLike], dim: int) -> WeightLike:
    """Weights of one kind stacked along `dim` (rows: -2, experts: 0). Quantised rows keep their
    scale blocks when every member but the last fills whole blocks, else the stack has one
    scale row per row."""
    first = weights[0]
    if not isinstance(first, QuantizedWeight):
        return torch.cat([w for w in weights if isinstance(w, torch.Tensor)], dim=dim)
    qs = [w for w in weights if isinstance(w, QuantizedWeight)]
    rows = {w.block_rows for w in qs}
    whole = all(w.data.shape[-2] % w.block_rows == 0 for w in qs[:-1]) if dim == -2 else True
    if len(rows) > 1 or not whole:
        qs = [w.per_row() for w in qs]
    return qs[0]._replace(
        data=torch.cat([w.data for w in qs], dim=dim),
        scale=torch.cat([w.scale for w in qs], dim=dim),
    )


def row_slice(weight: WeightLike, start: int, stop: int) -> WeightLike:
    """Rows [start, stop) as a view (`start` on a scale-block boundary)."""
    if not isinstance(weight, QuantizedWeight):
        return weight[..., start:stop, :]
    bo = weight.block_rows
    assert start % bo == 0, (start, bo)
    return weight._replace(
        data=weight.data[..., start:stop, :],
        scale=weight.scale[..., start // bo : -(-stop // bo), :],
    )


def split_rows(weight: WeightLike, sizes: list[int]) -> list[WeightLike]:
    """Row blocks (dim -2) of a stacked weight, as views."""
    out, start = [], 0
    for size in sizes:
        out.append(row_slice(weight, start, start + size))
        start += size
    return out


def index_weight(weight: WeightLike, index: int | slice) -> WeightLike:
    """`weight[index]` along the leading (expert) dim, as a view."""
    if isinstance(weight, QuantizedWeight):
        return weight._replace(data=weight.data[index], scale=weight.scale[index])
    return weight[index]


def unsqueeze_weight(weight: WeightLike) -> WeightLike:
    """A leading dim of one (one matrix as a stack of one expert)."""
    if isinstance(weight, QuantizedWeight):
        return weight._replace(data=weight.data[None], scale=weight.scale[None])
    return weight[None]


def split_rows_into_groups(weight: WeightLike, groups: int) -> WeightLike:
    """The grouped output projection's weight: `[G * R, K]` -> `[G, R, K]` views when plain; a
    quantised weight stays `[G * R, K]` (its scale blocks may span groups), which the grouped
    linear takes as it is."""
    if isinstance(weight, QuantizedWeight):
        return weight
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
