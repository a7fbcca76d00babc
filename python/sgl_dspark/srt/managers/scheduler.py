"""Continuous-batching scheduler (host side): admission with KV reservation, chunked prefill
mixed with decode in one flat batch, sampling, stop conditions, freeing.

Admission reserves the KV a request can ever need (prompt + max_new_tokens), so a running request
never runs out of pages and nothing needs preempting; a request that could never fit is rejected.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.host_copy import PendingRead, read_to_host
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.layers.sampler import Sampler, SamplerOutput, SamplingBatchInfo
from sgl_dspark.srt.model_executor.model_runner import ModelRunner
from sgl_dspark.srt.speculative.dspark.fused_step import (
    FusedLaunch,
    fused_width,
    launch_fused,
    resolve_fused,
)

if TYPE_CHECKING:
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput
    from sgl_dspark.srt.speculative.dspark.worker import DSparkWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int = 512  # max prefill tokens per step (all requests)
    max_running_requests: int = 64
    eos_token_ids: tuple[int, ...] = ()
    # Launch decode step N+1 from step N's sampled tokens on the device before reading them
    # (see `Scheduler._decode_overlapped`); all-greedy DSpark steps chain their state on the
    # device the same way when fused step graphs are captured (`Scheduler._spec_overlapped`).
    overlap_schedule: bool = False


class StepResult(NamedTuple):
    updated: list[Req]
    finished: list[Req]


@dataclass
class _InflightDecode:
    """A decode step launched but not read yet: its requests in batch order, the sampled ids on
    the device (the next step's input) and the pending host copy of ids and logprobs."""

    reqs: list[Req]
    next_ids: torch.Tensor
    host: PendingRead
    kind: str = "decode"


@dataclass
class _InflightSpec:
    """A fused DSpark step launched but not read yet (`fused_step.py`); its next state (anchors,
    sequence lengths) stays on the device, in the graph's inputs."""

    launch: FusedLaunch
    kind: str = "spec"

    @property
    def reqs(self) -> list[Req]:
        return self.launch.reqs


class RequestRejected(ValueError):
    """The request can never be served with this configuration (prompt too long, ...)."""


class Scheduler:
    def __init__(
        self, runner: ModelRunner, cfg: SchedulerConfig, spec: DSparkWorker | None = None
    ) -> None:
        self.runner = runner
        self.cfg = cfg
        self.spec = spec
        self.sampler = Sampler(runner.kernels)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._reserved_pages = 0
        self._inflight: _InflightDecode | _InflightSpec | None = None

    # ---- admission -------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        """Raise RequestRejected when `req` can never run (checked before queueing)."""
        total = len(req.prompt_ids) + req.params.max_new_tokens
        ctx = self.runner.req_pool.max_context_len
        if not req.prompt_ids:
            raise RequestRejected("the prompt is empty")
        if total > ctx:
            raise RequestRejected(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) = {total} exceeds the context length {ctx}"
            )
        if self._pages_for(total) > self.runner.allocator.num_usable_pages:
            raise RequestRejected(f"request needs {total} tokens of KV, more than the pool holds")
        if self.spec is not None and req.params.min_p > 0:
            raise RequestRejected("min_p is not supported with DSpark speculative decoding")
        vocab = self.runner.model_cfg.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"token ids out of range [0, {vocab}): {bad[:5]}")

    def add(self, req: Req) -> None:
        self.validate(req)
        self.waiting.append(req)

    def _pages_for(self, tokens: int) -> int:
        # + max_verify_tokens: speculative steps write a window past the committed length.
        ps = self.runner.page_size
        return -(-(tokens + self.runner.rc.max_verify_tokens) // ps)

    def _admit(self) -> None:
        alloc = self.runner.allocator
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            pages = self._pages_for(len(req.prompt_ids) + req.params.max_new_tokens)
            if self._reserved_pages + pages > alloc.num_usable_pages:
                break  # wait for memory (FCFS: do not let later requests overtake)
            if self.runner.req_pool.num_free_slots == 0:
                break
            self.waiting.popleft()
            req.slot = self.runner.req_pool.alloc_slot()
            req.reserved_tokens = pages * self.runner.page_size
            self._reserved_pages += pages
            self.running.append(req)
            if self.spec is not None:
                self.spec.on_new_request(req)

    def release(self, req: Req) -> None:
        if self.spec is not None:
            self.spec.on_request_done(req)
        if req.slot >= 0:
            self.runner.req_pool.free_slot(req.slot)
            self._reserved_pages -= req.reserved_tokens // self.runner.page_size
            req.slot = -1
        if req in self.running:
            self.running.remove(req)

    def abort(self, rid: str) -> Req | None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = {"type": "abort"}
                return req
        for req in self.running:
            if req.rid == rid:
                req.finish_reason = {"type": "abort"}
                self.release(req)
                return req
        return None

    @property
    def has_work(self) -> bool:
        # A step in flight with running requests still owes them tokens.
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one scheduling step over the running requests.

        Without speculation: one flat forward mixing prefill chunks and decode tokens. With
        DSpark: a prefill forward for requests still in their prompt (their features feed the
        draft's context), then one DSpark step for the requests that were already decoding.
        Returns the requests that received new output tokens (`updated`, in batch order) and
        those that finished (already released)."""
        self._admit()
        updated: list[Req] = []
        finished: list[Req] = []
        if self._inflight is not None and self._overlap_kind() is None:
            # The batch changes (a request finished, was aborted or joined): read the step in
            # flight first, so the next batch is planned from known tokens.
            updated += self._resolve(self._inflight)
            self._inflight = None
            finished += self._release_finished()
            self._admit()
        if not self.running:
            return StepResult(updated, finished)
        if self.spec is None:
            if self._overlap_kind() == "decode":
                updated += self._decode_overlapped()
            else:
                updated += self._forward(self._plan_work(self.running))
        else:
            decoding = [r for r in self.running if r.prefill_done]
            prefilling = [r for r in self.running if not r.prefill_done]
            if prefilling:
                updated += self._forward(self._plan_work(prefilling), self.spec.tap_layers)
            kind = self._overlap_kind() if decoding else None
            if kind == "decode":
                updated += self._decode_overlapped()
            elif kind == "spec":
                updated += self._spec_overlapped()
            elif decoding and self.spec.plain_decode(len(decoding)):
                # No speculation at this batch size: a plain decode step that commits the
                # draft's context KV for its tokens, so DSpark can resume when the batch shrinks.
                updated += self._forward(self._plan_work(decoding), self.spec.tap_layers)
            elif decoding:
                for req, out in zip(decoding, self.spec.step(decoding)):
                    self.append_tokens(req, out.tokens, out.logprobs)
                updated += decoding
        finished += self._release_finished()
        return StepResult(_unique(updated), finished)

    def _release_finished(self) -> list[Req]:
        finished = [r for r in self.running if r.finished]
        for r in finished:
            self.release(r)
        return finished

    # ---- overlapped decode -----------------------------------------------------------------
    def _overlap_kind(self) -> str | None:
        """The step an all-decode batch can launch before the step in flight is read: "decode"
        (plain decode, also DSpark's static width 1) or "spec" (a fused all-greedy DSpark step),
        when the batch is exactly the requests of the step in flight of the same kind (or none is
        in flight); None otherwise."""
        if not (
            self.cfg.overlap_schedule and self.running and all(r.prefill_done for r in self.running)
        ):
            return None
        prev = self._inflight
        if self.spec is None or self.spec.plain_decode(len(self.running)):
            kind = "decode"
        else:
            lag = prev.launch.width if isinstance(prev, _InflightSpec) else 0
            if fused_width(self.spec, self.running, lag) is None:
                return None  # the worker's own step, one at a time
            kind = "spec"
        if prev is None:
            return kind
        same = (
            prev.kind == kind
            and len(prev.reqs) == len(self.running)
            and all(a is b for a, b in zip(prev.reqs, self.running))
        )
        return kind if same else None

    def _decode_overlapped(self) -> list[Req]:
        """Launch this decode step, then read the previous one while it runs.

        The step's input tokens are the previous step's sampled ids, still on the device; the
        host only needs positions and slots, which do not depend on the token values. A request
        that the previous step finishes (EOS, stop, length) has already been given this step's
        token: it is dropped when read (its KV write lands in its own reserved pages). Greedy
        and seeded outputs are the same as step by step: a token's position and its sampling
        counter are known before its predecessor is read."""
        prev = self._inflight
        assert prev is None or isinstance(prev, _InflightDecode)
        reqs = list(self.running)
        work = [(r, [0] if prev is not None else r.next_input(1)) for r in reqs]
        pool = self.runner.req_pool
        for req, _ in work:
            pool.reserve(req.slot, req.kv_len + 1)
        batch = ForwardBatch.build(
            ForwardMode.DECODE,
            [ids for _, ids in work],
            [r.kv_len for r in reqs],
            [r.slot for r in reqs],
            pool.req_to_token,
            input_ids_device=None if prev is None else prev.next_ids,
        )
        taps = self.spec.tap_layers if self.spec is not None else ()
        out = self.runner.forward(batch, taps)  # DSpark's draft KV: the runner's tap hook
        for req in reqs:
            req.kv_len += 1
        lag = 0 if prev is None else 1  # tokens sampled but not yet appended
        res = self._sample_device(reqs, out, lag)
        self._inflight = _InflightDecode(
            reqs, res.next_token_ids, PendingRead(res.next_token_ids, res.next_token_logprobs)
        )
        return self._resolve(prev) if prev is not None else []

    def _spec_overlapped(self) -> list[Req]:
        """Launch this fused DSpark step, then read the previous one while it runs. The step's
        anchors and sequence lengths are the previous step's, still on the device (chained);
        the host supplies request slots, verify lengths and simulated counts, which do not
        depend on the previous step's results. Requests finished by the previous step ride along
        once, as in `_decode_overlapped`, and take nothing when read."""
        assert self.spec is not None
        prev = self._inflight
        lag = prev.launch.width if isinstance(prev, _InflightSpec) else 0
        reqs = list(self.running)
        width = fused_width(self.spec, reqs, lag)
        assert width is not None
        launch = launch_fused(self.spec, reqs, width, chained=prev is not None, lag_width=lag)
        self._inflight = _InflightSpec(launch)
        return self._resolve(prev) if prev is not None else []

    def _resolve(self, step: _InflightDecode | _InflightSpec) -> list[Req]:
        """Append the tokens of a step read from the device; requests that finished or were
        aborted since it was launched take nothing."""
        if isinstance(step, _InflightSpec):
            assert self.spec is not None
            live = [not (r.finished or r.slot < 0) for r in step.reqs]
            done = []
            for req, out in zip(step.reqs, resolve_fused(self.spec, step.launch, live)):
                if out is not None:
                    self.append_tokens(req, *out)
                    done.append(req)
            return done
        ids, lps = step.host.wait()
        updated = []
        for req, tok, lp in zip(step.reqs, ids, lps):
            if req.finished or req.slot < 0:
                continue
            self.append_tokens(req, [tok], [lp])
            updated.append(req)
        return updated

    def _plan_work(self, reqs: list[Req]) -> list[tuple[Req, list[int]]]:
        budget = self.cfg.chunked_prefill_size
        work: list[tuple[Req, list[int]]] = []
        for req in reqs:
            if req.prefill_done:
                work.append((req, req.next_input(1)))
            elif budget > 0:
                chunk = req.next_input(budget)
                budget -= len(chunk)
                work.append((req, chunk))
        return work

    def _forward(
        self, work: list[tuple[Req, list[int]]], tap_layers: tuple[int, ...] = ()
    ) -> list[Req]:
        """One forward over `work`; samples where a token is due; returns the sampled requests."""
        pool = self.runner.req_pool
        for req, ids in work:
            pool.reserve(req.slot, req.kv_len + len(ids))
        # Logits only where a token is sampled: the last prompt token and every decode token.
        rows = [
            [len(ids) - 1] if req.kv_len + len(ids) >= len(req.prompt_ids) else []
            for req, ids in work
        ]
        mode = ForwardMode.DECODE if all(r.prefill_done for r, _ in work) else ForwardMode.EXTEND
        batch = ForwardBatch.build(
            mode,
            [ids for _, ids in work],
            [r.kv_len for r, _ in work],
            [r.slot for r, _ in work],
            pool.req_to_token,
            logits_rows=rows,
        )
        # (with DSpark the runner's tap hook writes the draft's context KV of these rows)
        out = self.runner.forward(batch, tap_layers)
        for req, ids in work:
            req.kv_len += len(ids)
        sampled = [req for (req, _), r in zip(work, rows) if r]
        if sampled:
            res = self._sample_device(sampled, out, 0)
            ids, lps = read_to_host(res.next_token_ids, res.next_token_logprobs)
            for req, tok, lp in zip(sampled, ids, lps):
                self.append_tokens(req, [tok], [lp])
        return sampled

    def _sample_device(self, reqs: list[Req], out: ModelOutput, lag: int) -> SamplerOutput:
        """One token per logits row of `out` (rows in `reqs` order), left on the device. A
        decode graph already computed the greedy choice, which an all-greedy batch takes as is
        (the same ops as the sampler); otherwise the sampler runs with the batch record.
        `lag`: tokens sampled for these requests but not appended yet (sampling counters)."""
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

    def append_tokens(self, req: Req, tokens: list[int], logprobs: list[float]) -> None:
        """Append sampled tokens, stopping at the first stop condition (extra tokens dropped)."""
        p = req.params
        if p.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            return
        for tok, lp in zip(tokens, logprobs):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            if not p.ignore_eos and tok in self.cfg.eos_token_ids:
                req.finish_reason = {"type": "stop", "matched": tok}
            elif tok in p.stop_token_ids:
                req.finish_reason = {"type": "stop", "matched": tok}
            elif req.detok is not None and req.detok.append([tok]).stop is not None:
                req.finish_reason = {"type": "stop", "matched": req.detok.matched_stop}
            if req.finish_reason is None and len(req.output_ids) >= p.max_new_tokens:
                req.finish_reason = {"type": "length", "length": p.max_new_tokens}
            if req.finish_reason is not None:
                return


def _unique(reqs: list[Req]) -> list[Req]:
    """Each request once, first occurrence first: a step that reads the overlapped step in
    flight and then runs another forward may update a request twice."""
    seen: set[int] = set()
    out = []
    for r in reqs:
        if id(r) not in seen:
            seen.add(id(r))
            out.append(r)
    return out
