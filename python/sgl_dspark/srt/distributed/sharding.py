"""Which slice of a checkpoint tensor a sharded parameter holds.

A parameter that holds part of a checkpoint tensor carries a `ShardSpec` (`mark_shard`); the
loader narrows the full tensor to that slice (`shard_for`), so a rank keeps only its part.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ShardSpec(NamedTuple):
    """Slice `part` of `parts` equal slices along `dim`."""

    dim: int
    part: int
    parts: int


_ATTR = "parallel_shard"


def mark_shard(param: torch.Tensor, dim: int, index: int, count: int) -> None:
    """Record that `param` holds slice `index` of `count` along `dim` (no-op for count 1)."""
    if count > 1:
        setattr(param, _ATTR, ShardSpec(dim, index, count))


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The slice `param` holds (`mark_shard`), or None for a whole tensor."""
    return getattr(param, _ATTR, None)


def shard_for(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` narrowed to the slice `param` holds (`full` itself for an unsharded parameter,
    or when it already has the slice's size). The full size must split evenly."""
    spec: ShardSpec | None = getattr(param, _ATTR, None)
    if spec is None:
        return full
    size = full.shape[spec.dim]
    if size == param.shape[spec.dim]:
        return full  # already this rank's slice (a loader that reads by slice)
    if size % spec.parts:
        raise ValueError(
            f"dimension {spec.dim} of size {size} does not split into {spec.parts} shards"
        )
    step = size // spec.parts
    return full.narrow(spec.dim, spec.part * step, step)


def split_evenly(total: int, count: int, what: str, flag: str) -> int:
    """`total // count`, or a ValueError naming what cannot be split and the flag."""
    if total % count:
        raise ValueError(f"{what} ({total}) must be divisible by {flag} {count}")
    return total // count
