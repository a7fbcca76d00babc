"""The one CUDA graph runner: every graphed region of the engine is registered here and captured
at startup, largest first, into one memory pool.

Families that own static input buffers (target decode/verify graphs per width, prefill graphs
per token bucket, the DSpark draft and acceptance graphs, the fused DSpark steps) register one
region per key (`CudaGraphRunner.register`) and replay it by key; `capture()` then warms up and
captures all of them and logs the count, time and memory once. Regions share the pool: replays
run one at a time on one stream, and every region's outputs stay referenced, so no later capture
allocates over them. A region captured earlier may still use the memory of a later one's outputs
for its intermediates (it freed that memory before the later capture took it), so a region's
outputs are valid until another region replays: a step reads them before its next replay, or
copies them out (the async confidence policy's relay takes the draft's confidences before the
verify forward).

`BatchGraphs` is the common family shape: a batch-first function captured per batch bucket,
whose replay copies the inputs into static buffers, pads the rows past the batch with fixed
values (padding requests point at the reserved request slot 0 and token slot 0, so their writes
land in dummy state) and returns the outputs' first rows.

On CPU the graphs are `EagerGraph` stand-ins with CUDA-graph buffer semantics (tests). With
`EagerGraph.poison_by_default` (set by `pytest --poison-stale-graph-outputs`) they also
enforce the pool rule above: replaying a region poisons the outputs that regions captured after
it allocated (NaN, a large negative integer, flipped booleans), the memory a GPU replay may have
reused for its intermediates, so a step that reads another region's outputs after a replay gets
garbage on the CPU as it could on a GPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

# Dense at small sizes, where padding costs most relative to the batch.
_BS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Captured batch sizes: the buckets below `max_bs`, and `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1 to capture graphs, got {max_bs}")
    return [b for b in _BS_BUCKETS if b < max_bs] + [max_bs]


def bucket_for(buckets: Sequence[int], size: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `size`, or None when none does."""
    return next((b for b in buckets if b >= size), None)


class Graph(Protocol):
    """One captured region: `capture(fn, launch_batch)` runs fn once under capture and returns
    its outputs; `replay()` re-runs the region, rewriting those same output tensors."""

    def capture(self, fn: Callable[[], Any], launch_batch: int) -> Any: ...

    def replay(self) -> None: ...


GraphFactory = Callable[[], Graph]


class CudaGraph:
    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self.pool, self.stream = pool, stream
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any], launch_batch: int) -> Any:
        # The batch decides whether the Triton kernels launch programmatically (baked into the
        # graph's kernel nodes at capture).
        from sgl_dspark.kernels._triton_utils import programmatic_launch_for_batch

        with (
            programmatic_launch_for_batch(launch_batch),
            torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream),
        ):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


# What a poisoned integer output holds: far outside every index, length and token id.
_POISON_INT = -(2**30) + 7


class EagerGraph:
    """Stand-in with CUDA-graph semantics for CPU tests of the padding and buffer logic: replay
    re-runs the function and copies its results into the tensors the capture returned.

    `pool_outputs` lists the outputs a GPU capture would allocate in the graph pool (the ones
    `fn` allocates, not views of buffers it was given), found only when poisoning is on (the
    module doc) by calling `fn` a second time: a fresh output has new memory on every call."""

    poison_by_default = False  # the test runner's switch (module doc)

    def __init__(self, poison: bool | None = None) -> None:
        self.poison = type(self).poison_by_default if poison is None else poison
        self.pool_outputs: list[torch.Tensor] = []

    def capture(self, fn: Callable[[], Any], launch_batch: int) -> Any:
        self.fn = fn
        self.out = fn()
        if self.poison:
            again = _leaves(fn())
            self.pool_outputs = [
                a for a, b in zip(_leaves(self.out), again) if a.data_ptr() != b.data_ptr()
            ]
        return self.out

    def replay(self) -> None:
        copy_outputs(self.fn(), self.out)


def _leaves(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _leaves(v)]
    return []


def poison(t: torch.Tensor) -> None:
    """Overwrite `t` with values no correct reader can take for data."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(_POISON_INT if t.dtype.is_signed else torch.iinfo(t.dtype).max)


def copy_outputs(src: Any, dst: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            copy_outputs(src[k], dst[k])
    elif isinstance(dst, (tuple, list)):
        for s, d in zip(src, dst):
            copy_outputs(s, d)
    elif dst is not None:
        raise TypeError(f"graph outputs must be tensors in tuples/dicts, got {type(dst)}")


def warm_up(fn: Callable[[], Any], device: torch.device, launch_batch: int, iters: int = 2) -> None:
    """Run fn before capture (Triton compilation, cuBLAS workspaces) on a side stream, with the
    launch kind its capture will use (so nothing compiles during capture)."""
    if device.type != "cuda":
        return
    from sgl_dspark.kernels._triton_utils import programmatic_launch_for_batch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), programmatic_launch_for_batch(launch_batch):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


@dataclass
class _Region:
    family: str
    key: Hashable
    fn: Callable[[], Any]
    launch_batch: int  # the batch size that decides the launch kind (programmatic or plain)
    size: int  # capture order: larger first, so smaller regions reuse its pool blocks
    reset: Callable[[], None] | None  # restores static state after warm-up and after capture


class CudaGraphRunner:
    """Registry and owner of every captured region (see the module doc)."""

    def __init__(self, device: torch.device, graph_factory: GraphFactory | None = None) -> None:
        self.device = device
        if graph_factory is None:
            if device.type != "cuda":
                raise ValueError(
                    "CUDA graphs need a CUDA device (tests pass an EagerGraph factory)"
                )
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(device)
            graph_factory = functools.partial(CudaGraph, pool, stream)
        self._factory = graph_factory
        self._pending: list[_Region] = []
        self._graphs: dict[tuple[str, Hashable], tuple[Graph, Any]] = {}
        # Per region, the pool outputs of the regions captured after it (poisoning stand-ins).
        self._clobbers: dict[tuple[str, Hashable], list[torch.Tensor]] = {}
        self.replays: Counter[str] = Counter()  # per family (tests and debugging read it)

    def register(
        self,
        family: str,
        key: Hashable,
        fn: Callable[[], Any],
        launch_batch: int,
        size: int | None = None,
        reset: Callable[[], None] | None = None,
    ) -> None:
        """Add a region to capture: `fn()` reads only static buffers and returns its outputs
        (tensors in tuples/dicts), which every `replay(family, key)` rewrites."""
        if (family, key) in self._graphs or any(
            r.family == family and r.key == key for r in self._pending
        ):
            raise ValueError(f"graph {family} {key} registered twice")
        region = _Region(
            family, key, fn, launch_batch, launch_batch if size is None else size, reset
        )
        self._pending.append(region)

    def capture(self) -> None:
        """Capture every registered region (largest first) and log once what it cost."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        mem0 = torch.cuda.memory_reserved(self.device) if cuda else 0
        regions = sorted(self._pending, key=lambda r: r.size, reverse=True)
        self._pending = []
        for r in regions:
            graph = self._factory()
            with torch.inference_mode():
                warm_up(r.fn, self.device, r.launch_batch)
                if r.reset is not None:
                    r.reset()
                out = graph.capture(r.fn, r.launch_batch)
                if r.reset is not None:
                    r.reset()
            self._graphs[(r.family, r.key)] = (graph, out)
        self._note_clobbers([(r.family, r.key) for r in regions])
        counts = Counter(r.family for r in regions)
        mem = (torch.cuda.memory_reserved(self.device) - mem0) / 2**20 if cuda else 0.0
        logger.info(
            "Captured %d CUDA graphs in %.1f s, +%.0f MiB reserved: %s",
            len(regions),
            time.perf_counter() - t0,
            mem,
            ", ".join(f"{n} {family}" for family, n in counts.items()),
        )

    def _note_clobbers(self, captured: list[tuple[str, Hashable]]) -> None:
        """After a capture round: each region's replay may reuse the pool memory of the outputs
        of every region captured after it (this round's later regions and any later round)."""
        later: list[torch.Tensor] = []
        for name in reversed(captured):
            self._clobbers[name] = list(later)
            later += getattr(self._graphs[name][0], "pool_outputs", [])
        for name, clobbers in self._clobbers.items():
            if name not in captured:
                clobbers += later

    def has(self, family: str, key: Hashable) -> bool:
        return (family, key) in self._graphs

    def graph(self, family: str, key: Hashable) -> Graph:
        """The captured graph of a region (benchmarks replay it alone)."""
        return self._graphs[(family, key)][0]

    def replay(self, family: str, key: Hashable) -> Any:
        """Replay a captured region; returns its (rewritten) outputs."""
        graph, out = self._graphs[(family, key)]
        with torch.inference_mode():  # (an eager stand-in rewrites the captured outputs)
            graph.replay()
            for t in self._clobbers.get((family, key), ()):
                poison(t)
        self.replays[family] += 1
        return out


def _slice_rows(x: Any, n: int) -> Any:
    """Rows [:n] of every tensor in a (named) tuple / dict tree; other leaves unchanged."""
    if isinstance(x, torch.Tensor):
        return x[:n]
    if isinstance(x, dict):
        return {k: _slice_rows(v, n) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_slice_rows(v, n) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_slice_rows(v, n) for v in x)
    return x


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements of the same memory."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


class BatchGraphs:
    """A batch-first function `fn(*inputs)` registered with `graphs` per batch bucket.

    `pad_values[i]` fills rows b >= B of input i for a batch of B rows padded to its bucket; the
    outputs (tensors with the batch in dim 0, in any tuple/dict tree) are returned as rows [:B].

    `static[i]`, when given, is input i's buffer (rows >= the largest bucket) instead of a new
    one: families whose replays feed each other or take the same large input share buffers
    (replays run one at a time, and each copies all its inputs first). An input that already
    is its buffer's rows (a graph's output that another graph reads) is not copied.
    """

    def __init__(
        self,
        graphs: CudaGraphRunner,
        family: str,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        pad_values: Sequence[float | int | bool],
        batch_sizes: Sequence[int],
        static: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        self.graphs = graphs
        self.family = family
        self.batch_sizes = sorted(set(batch_sizes))
        self.pad_values = tuple(pad_values)
        max_bs = self.batch_sizes[-1]
        dev = graphs.device
        given = list(static) if static is not None else [None] * len(example_inputs)
        if len(given) != len(example_inputs):
            raise ValueError(
                f"{family}: {len(given)} static buffers for {len(example_inputs)} inputs"
            )
        self.static = []
        for i, (x, buf) in enumerate(zip(example_inputs, given)):
            if buf is None:
                buf = torch.empty((max_bs, *x.shape[1:]), dtype=x.dtype, device=dev)
            elif buf.shape[0] < max_bs or buf.shape[1:] != x.shape[1:] or buf.dtype != x.dtype:
                raise ValueError(
                    f"{family}: static buffer {i} is {buf.dtype} {tuple(buf.shape)}, needs "
                    f"{x.dtype} ({max_bs}+, {', '.join(map(str, x.shape[1:]))})"
                )
            self.static.append(buf)
        for buf, v in zip(self.static, self.pad_values):
            buf.fill_(v)
        for bs in self.batch_sizes:
            run = functools.partial(fn, *(buf[:bs] for buf in self.static))
            graphs.register(family, bs, run, launch_batch=bs)

    def bucket_for(self, batch_size: int) -> int | None:
        return bucket_for(self.batch_sizes, batch_size)

    @property
    def replays(self) -> int:
        return self.graphs.replays[self.family]

    def replay(self, *inputs: torch.Tensor) -> Any:
        B = inputs[0].shape[0]
        bs = self.bucket_for(B)
        assert bs is not None, B
        for buf, x, v in zip(self.static, inputs, self.pad_values):
            rows = buf[:B]
            if not _same_view(rows, x):
                rows.copy_(x)
            if bs > B:
                buf[B:bs].fill_(v)
        return _slice_rows(self.graphs.replay(self.family, bs), B)
