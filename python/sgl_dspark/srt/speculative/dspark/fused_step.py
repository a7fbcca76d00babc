"""The all-greedy DSpark step as one CUDA graph per (batch bucket, verify width W).

One replay runs the draft forward and Markov loop, the target's verify forward over
[anchor, d_1 .. d_{W-1}] at positions seq .. seq + W - 1 (its token slots looked up on the
device) with the draft's context KV of its rows, acceptance and the committed tokens' logprobs:
the same ops as the worker's separate draft / verify / epilogue graphs, without their host round
trips (verify batch built on the host, logits copied into the epilogue's buffers).

The step's next state (anchors = bonus tokens, sequence lengths + commit lengths) is written back
into the graph's own input buffers, so the next step of an unchanged batch needs no input from
the host but its verify lengths and simulated counts: the scheduler launches step N + 1 before it
reads step N (the overlap schedule for DSpark, cf. `Scheduler._spec_overlapped`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.host_copy import PendingRead
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.model_executor.cuda_graph_runner import Graph, make_graph_factory, warm_up

if TYPE_CHECKING:
    from sgl_dspark.srt.speculative.dspark.worker import DSparkWorker

logger = logging.getLogger(__name__)

# Rows of the static input block: the next state first (the graph rewrites it), then the
# per-step host inputs.
_ANCHOR, _SEQ, _SLOT, _LENS, _FORCED = range(5)


class FusedStepOutput(NamedTuple):
    """Device results of one fused step, rows [:B] (overwritten by the next replay)."""

    commit_len: torch.Tensor  # [B] int64
    out_tokens: torch.Tensor  # [B, W] int64, -1 after the bonus
    logprobs: torch.Tensor  # [B, W] fp32
    accept_len: torch.Tensor  # [B] int64


class FusedGreedySteps:
    """Graphs of `DSparkWorker`'s all-greedy step per (bucket, width); see the module doc.

    `inputs` `[5, max_bs]` int64 holds, per request column: anchor, sequence length, request
    slot, verify length and simulated accept count. Padding columns are slot 0, length 0, verify
    length 0: they commit nothing, and their KV writes land in the reserved dummy slot 0.

    With a bs1 runtime of its own block size (`gamma_bs1 != gamma`), bucket 1 has one graph
    instead: that block size, verifying its full window (as the worker's own bs1 step).
    """

    def __init__(
        self,
        worker: DSparkWorker,
        widths: Sequence[int],
        batch_sizes: Sequence[int],
        graph_factory: Callable[[], Graph] | None = None,
    ) -> None:
        self.worker = worker
        runner = worker.runner
        dev = runner.device
        self.batch_sizes = sorted(set(batch_sizes))
        self.widths = sorted(set(widths))
        self.inputs = torch.zeros(5, self.batch_sizes[-1], dtype=torch.int64, device=dev)
        self._graphs: dict[tuple[int, int], tuple[Graph, FusedStepOutput]] = {}
        self.replays = 0
        self.bs1_width = worker.gamma_bs1 + 1 if worker.gamma_bs1 != worker.gamma else None
        shapes = [
            (w, bs)
            for w in self.widths
            for bs in self.batch_sizes
            if bs != 1 or self.bs1_width is None
        ]
        if self.bs1_width is not None and 1 in self.batch_sizes:
            shapes.append((self.bs1_width, 1))
        factory = graph_factory or make_graph_factory(dev)
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        for w, bs in sorted(shapes, reverse=True):  # the largest first: the pool is reused
            graph = factory()
            run = functools.partial(self._step, w, bs)
            with torch.inference_mode():
                warm_up(run, dev, bs)
                self.inputs.zero_()  # warm-up steps rewrote the state rows
                out = graph.capture(run, bs)
                self.inputs.zero_()
            self._graphs[(w, bs)] = (graph, out)
        mem = (torch.cuda.memory_reserved(dev) - mem0) / 2**20 if dev.type == "cuda" else 0.0
        logger.info(
            "Captured %d fused DSpark step graphs (widths %s x bs %s%s) in %.1f s, "
            "+%.0f MiB reserved",
            len(self._graphs),
            self.widths,
            self.batch_sizes,
            "" if self.bs1_width is None else f"; bs 1: width {self.bs1_width}",
            time.perf_counter() - t0,
            mem,
        )

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch_size), None)

    def has(self, width: int, batch_size: int) -> bool:
        """Whether a graph runs `batch_size` requests at verify width `width`. A bs1-runtime
        step runs only as bucket 1's own graph, never padded into a larger bucket's (which
        drafts the main block size)."""
        bs = 1 if batch_size == 1 and self.bs1_width is not None else self.bucket_for(batch_size)
        return bs is not None and (width, bs) in self._graphs

    def _step(self, w: int, bs: int) -> FusedStepOutput:
        """The captured region for `bs` columns and verify width `w`."""
        worker, runner = self.worker, self.worker.runner
        anchors, seq, slots, lens, forced = (self.inputs[i, :bs] for i in range(5))
        # A width-w step verifies w - 1 drafts: the Markov loop stops there (bs 1, width 4: 3
        # of the 7 steps, each a 16 MB read of the head at the mid model's vocabulary).
        gamma = worker.gamma if bs != 1 or self.bs1_width is None else worker.gamma_bs1
        prop = worker._propose_greedy(gamma, anchors, seq, slots, max(1, w - 1))
        verify_ids = torch.cat((anchors[:, None], prop.markov.drafts), dim=1)[:, :w]
        positions = seq[:, None] + torch.arange(w, device=seq.device)[None, :]
        pool = runner.req_pool
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
        # The tap hook writes the draft context KV of all w rows, on a side stream while the
        # logits and the epilogue run (`ModelRunner.run_model`).
        out = runner.run_model(batch, worker.tap_layers)
        acc, tok_lp = worker._greedy_epilogue(
            verify_ids, lens, seq, out.logits.view(bs, w, -1), forced
        )
        # The next step's state, in place (every read of these rows is above).
        anchors.copy_(acc.next_anchor)
        seq.copy_(acc.new_seq_lens)
        runner.join_tap_hook()
        return FusedStepOutput(acc.commit_len, acc.out_tokens, tok_lp, acc.accept_len)

    @torch.inference_mode()
    def launch(self, width: int, host_rows: list[list[int]], chained: bool) -> FusedStepOutput:
        """Replay the step for B = len(host_rows[0]) requests at verify width `width`.

        host_rows: per input row (anchor, seq, slot, lens, forced; only slot, lens, forced when
        `chained`), B values each. `chained`: the state rows still hold the previous step's next
        state for the same requests in the same order (the previous launch was this batch).
        """
        B = len(host_rows[0])
        bs = self.bucket_for(B)
        assert bs is not None and (width, bs) in self._graphs, (B, width)
        first = _SLOT if chained else _ANCHOR
        assert len(host_rows) == 5 - first
        # Columns beyond B are padding: zero in every row (their state rows stay zero, since a
        # padding column commits nothing).
        host = torch.zeros(
            5 - first, self.inputs.shape[1], dtype=torch.int64, pin_memory=self.inputs.is_cuda
        )
        host[:, :B] = torch.tensor(host_rows, dtype=torch.int64)
        self.inputs[first:].copy_(host, non_blocking=True)
        graph, out = self._graphs[(width, bs)]
        graph.replay()
        self.replays += 1
        return FusedStepOutput(*(t[:B] for t in out))


class FusedLaunch(NamedTuple):
    """A fused step launched and not read yet."""

    reqs: list[Req]
    width: int
    verify_lens: list[int]
    host: PendingRead  # commit_len, out_tokens, logprobs, accept_len


def fused_width(worker: DSparkWorker, reqs: Sequence[Req], lag_width: int) -> int | None:
    """The verify width at which the fused graphs can run this all-greedy batch, or None.

    `lag_width`: the width of a fused step still in flight for these requests (its commits are
    not in `kv_len` yet), 0 when none: the step must fit the context after it.
    """
    fused = worker.fused
    B = len(reqs)
    if fused is None or not all(r.params.is_greedy for r in reqs):
        return None
    bs1 = B == 1 and fused.bs1_width is not None
    # The bs1 runtime verifies its full window whatever the policy (the worker's own step).
    width = (
        fused.bs1_width
        if bs1
        else int(worker.policy.verify_lens(None, [r.slot for r in reqs], [])[0])
    )
    if width is None or not fused.has(width, B):
        return None
    limit = worker.runner.req_pool.max_context_len
    gamma = worker.gamma_bs1 if bs1 else worker.gamma
    if any(r.kv_len + lag_width + max(width, gamma) > limit for r in reqs):
        return None
    return width


def launch_fused(
    worker: DSparkWorker, reqs: list[Req], width: int, chained: bool, lag_width: int
) -> FusedLaunch:
    """Reserve the pages the step may write, then replay its graph (no host synchronisation).
    `chained`: the previous launch was a fused step of exactly these requests, still in flight
    (`lag_width` its width): the graph's state rows already hold their anchors and lengths."""
    assert worker.fused is not None
    pool = worker.runner.req_pool
    for r in reqs:
        pool.reserve(r.slot, r.kv_len + lag_width + width)
    # Never verify past max_new_tokens (the request ends there anyway); with a step in flight
    # `output_ids` lags, so this may verify a little more, never less, than needed.
    lens = [max(1, min(width, r.params.max_new_tokens - len(r.output_ids))) for r in reqs]
    rows = [[r.slot for r in reqs], lens, worker.sim_count_list(reqs)]
    if not chained:
        rows = [[r.output_ids[-1] for r in reqs], [r.kv_len for r in reqs], *rows]
    out = worker.fused.launch(width, rows, chained)
    return FusedLaunch(
        reqs, width, lens, PendingRead(out.commit_len, out.out_tokens, out.logprobs, out.accept_len)
    )


def resolve_fused(
    worker: DSparkWorker, step: FusedLaunch, live: Sequence[bool]
) -> list[tuple[list[int], list[float]] | None]:
    """Read a fused step's results (waits for it): per request the committed tokens and their
    logprobs, None where `live` is false (a request that finished or was aborted after the
    launch rode along: its row is not a step of its own). Sequence lengths and the metrics
    advance for the live rows, as after the worker's own step."""
    commit, toks, lps, accepted = step.host.wait()
    rows = [i for i, ok in enumerate(live) if ok]
    if rows:
        worker.metrics.record_step(
            torch.tensor([step.verify_lens[i] for i in rows]),
            torch.tensor([accepted[i] for i in rows]),
            request_ids=[step.reqs[i].rid for i in rows],
            cap_trim=torch.zeros(len(rows), dtype=torch.int64),
        )
    out: list[tuple[list[int], list[float]] | None] = []
    for r, ok, c, t, lp in zip(step.reqs, live, commit, toks, lps):
        if not ok:
            out.append(None)
            continue
        r.kv_len += c
        r.spec_verify_ct += 1
        r.spec_committed += c
        out.append((t[:c], lp[:c]))
    return out
