"""The executor of plain steps: one flat target forward over the step's prompt chunks and decode
tokens, sampling where a token is due, and the read-back of the sampled tokens.

It owns the target's forward graphs (decode / verify per width, prefill per token bucket) and
the sampler; DSpark's executor runs its prefill and plain-decode steps through it and its verify
forwards through `forward`. With the overlap schedule, a decode step of the same requests chains
onto the step in flight: its input tokens are that step's sampled ids, still on the device, and
its positions and sampling counters account for the one token the host has not seen yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.host_copy import PendingRead
from sgl_dspark.srt.core.step import BaseStepExecutor, InflightStep, ReqUpdate, StepWork
from sgl_dspark.srt.layers.sampler import Sampler, SamplerOutput, SamplingBatchInfo
from sgl_dspark.srt.model_executor.prefill_graphs import PrefillGraphs
from sgl_dspark.srt.model_executor.target_graphs import TargetGraphs

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sgl_dspark.srt.model_executor.model_runner import ModelRunner, TapConsumer
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput


class DecodeStep(InflightStep):
    """A launched plain step: its sampled ids stay on the device (the next chained step's
    input) while their host copy is under way."""

    kind = "decode"

    def __init__(
        self,
        work: StepWork,
        sampled: list[bool],
        next_ids: torch.Tensor,
        host: PendingRead,
    ) -> None:
        self.work = work
        self.sampled = sampled  # per request of work.reqs: whether a token was sampled
        self.next_ids = next_ids  # [number of sampled requests] int64, on the device
        self.host = host
        self.chainable = not work.prefill

    @property
    def reqs(self) -> tuple[Req, ...]:
        return self.work.reqs

    def wait(self) -> list[ReqUpdate]:
        ids, lps = self.host.wait()
        tokens = iter(zip(ids, lps))
        updates = []
        for (req, chunk), sampled in zip(self.work.prefill, self.sampled):
            tok = next(tokens) if sampled else None
            updates.append(
                ReqUpdate(req, len(chunk), (tok[0],) if tok else (), (tok[1],) if tok else ())
            )
        for req in self.work.decode:
            tok, lp = next(tokens)
            updates.append(ReqUpdate(req, 1, (tok,), (lp,)))
        return updates


class DecodeExecutor(BaseStepExecutor):
    def __init__(
        self,
        runner: ModelRunner,
        consumer: TapConsumer | None = None,
        step_window: int = 1,
    ) -> None:
        """`consumer`: runs on the taps of every target forward (DSpark's context-KV writer).
        `step_window`: KV positions a step may write past a request's committed length."""
        self.runner = runner
        self.consumer = consumer
        self.sampler = Sampler(runner.kernels)
        self._step_window = step_window
        self.target_graphs: TargetGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    @property
    def step_window(self) -> int:
        return self._step_window

    def register_graphs(
        self,
        graphs: CudaGraphRunner,
        batch_sizes: Sequence[int],
        widths: Sequence[int] = (1,),
        prefill_max_tokens: int = 0,
    ) -> None:
        """Register the target's decode (width 1) and verify (wider) graphs for `batch_sizes`
        and, with `prefill_max_tokens` > 0, prefill graphs for up to that many tokens of up to
        `max(batch_sizes)` requests. Needs a forward without host synchronisation: the torch
        MoE backend reads expert counts on the host, so CUDA graphs require `moe=triton`."""
        runner = self.runner
        if runner.device.type == "cuda" and runner.kernels.of("moe") != "triton":
            raise ValueError(
                "CUDA graphs need the sync-free MoE path: use --kernel-backend triton "
                "(or --kernel-backend-overrides moe=triton), or --disable-cuda-graph"
            )
        self.target_graphs = TargetGraphs(
            graphs, runner, self.sampler, batch_sizes, widths, self.consumer
        )
        if prefill_max_tokens > 0:
            self.prefill_graphs = PrefillGraphs(
                graphs, runner, prefill_max_tokens, max(batch_sizes), self.consumer
            )

    # ---- the target forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, tap_layers: tuple[int, ...] = ()) -> ModelOutput:
        """The target forward of `batch` with the consumer on its taps: a graph replay where one
        fits, else eager."""
        if batch.mode is not ForwardMode.EXTEND:
            graphs = self.target_graphs
            if graphs is not None and graphs.can_run(batch, tap_layers):
                return graphs.replay(batch)
        elif self.prefill_graphs is not None and self.prefill_graphs.can_run(batch, tap_layers):
            return self.prefill_graphs.replay(batch)
        return self.runner.forward(batch, tap_layers, self.consumer)

    def graph_width_for(self, batch_size: int, width: int) -> int | None:
        """The captured verify width that runs `batch_size` requests of up to `width` rows in
        one replay, or None when no graph does."""
        graphs = self.target_graphs
        if graphs is None or graphs.bucket_for(batch_size) is None:
            return None
        return graphs.width_for(width)

    # ---- steps --------------------------------------------------------------------------------
    def can_chain(self, work: StepWork, prev: InflightStep) -> bool:
        return (
            isinstance(prev, DecodeStep)
            and prev.chainable
            and not work.prefill
            and len(work.decode) == len(prev.work.decode)
            and all(a is b for a, b in zip(work.decode, prev.work.decode))
        )

    def launch(self, work: StepWork, prev: InflightStep | None) -> DecodeStep:
        """One forward over `work` (prompt chunks, then decode tokens), sampling the last prompt
        token of a completed prompt and every decode token. `prev`: a decode step of exactly
        these requests still in flight, whose sampled ids are this step's inputs."""
        chained = isinstance(prev, DecodeStep)
        assert prev is None or (chained and not work.prefill), "only decode steps chain"
        lag = 1 if chained else 0  # tokens sampled for these requests, not yet appended
        ids: list[list[int]] = [list(chunk) for _, chunk in work.prefill]
        ids += [[0] if chained else [r.output_ids[-1]] for r in work.decode]
        reqs = work.reqs
        # Logits only where a token is sampled: the last prompt token and every decode token.
        sampled = [r.kv_len + len(chunk) >= len(r.prompt_ids) for r, chunk in work.prefill]
        sampled += [True] * len(work.decode)
        rows = [[len(x) - 1] if s else [] for x, s in zip(ids, sampled)]
        mode = ForwardMode.EXTEND if work.prefill else ForwardMode.DECODE
        pool = self.runner.req_pool
        batch = ForwardBatch.build(
            mode,
            ids,
            [r.kv_len + lag for r in reqs],
            [r.slot for r in reqs],
            pool.req_to_token,
            logits_rows=rows,
            input_ids_device=prev.next_ids if isinstance(prev, DecodeStep) else None,
        )
        out = self.forward(batch)
        sampled_reqs = [r for r, s in zip(reqs, sampled) if s]
        res = self._sample(sampled_reqs, out, lag)
        host = PendingRead(res.next_token_ids, res.next_token_logprobs)
        return DecodeStep(work, sampled, res.next_token_ids, host)

    def _sample(self, reqs: list[Req], out: ModelOutput, lag: int) -> SamplerOutput:
        """One token per logits row of `out` (rows in `reqs` order), left on the device. A
        decode graph already computed the greedy choice, which an all-greedy batch takes as is
        (the same ops as the sampler); otherwise the sampler runs with the batch record.
        `lag`: tokens sampled for these requests but not appended yet (sampling counters)."""
        if not reqs:
            empty = out.logits.new_zeros((0,), dtype=torch.int64)
            return SamplerOutput(empty, out.logits.new_zeros((0,)))
        if out.greedy_ids is not None and all(r.params.is_greedy for r in reqs):
            assert out.greedy_logprobs is not None
            return SamplerOutput(out.greedy_ids, out.greedy_logprobs)
        info = SamplingBatchInfo.from_params(
            [r.params for r in reqs],
            out.logits.shape[1],
            out.logits.device,
            counters=[len(r.output_ids) + lag for r in reqs],
        )
        return self.sampler(out.logits, info)
