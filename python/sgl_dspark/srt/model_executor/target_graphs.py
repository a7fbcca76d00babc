"""Graphs of the target's decode and verify forwards, one per (batch bucket, verify width W).

Every request of a replayed batch has exactly W rows: width 1 is the decode graph; wider graphs
serve DSpark verify steps, which round a step's width up to a captured one (rows beyond a
request's own verify length are computed but never accepted, and their KV is position-addressed
state that the real tokens overwrite later). The graph's batch sees the static context capacity
as `max_seq_len`, so its gather widths never depend on the batch; padding requests get request
slot 0, position 0 and token slot 0, which the pools reserve for them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.model_executor.cuda_graph_runner import BatchGraphs, CudaGraphRunner, bucket_for

if TYPE_CHECKING:
    from sgl_dspark.srt.model_executor.model_runner import ModelRunner, TapConsumer
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput

FAMILY = "target width {}"


class TargetGraphs:
    """One `BatchGraphs` per width over the batch-first inputs [B, W] (ids, positions, token
    slots) and [B] (request slots, prefix and sequence lengths). Every width runs `consumer` on
    its taps; width 1 also picks the greedy tokens (`ModelOutput.greedy`: under tensor
    parallelism through the shard pairs, never a logits gather), so an all-greedy decode step
    is one replay with nothing left for the host to launch. The graphs return this rank's
    logits columns; a step that needs whole rows gathers them after the replay."""

    def __init__(
        self,
        graphs: CudaGraphRunner,
        runner: ModelRunner,
        batch_sizes: Sequence[int],
        widths: Sequence[int],
        consumer: TapConsumer | None,
    ) -> None:
        self.runner = runner
        self.consumer = consumer
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
        dev = runner.device
        self._by_width: dict[int, BatchGraphs] = {}
        for w in self.widths:
            tokens = torch.zeros((1, w), dtype=torch.int64, device=dev)
            reqs = torch.zeros(1, dtype=torch.int64, device=dev)
            self._by_width[w] = BatchGraphs(
                graphs,
                FAMILY.format(w),
                functools.partial(self._forward, w),
                (tokens,) * 3 + (reqs,) * 3,
                (0, 0, 0, 0, 0, w),
                self.batch_sizes,
            )

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self._by_width.values())

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
        tables are made inside the capture, so replays recompute them), outputs as [B, W, ...]."""
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
        out = self.runner.run_model(batch, (), self.consumer)
        logits = out.shard_logits.view(bs, w, -1)
        if w != 1:
            self.runner.join_taps()
            return (logits,)
        greedy = out.greedy()
        self.runner.join_taps()
        return (logits, greedy.ids.view(bs, 1), greedy.logprobs.view(bs, 1))

    def width_for(self, width: int) -> int | None:
        """Smallest captured width >= width (None: wider than every graph)."""
        return bucket_for(self.widths, width)

    def bucket_for(self, batch_size: int) -> int | None:
        return bucket_for(self.batch_sizes, batch_size)

    def can_run(self, batch: ForwardBatch, tap_layers: tuple[int, ...]) -> bool:
        if batch.mode is ForwardMode.EXTEND or tap_layers:
            return False
        lens = batch.extend_lens_cpu
        w = lens[0]
        return (
            all(n == w for n in lens)
            and w in self.widths
            and self.bucket_for(len(lens)) is not None
            and batch.logits_indices.shape[0] == batch.num_tokens
        )

    def replay(self, batch: ForwardBatch) -> ModelOutput:
        from sgl_dspark.srt.models.deepseek_v4 import ModelOutput

        B, n = batch.batch_size, batch.num_tokens
        w = n // B
        logits, *greedy = self._by_width[w].replay(
            batch.input_ids.view(B, w),
            batch.positions.view(B, w),
            batch.out_cache_loc.view(B, w),
            batch.req_pool_indices,
            batch.prefix_lens,
            batch.seq_lens,
        )
        out = ModelOutput(logits.reshape(n, -1), {}, self.runner.model.logits_reader)
        if greedy:
            out.greedy_ids, out.greedy_logprobs = greedy[0].reshape(n), greedy[1].reshape(n)
        return out
