"""The all-greedy DSpark step as one CUDA graph per (batch bucket, verify width W).

One replay runs the draft forward and Markov loop, the target's verify forward over
[anchor, d_1 .. d_{W-1}] at positions seq .. seq + W - 1 (its token slots looked up on the
device) with the draft's context KV of its rows, acceptance and the committed tokens' logprobs:
the same ops as the executor's separate draft / verify / epilogue graphs, without their host
round trips (verify batch built on the host, logits copied into the epilogue's buffers).

The step's next state (anchors = bonus tokens, sequence lengths + commit lengths) is written back
into the graph's own input buffers, so the next step of an unchanged batch needs no input from
the host but its verify lengths and simulated counts: the executor launches step N + 1 before
the scheduler reads step N (the overlap schedule for DSpark).

The async confidence policy runs here too: the width is the full window and the graph caps
acceptance on the device (`ConfidencePolicy.device_caps`, from the draft's confidences and a
budget the host computed from lagged ones before the replay), as the eager step does.

`FusedStep` is a launched step's handle: the scheduler reads its results later (`wait`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.host_copy import PendingRead
from sgl_dspark.srt.core.step import InflightStep, ReqUpdate
from sgl_dspark.srt.model_executor.cuda_graph_runner import CudaGraphRunner, bucket_for

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.mem_cache.allocator import ReqToTokenPool
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput
    from sgl_dspark.srt.speculative.dspark.accept import AcceptOutput
    from sgl_dspark.srt.speculative.dspark.metrics import DSparkMetrics
    from sgl_dspark.srt.speculative.dspark.worker import DraftProposal

FAMILY = "DSpark fused step"

# Rows of the static input block: the next state first (the graph rewrites it), then the
# per-step host inputs (slot generations and the budget feed the device caps only).
_ANCHOR, _SEQ, _SLOT, _LENS, _FORCED, _GEN, _BUDGET = range(7)
_ROWS = 7

# (gamma, anchors, seq lens, request slots, drafts to run) -> proposal
ProposeGreedy = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], "DraftProposal"]
# (verify ids, verify lens, seq lens, this rank's logits columns [B, W, V / tp], forced counts,
# caps or None) -> (acceptance, logprobs)
GreedyEpilogue = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    "tuple[AcceptOutput, torch.Tensor]",
]
# (confidences [B, gamma], budget 0-d, real rows [B], request slots, slot generations) -> caps
DeviceCaps = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class FusedStepOutput(NamedTuple):
    """Device results of one fused step, rows [:B] (overwritten by the next replay)."""

    commit_len: torch.Tensor  # [B] int64
    out_tokens: torch.Tensor  # [B, W] int64, -1 after the bonus
    logprobs: torch.Tensor  # [B, W] fp32
    accept_len: torch.Tensor  # [B] int64
    cap_trim: torch.Tensor  # [B] int64, drafts the device caps removed (0 without caps)


class FusedGreedySteps:
    """Graphs of the all-greedy step per (bucket, width), registered with the graph runner.

    `inputs` `[7, max_bs]` int64 holds, per request column: anchor, sequence length, request
    slot, verify length, simulated accept count, slot generation and the step's budget (every
    column the same). Padding columns are slot 0, length 0, verify length 0, generation 0: they
    commit nothing, and their KV and relay writes land in the reserved dummy slot 0.

    With a bs1 runtime of its own block size (`gamma_bs1 != gamma`), bucket 1 has one graph
    instead: that block size, verifying its full window.

    Args:
        propose_greedy: the draft's all-greedy proposal.
        run_verify: the target's forward of a verify batch with the draft's context-KV writer on
            its taps (`ModelRunner.run_model`); `join_taps` ends the region after it.
        greedy_epilogue: acceptance + logprobs of an all-greedy window.
        device_caps: the async confidence policy's caps, or None (host-known widths only).
    """

    def __init__(
        self,
        graphs: CudaGraphRunner,
        req_pool: ReqToTokenPool,
        widths: Sequence[int],
        batch_sizes: Sequence[int],
        gamma: int,
        gamma_bs1: int,
        propose_greedy: ProposeGreedy,
        run_verify: Callable[[ForwardBatch], ModelOutput],
        join_taps: Callable[[], None],
        greedy_epilogue: GreedyEpilogue,
        device_caps: DeviceCaps | None = None,
    ) -> None:
        self.graphs = graphs
        self.req_pool = req_pool
        self.gamma, self.gamma_bs1 = gamma, gamma_bs1
        self._propose_greedy = propose_greedy
        self._run_verify = run_verify
        self._join_taps = join_taps
        self._greedy_epilogue = greedy_epilogue
        self._device_caps = device_caps
        self.batch_sizes = sorted(set(batch_sizes))
        self.widths = sorted(set(widths))
        self.inputs = torch.zeros(
            _ROWS, self.batch_sizes[-1], dtype=torch.int64, device=graphs.device
        )
        self.bs1_width = gamma_bs1 + 1 if gamma_bs1 != gamma else None
        self._keys = [
            (w, bs)
            for w in self.widths
            for bs in self.batch_sizes
            if bs != 1 or self.bs1_width is None
        ]
        if self.bs1_width is not None and 1 in self.batch_sizes:
            self._keys.append((self.bs1_width, 1))
        for w, bs in self._keys:
            # The state rows are zeroed after warm-up and capture, which rewrote them.
            graphs.register(
                FAMILY,
                (w, bs),
                functools.partial(self._step, w, bs),
                launch_batch=bs,
                size=w * bs,
                reset=self._zero_inputs,
            )

    @property
    def replays(self) -> int:
        return self.graphs.replays[FAMILY]

    def _zero_inputs(self) -> None:
        self.inputs.zero_()

    def has(self, width: int, batch_size: int) -> bool:
        """Whether a graph runs `batch_size` requests at verify width `width`. A bs1-runtime
        step runs only as bucket 1's own graph, never padded into a larger bucket's (which
        drafts the main block size)."""
        if batch_size == 1 and self.bs1_width is not None:
            bs: int | None = 1
        else:
            bs = bucket_for(self.batch_sizes, batch_size)
        return bs is not None and (width, bs) in self._keys

    def verify_lens(self, batch_size: int) -> torch.Tensor:
        """The verify lengths of the last launch's B columns (a device view of its input row,
        rewritten by the next launch)."""
        return self.inputs[_LENS, :batch_size]

    def _step(self, w: int, bs: int) -> FusedStepOutput:
        """The captured region for `bs` columns and verify width `w`."""
        anchors, seq, slots, lens, forced, gens, budget = (
            self.inputs[i, :bs] for i in range(_ROWS)
        )
        # A width-w step verifies w - 1 drafts: the Markov loop stops there.
        gamma = self.gamma if bs != 1 or self.bs1_width is None else self.gamma_bs1
        prop = self._propose_greedy(gamma, anchors, seq, slots, max(1, w - 1))
        # The bs1 runtime's own block size verifies its full window whatever the policy.
        caps = None
        if self._device_caps is not None and gamma == self.gamma:
            assert prop.confidence is not None
            caps = self._device_caps(prop.confidence, budget[0], lens > 0, slots, gens)
        verify_ids = torch.cat((anchors[:, None], prop.markov.drafts), dim=1)[:, :w]
        positions = seq[:, None] + torch.arange(w, device=seq.device)[None, :]
        pool = self.req_pool
        cache_loc = pool.req_to_token[slots[:, None], positions]
        batch = ForwardBatch.uniform(
            ForwardMode.VERIFY,
            verify_ids,
            positions,
            cache_loc,
            slots,
            seq,
            seq + w,
            pool.req_to_token,
            pool.max_context_len,
        )
        # The context-KV writer runs on a side stream while the logits and the epilogue run.
        out = self._run_verify(batch)
        acc, tok_lp = self._greedy_epilogue(
            verify_ids, lens, seq, out.shard_logits.view(bs, w, -1), forced, caps
        )
        # The next step's state, in place (every read of these rows is above).
        anchors.copy_(acc.next_anchor)
        seq.copy_(acc.new_seq_lens)
        self._join_taps()
        return FusedStepOutput(acc.commit_len, acc.out_tokens, tok_lp, acc.accept_len, acc.cap_trim)

    @torch.inference_mode()
    def launch(self, width: int, host_rows: list[list[int]], chained: bool) -> FusedStepOutput:
        """Replay the step for B = len(host_rows[0]) requests at verify width `width`.

        host_rows: per input row (anchor, seq, slot, lens, forced, generation, budget; from
        slot on when `chained`), B values each. `chained`: the state rows still hold the previous step's next
        state for the same requests in the same order (the previous launch was this batch).
        """
        B = len(host_rows[0])
        bs = 1 if B == 1 and self.bs1_width is not None else bucket_for(self.batch_sizes, B)
        assert bs is not None and (width, bs) in self._keys, (B, width)
        first = _SLOT if chained else _ANCHOR
        assert len(host_rows) == _ROWS - first
        # Columns beyond B are padding: zero in every row (their state rows stay zero, since a
        # padding column commits nothing).
        host = torch.zeros(
            _ROWS - first, self.inputs.shape[1], dtype=torch.int64, pin_memory=self.inputs.is_cuda
        )
        host[:, :B] = torch.tensor(host_rows, dtype=torch.int64)
        self.inputs[first:].copy_(host, non_blocking=True)
        out = self.graphs.replay(FAMILY, (width, bs))
        return FusedStepOutput(*(t[:B] for t in out))


class FusedStep(InflightStep):
    """A fused step launched and not read yet; its next state stays in the graph's inputs."""

    kind = "spec"
    chainable = True

    def __init__(
        self,
        metrics: DSparkMetrics,
        reqs: tuple[Req, ...],
        width: int,
        verify_lens: list[int],
        host: PendingRead,
    ) -> None:
        self._metrics = metrics
        self._reqs = reqs
        self.width = width
        self.verify_lens = verify_lens
        self.host = host  # commit_len, out_tokens, logprobs, accept_len, cap_trim

    @property
    def reqs(self) -> tuple[Req, ...]:
        return self._reqs

    def wait(self) -> list[ReqUpdate]:
        """Per request its committed tokens and their logprobs. A request that finished or was
        aborted after the launch rode along: it takes nothing, and the metrics skip its row."""
        commit, toks, lps, accepted, trimmed = self.host.wait()
        live = [i for i, r in enumerate(self._reqs) if not (r.finished or r.slot < 0)]
        if live:
            self._metrics.record_step(
                torch.tensor([self.verify_lens[i] for i in live]),
                torch.tensor([accepted[i] for i in live]),
                request_ids=[self._reqs[i].rid for i in live],
                cap_trim=torch.tensor([trimmed[i] for i in live]),
            )
        return [
            ReqUpdate(
                self._reqs[i],
                commit[i],
                tuple(toks[i][: commit[i]]),
                tuple(lps[i][: commit[i]]),
                speculative=True,
            )
            for i in live
        ]
