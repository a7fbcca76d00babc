"""Graphs of prefill (EXTEND) forwards, one per token-count bucket.

An eager prefill forward is host-bound at small batches (Python and launch overhead exceed its
kernels); replayed from a graph it costs its kernels.

A batch of n tokens over B requests runs in the graph of the smallest bucket T >= n, with
`max_requests + 1` request rows. Padding tokens (rows n..T-1) belong to one padding request
(request slot 0, token slot 0, position 0: both slots are reserved by the pools), so every
write of theirs lands in dummy state; the request rows past B are padding requests with slot 0
and no tokens. The graph's batch sees the static context capacity as `max_seq_len` and builds
its compressor row lists on the device (`ForwardBatch.host_lens` False), so the capture depends
on no host length. Logits are computed for `max_requests + 1` rows; a replay returns the rows the
batch asked for. The tap consumer (DSpark's context-KV writer) runs inside the graph, as in the
decode graphs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.model_executor.cuda_graph_runner import CudaGraphRunner, bucket_for

if TYPE_CHECKING:
    from sgl_dspark.srt.model_executor.model_runner import ModelRunner, TapConsumer
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput

_TOKEN_FIELDS = ("input_ids", "positions", "token_req", "out_cache_loc")
_REQUEST_FIELDS = ("req_pool_indices", "prefix_lens", "seq_lens")


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """Captured token counts: the powers of two from 16 below `max_tokens`, and `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"prefill graph token limit must be >= 1, got {max_tokens}")
    buckets, t = [], 16
    while t < max_tokens:
        buckets.append(t)
        t *= 2
    return buckets + [max_tokens]


FAMILY = "prefill"


class PrefillGraphs:
    def __init__(
        self,
        graphs: CudaGraphRunner,
        runner: ModelRunner,
        max_tokens: int,
        max_requests: int,
        consumer: TapConsumer | None,
    ) -> None:
        if not 1 <= max_requests <= runner.req_pool.size - 1:
            raise ValueError(
                f"prefill graphs for {max_requests} requests: must lie in "
                f"[1, --max-running-requests {runner.req_pool.size - 1}]"
            )
        self.graphs = graphs
        self.runner = runner
        self.consumer = consumer
        self.buckets = prefill_token_buckets(max_tokens)
        self.max_requests = max_requests
        dev = runner.device
        rows = max_requests + 1  # the last request row is always padding
        self._tokens = {
            k: torch.zeros(self.buckets[-1], dtype=torch.int64, device=dev) for k in _TOKEN_FIELDS
        }
        self._requests = {
            k: torch.zeros(rows, dtype=torch.int64, device=dev) for k in _REQUEST_FIELDS
        }
        self._logits_rows = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._tokens["token_req"].fill_(max_requests)  # captured on padding only
        for t in self.buckets:
            graphs.register(FAMILY, t, functools.partial(self._forward, t), launch_batch=t)

    @property
    def replays(self) -> int:
        return self.graphs.replays[FAMILY]

    def _forward(self, t: int) -> torch.Tensor:
        """The captured region: an EXTEND batch over rows [:t] of the static buffers."""
        pool = self.runner.req_pool
        tok = {k: v[:t] for k, v in self._tokens.items()}
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            **tok,
            **self._requests,
            logits_indices=self._logits_rows,
            req_to_token=pool.req_to_token,
            max_seq_len=pool.max_context_len,
            extend_lens_cpu=(),
            prefix_lens_cpu=(),
            host_lens=False,
        )
        out = self.runner.run_model(batch, (), self.consumer)
        self.runner.join_taps()
        return out.shard_logits

    def bucket_for(self, num_tokens: int) -> int | None:
        return bucket_for(self.buckets, num_tokens)

    def can_run(self, batch: ForwardBatch, tap_layers: tuple[int, ...]) -> bool:
        return (
            batch.mode is ForwardMode.EXTEND
            and batch.host_lens
            and not tap_layers
            and self.bucket_for(batch.num_tokens) is not None
            and batch.batch_size <= self.max_requests
            and batch.logits_indices.shape[0] <= self.max_requests + 1
        )

    def replay(self, batch: ForwardBatch) -> ModelOutput:
        from sgl_dspark.srt.models.deepseek_v4 import ModelOutput

        n, b, n_logits = batch.num_tokens, batch.batch_size, batch.logits_indices.shape[0]
        t = self.bucket_for(n)
        assert t is not None, n
        for k, buf in self._tokens.items():
            buf[:n].copy_(getattr(batch, k))
            # padding rows: token 0 at position 0 of the padding request b, token slot 0
            buf[n:t].fill_(b if k == "token_req" else 0)
        for k, buf in self._requests.items():
            buf[:b].copy_(getattr(batch, k))
            buf[b:].zero_()
        self._logits_rows[:n_logits].copy_(batch.logits_indices)
        self._logits_rows[n_logits:].zero_()
        logits = self.graphs.replay(FAMILY, t)
        return ModelOutput(logits[:n_logits], {}, self.runner.model.logits_reader)
