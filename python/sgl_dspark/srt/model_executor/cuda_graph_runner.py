"""CUDA-graph runner for the target model (style R23; dspark.md §4).

Captured at startup, largest batch first, into one shared memory pool:

* decode graphs, one per batch-size bucket (1 token per request);
* verify graphs, one per (bucket, W) for the verify widths the DSpark policy may choose: every
  request of a replayed batch has exactly W rows (the worker rounds a step's width up to a
  captured one; rows beyond a request's own verify length are computed but never accepted, and
  their KV is position-addressed state that the real tokens overwrite later).

A replay copies the batch's device tensors into static buffers (`BatchGraphs`, the one
capture/replay mechanism here, also used for the DSpark draft and epilogue) and pads the batch to
the bucket with dummy requests: request slot 0 and token slot 0 (both reserved for padding by the pools),
position 0, so every write of a padding row lands in dummy state. The graph's batch sees the
static context capacity as `max_seq_len`, so its gather widths never depend on the batch.
Nothing in a replay reads device values on the host.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.layers.sampler import Sampler

if TYPE_CHECKING:
    from sgl_dspark.srt.model_executor.model_runner import ModelRunner
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput

logger = logging.getLogger(__name__)

# SGLang-like buckets: dense at small sizes, where padding costs most relative to the batch.
_BS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Captured batch sizes: the buckets below `max_bs`, and `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1 to capture graphs, got {max_bs}")
    return [b for b in _BS_BUCKETS if b < max_bs] + [max_bs]


class Graph(Protocol):
    """One captured region: `capture(fn, batch_size)` runs fn (a step for `batch_size`
    requests) once under capture and returns its outputs; `replay()` re-runs the region,
    rewriting those same output tensors."""

    def capture(self, fn: Callable[[], Any], batch_size: int) -> Any: ...

    def replay(self) -> None: ...


class CudaGraph:
    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self.pool, self.stream = pool, stream
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any], batch_size: int) -> Any:
        # The batch decides whether the Triton kernels launch programmatically (baked into the
        # graph's kernel nodes at capture).
        from sgl_dspark.kernels._triton_utils import programmatic_launch_for_batch

        with (
            programmatic_launch_for_batch(batch_size),
            torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream),
        ):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """Stand-in with CUDA-graph semantics for CPU tests of the padding and buffer logic: replay
    re-runs the function and copies its results into the tensors the capture returned."""

    def capture(self, fn: Callable[[], Any], batch_size: int) -> Any:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        copy_outputs(self.fn(), self.out)


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


def make_graph_factory(device: torch.device) -> Callable[[], Graph]:
    """Real CUDA graphs sharing one memory pool on CUDA; the eager stand-in elsewhere."""
    if device.type != "cuda":
        return EagerGraph
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    return lambda: CudaGraph(pool, stream)


def reserved_mib(device: torch.device) -> float:
    """MiB reserved by PyTorch's allocator on a CUDA device (where the graphs' pool lives; free
    device memory is no measure: capture itself can return cached blocks to the driver)."""
    return torch.cuda.memory_reserved(device) / 2**20 if device.type == "cuda" else 0.0


def warm_up(fn: Callable[[], Any], device: torch.device, batch_size: int, iters: int = 2) -> None:
    """Run fn before capture (Triton compilation, cuBLAS workspaces) on a side stream, with the
    launch kind the capture for `batch_size` will use (so nothing compiles during capture)."""
    if device.type != "cuda":
        return
    from sgl_dspark.kernels._triton_utils import programmatic_launch_for_batch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), programmatic_launch_for_batch(batch_size):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


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


class BatchGraphs:
    """Graphs of a batch-first function `fn(*inputs)` per batch-size bucket (the DSpark draft).

    `pad_values[i]` fills row b >= B of input i for a batch of B rows padded to its bucket; the
    outputs (tensors with the batch in dim 0, in any tuple/dict tree) are returned as rows [:B].
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        pad_values: Sequence[float | int | bool],
        batch_sizes: Sequence[int],
        device: torch.device,
        graph_factory: Callable[[], Graph] | None = None,
        name: str = "graphs",
    ) -> None:
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.pad_values = tuple(pad_values)
        self.static = [
            torch.empty((self.max_bs, *x.shape[1:]), dtype=x.dtype, device=device)
            for x in example_inputs
        ]
        self._graphs: dict[int, tuple[Graph, Any]] = {}
        self.replays = 0  # replays so far (tests and debugging read it)
        factory = graph_factory or make_graph_factory(device)
        t0 = time.perf_counter()
        for buf, v in zip(self.static, self.pad_values):
            buf.fill_(v)
        for bs in reversed(self.batch_sizes):
            run = functools.partial(fn, *(buf[:bs] for buf in self.static))
            graph = factory()
            with torch.inference_mode():
                warm_up(run, device, bs)
                out = graph.capture(run, bs)
            self._graphs[bs] = (graph, out)
        logger.info(
            "Captured %d %s (bs %s) in %.1f s",
            len(self._graphs),
            name,
            self.batch_sizes,
            time.perf_counter() - t0,
        )

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch_size), None)

    def replay(self, *inputs: torch.Tensor) -> Any:
        B = inputs[0].shape[0]
        bs = self.bucket_for(B)
        assert bs is not None, B
        for buf, x, v in zip(self.static, inputs, self.pad_values):
            buf[:B].copy_(x)
            if bs > B:
                buf[B:bs].fill_(v)
        graph, out = self._graphs[bs]
        graph.replay()
        self.replays += 1
        return _slice_rows(out, B)


class CudaGraphRunner:
    """Target graphs per (bucket, width): one `BatchGraphs` per width over the batch-first
    inputs [B, W] (ids, positions, token slots) and [B] (request slots, prefix and sequence
    lengths); padding requests get slot 0, position 0 and token slot 0."""

    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: Sequence[int],
        widths: Sequence[int],
        tap_layers: tuple[int, ...] = (),
        graph_factory: Callable[[], Graph] | None = None,
    ) -> None:
        self.runner = runner
        self.batch_sizes = sorted(set(batch_sizes))
        self.widths = sorted(set(widths))
        if self.widths[0] < 1 or self.widths[-1] > runner.rc.max_verify_tokens:
            raise ValueError(
                f"captured verify widths {self.widths} must lie in "
                f"[1, max_verify_tokens={runner.rc.max_verify_tokens}]"
            )
        if self.batch_sizes[-1] > runner.req_pool.size - 1:
            raise ValueError(
                f"--cuda-graph-max-bs {self.batch_sizes[-1]} exceeds "
                f"--max-running-requests {runner.req_pool.size - 1}"
            )
        self.tap_layers = tap_layers
        self._sampler = Sampler(runner.kernels)
        dev = runner.device
        factory = graph_factory or make_graph_factory(dev)  # one memory pool for all widths
        t0 = time.perf_counter()
        mem0 = reserved_mib(dev)
        self._by_width: dict[int, BatchGraphs] = {}
        for w in reversed(self.widths):
            tokens = torch.zeros((1, w), dtype=torch.int64, device=dev)
            reqs = torch.zeros(1, dtype=torch.int64, device=dev)
            self._by_width[w] = BatchGraphs(
                functools.partial(self._forward, w),
                (tokens,) * 3 + (reqs,) * 3,
                (0, 0, 0, 0, 0, w),
                self.batch_sizes,
                dev,
                factory,
                name=f"target graphs (width {w})",
            )
        mem = reserved_mib(dev) - mem0
        logger.info(
            "Captured %d target graphs (bs %s x widths %s) in %.1f s, +%.0f MiB reserved",
            len(self.batch_sizes) * len(self.widths),
            self.batch_sizes,
            self.widths,
            time.perf_counter() - t0,
            mem,
        )

    def _forward(
        self,
        w: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[Any, ...]:
        """The captured region: a uniform-width batch built from the static inputs (its row
        tables are made inside the capture, so replays recompute them), outputs as [B, W, ...].
        Every width runs the runner's tap hook; width 1 (the decode graph) also runs the greedy
        sampler, so an all-greedy decode step is one replay with nothing left for the host to
        launch."""
        bs = req_pool_indices.shape[0]
        pool = self.runner.req_pool
        batch = ForwardBatch.uniform(
            ForwardMode.DECODE if w == 1 else ForwardMode.VERIFY,
            input_ids,
            positions,
            out_cache_loc,
            req_pool_indices,
            prefix_lens,
            seq_lens,
            pool.req_to_token,
            pool.max_context_len,
        )
        out = self.runner.run_model(batch, self.tap_layers)
        logits = out.logits.view(bs, w, -1)
        taps = {k: v.view(bs, w, *v.shape[1:]) for k, v in out.tap_streams.items()}
        if w != 1:
            self.runner.join_tap_hook()
            return logits, taps
        greedy = self._sampler.greedy(out.logits)
        self.runner.join_tap_hook()
        return (
            logits,
            taps,
            greedy.next_token_ids.view(bs, 1),
            greedy.next_token_logprobs.view(bs, 1),
        )

    # ---- replay --------------------------------------------------------------------------
    def width_for(self, width: int) -> int | None:
        """Smallest captured width >= width (None: wider than every graph)."""
        return next((w for w in self.widths if w >= width), None)

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch_size), None)

    def can_run(self, batch: ForwardBatch, tap_layers: tuple[int, ...]) -> bool:
        if batch.mode is ForwardMode.EXTEND or not set(tap_layers) <= set(self.tap_layers):
            return False
        lens = batch.extend_lens_cpu
        w = lens[0]
        return (
            all(n == w for n in lens)
            and w in self.widths
            and self.bucket_for(len(lens)) is not None
            and batch.logits_indices.shape[0] == batch.num_tokens
        )

    def replay(self, batch: ForwardBatch, tap_layers: tuple[int, ...]) -> ModelOutput:
        from sgl_dspark.srt.models.deepseek_v4 import ModelOutput

        B, n = batch.batch_size, batch.num_tokens
        w = n // B
        logits, taps, *greedy = self._by_width[w].replay(
            batch.input_ids.view(B, w),
            batch.positions.view(B, w),
            batch.out_cache_loc.view(B, w),
            batch.req_pool_indices,
            batch.prefix_lens,
            batch.seq_lens,
        )
        out = ModelOutput(
            logits=logits.reshape(n, -1), tap_streams={k: taps[k].flatten(0, 1) for k in tap_layers}
        )
        if greedy:
            out.greedy_ids, out.greedy_logprobs = greedy[0].reshape(n), greedy[1].reshape(n)
        return out
