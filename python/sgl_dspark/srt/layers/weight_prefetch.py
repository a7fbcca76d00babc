"""Weights pulled into L2 while a decode step's latency-bound kernels leave HBM idle.

At decode sizes a layer alternates GEMMs that stream their weights from HBM with stretches of
kernels that read almost nothing: the mHC boundary before each sublayer, the router, and in
the attention everything between the query projection and the output projection (the rope and
KV store, the cache decode, the indexer, the attention itself). A model names, at the start of
each such stretch, the weights of the GEMM that ends it (`WeightPrefetch.issue`); inside a CUDA
graph capture the hint (`kernels/prefetch/l2.py::l2_prefetch`) then runs on a side stream forked
there, so it starts when the GEMM before the stretch has finished streaming and runs beside
the stretch instead of before it. The forward joins the side stream once at its end
(`WeightPrefetch.join`); the graph's main chain never waits for a hint.

What the stretches hold in the models: V4.1 (`deepseek_v41.py`) names the attention's x
projection before the boundary that opens it, the grouped output projection o_a once the
query projection is launched, and the router's gate and the shared expert's gate-up rows
before the boundary that opens the FFN.

The budget (bytes a stretch may hint, `--l2-prefetch-mib`) is process-wide, like the
programmatic launch switch: the last engine built decides, at graph capture. Eagerly (and
off NVIDIA GPUs) nothing is hinted: the stream switches would cost host time where the host
bounds the step. A hint changes no result bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.srt.layers.quantized import WeightLike


class _Budget:
    bytes = 0  # per stretch; `set_l2_prefetch_budget` sets it (no `global` statement)


def set_l2_prefetch_budget(mib: int) -> None:
    """Bytes (MiB) each stretch may hint into L2 from now on, process-wide; 0 turns hints
    off. Read when a graph is captured."""
    if mib < 0:
        raise ValueError(f"--l2-prefetch-mib must be >= 0, got {mib}")
    _Budget.bytes = mib << 20


def l2_prefetch_budget() -> int:
    """Bytes a stretch may hint (0: off)."""
    return _Budget.bytes


def weight_regions(weights: Iterable[WeightLike | None]) -> list[torch.Tensor]:
    """The tensors a GEMM streams for these weights, in the order its programs need them: a
    quantised weight's scales (small, read at every K step) before its stored bytes; None
    entries are skipped."""
    regions: list[torch.Tensor] = []
    for w in weights:
        if w is None:
            continue
        if isinstance(w, QuantizedWeight):
            regions += [w.scale, w.data]
        else:
            regions.append(w)
    return regions


class WeightPrefetch:
    """A model's hints and their side stream (module doc); one per model."""

    def __init__(self) -> None:
        self._side: torch.cuda.Stream | None = None
        self._joiner: torch.cuda.Stream | None = None  # the stream that forked, until it joins
        self.issued = 0  # hints launched (tests read it)

    def issue(
        self, device: torch.device, weights: Callable[[], Iterable[WeightLike | None]]
    ) -> None:
        """Hint the leading bytes of `weights()` (`weight_regions`, up to the budget) beside
        the current stream's next kernels, if a graph is being captured on an NVIDIA GPU
        `device` (`weights` is called only then: no host work in an eager step)."""
        budget = l2_prefetch_budget()
        if budget == 0 or device.type != "cuda" or torch.version.hip is not None:
            return
        capturing = torch.cuda.is_current_stream_capturing()
        if self._side is None or self._side.device != device:
            if capturing:
                raise RuntimeError("WeightPrefetch: first called inside a graph capture")
            # Made on the first call, an eager one: a graph runner warms up before it captures.
            self._side = torch.cuda.Stream(device)
        if not capturing:
            return
        regions = [r for r in weight_regions(weights()) if r.numel() > 0]
        if not regions:
            return
        from sgl_dspark.kernels.prefetch.l2 import l2_prefetch

        current = torch.cuda.current_stream(device)
        self._side.wait_stream(current)  # after the GEMM before the stretch
        with torch.cuda.stream(self._side):
            l2_prefetch(regions, budget)
        self._joiner = current
        self.issued += 1

    def join(self) -> None:
        """Order the forking stream's next work after every hint launched (no-op if none): a
        capture must end on the stream it began on with every fork joined."""
        if self._joiner is not None:
            assert self._side is not None
            self._joiner.wait_stream(self._side)
            self._joiner = None


__all__ = ["WeightPrefetch", "l2_prefetch_budget", "set_l2_prefetch_budget", "weight_regions"]
