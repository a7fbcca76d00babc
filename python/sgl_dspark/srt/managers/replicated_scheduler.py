"""The scheduler of one rank among several that run one model together.

Every rank runs the same host-only `Scheduler`. Rank 0 (the leader) takes requests and aborts
as a single-process server does and records them; each `step()` first broadcasts the records
since the last step, and every other rank (a follower, `serve_forever`) replays them on its own
scheduler and then steps. Scheduling is a function of its inputs and of the tokens a step
returns (equal on every rank), so every rank plans the same batches, in the same order, and
their collectives match. The records, in order:

- `("add_group", (AddedReq, ...))`: requests queued together (`add_group`, all or none);
- `("abort", (rid, ...))`: aborts, batched as they came; a decision that reads a clock (the
  queue timeout of `expire_waiting`, a disconnect) is made on rank 0 and arrives this way;
- `("fail", ((rid, error), ...))`: requests rank 0 failed alone (a step retried request by
  request, or a host-side failure while applying a step), failed on every rank before the next
  plan. A follower that fails a request rank 0 kept has diverged: it raises, and the rank's
  exit ends the server with the rank named (`rank_group.py`).

Stop strings are matched by a detokenizer, so a follower builds one for a request that has
stop strings (from its own tokenizer), and a matcher for a request with a grammar; every other
output (text, logprob records) is rank 0's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sgl_dspark.srt.constrained import Grammars
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.managers.scheduler import Scheduler, SchedulerConfig, StepResult
from sgl_dspark.srt.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from sgl_dspark.srt.core.step import BaseStepExecutor
    from sgl_dspark.srt.mem_cache.allocator import PagedTokenAllocator, ReqToTokenPool
    from sgl_dspark.srt.sampling.sampling_params import SamplingParams
    from sgl_dspark.srt.tokenizer import TokenizerLike

logger = logging.getLogger(__name__)


class ObjectBroadcast(Protocol):
    """What the scheduler needs of the ranks' communicator."""

    rank: int

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...


@dataclass(frozen=True)
class AddedReq:
    """A request as every rank needs it (no detokenizer, no output state)."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: tuple[int, ...] | None

    @classmethod
    def of(cls, req: Req) -> AddedReq:
        ids = req.token_ids_logprob
        return cls(
            req.rid,
            tuple(req.prompt_ids),
            req.params,
            req.return_logprob,
            req.logprob_start_len,
            req.top_logprobs_num,
            None if ids is None else tuple(ids),
        )


@dataclass(frozen=True)
class IterationInputs:
    """What rank 0 broadcasts before each step: the scheduler calls since the last one, in
    order (module doc), and whether to step or to stop."""

    ops: tuple[tuple[str, Any], ...] = ()
    step: bool = True
    stop: bool = False


class ReplicatedScheduler(Scheduler):
    """`Scheduler` whose inputs rank 0 broadcasts to the other ranks (see the module doc)."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        req_pool: ReqToTokenPool,
        allocator: PagedTokenAllocator,
        executor: BaseStepExecutor,
        comm: ObjectBroadcast,
        tokenizer: TokenizerLike | None = None,
    ) -> None:
        super().__init__(cfg, req_pool, allocator, executor)
        self.comm = comm
        self.is_leader = comm.rank == 0
        self._tokenizer = tokenizer
        self._grammars: Grammars | None = None  # followers: built at the first grammar
        self._ops: list[tuple[str, Any]] = []
        self._stopped = False

    # ---- rank 0 ----------------------------------------------------------------------------
    def add_group(self, reqs: list[Req]) -> None:
        super().add_group(reqs)  # a rejected group raises here and is never broadcast
        if self.is_leader:
            self._ops.append(("add_group", tuple(AddedReq.of(r) for r in reqs)))

    def abort(self, rid: str) -> Req | None:
        req = super().abort(rid)
        if req is not None and self.is_leader:
            self._record_aborts((rid,))
        return req

    def expire_waiting(self, queued_before: float) -> list[Req]:
        """Rank 0 only (it reads the clock's cut-off): the expired requests reach the other
        ranks as aborts."""
        assert self.is_leader, "followers replay rank 0's expiries as aborts"
        expired = super().expire_waiting(queued_before)
        self._record_aborts(tuple(r.rid for r in expired))
        return expired

    def _record_aborts(self, rids: tuple[str, ...]) -> None:
        if not rids:
            return
        if self._ops and self._ops[-1][0] == "abort":  # one record for a batch of aborts
            rids = self._ops.pop()[1] + rids
        self._ops.append(("abort", rids))

    def step(self) -> StepResult:
        assert self.is_leader, "followers step from serve_forever"
        self._broadcast(IterationInputs(tuple(self._ops)))
        result = super().step()
        if result.failed:  # failed on every rank before the next plan
            failed = tuple((r.rid, r.error or "failed") for r in result.failed)
            self._ops.append(("fail", failed))
        return result

    def close(self) -> None:
        """Rank 0: release the followers (their `serve_forever` returns)."""
        if self.is_leader and not self._stopped:
            self._stopped = True
            self._broadcast(IterationInputs(tuple(self._ops), step=False, stop=True))

    def _broadcast(self, inputs: IterationInputs) -> None:
        self._ops = []
        self.comm.broadcast_object(inputs)

    # ---- other ranks -----------------------------------------------------------------------
    def serve_forever(self) -> None:
        """A follower's loop: replay rank 0's inputs and step with it until it stops."""
        assert not self.is_leader
        own_failures: set[str] = set()  # failed here in the last step
        while True:
            inputs: IterationInputs = self.comm.broadcast_object(None)
            failed_by_leader: set[str] = set()
            for kind, arg in inputs.ops:
                if kind == "add_group":
                    super().add_group([self._make_req(a) for a in arg])
                elif kind == "abort":
                    for rid in arg:
                        super().abort(rid)
                else:
                    for rid, error in arg:
                        failed_by_leader.add(rid)
                        self._fail_replayed(rid, error)
            diverged = own_failures - failed_by_leader
            if diverged:
                raise RuntimeError(
                    f"rank {self.comm.rank} failed requests that rank 0 kept "
                    f"({sorted(diverged)[:5]}): the ranks' batches no longer match"
                )
            if inputs.stop:
                return
            own_failures = set()
            if inputs.step:
                own_failures = {r.rid for r in super().step().failed}

    def _fail_replayed(self, rid: str, error: str) -> None:
        """End `rid` as rank 0 did (a no-op when this rank failed it in the same step)."""
        req = self.running.get(rid) or self.waiting.get(rid)
        if req is None or req.finished:
            return
        self.waiting.pop(rid, None)
        self.release(req)
        req.error = error
        req.finish_reason = {"type": "abort", "message": error}

    def _make_req(self, added: AddedReq) -> Req:
        detok = None
        if added.params.stop and self._tokenizer is not None:
            detok = IncrementalDetokenizer(
                self._tokenizer,
                skip_special_tokens=added.params.skip_special_tokens,
                stop=added.params.stop,
                no_stop_trim=added.params.no_stop_trim,
                prompt_ids=list(added.prompt_ids),
            )
        grammar = None
        if added.params.grammar is not None:
            if self._grammars is None:
                self._grammars = Grammars(
                    self._tokenizer, self.cfg.vocab_size or 0, self.cfg.eos_token_ids
                )
            grammar = self._grammars.matcher_for(added.params.grammar)
        return Req(
            rid=added.rid,
            prompt_ids=list(added.prompt_ids),
            params=added.params,
            return_logprob=added.return_logprob,
            logprob_start_len=added.logprob_start_len,
            top_logprobs_num=added.top_logprobs_num,
            token_ids_logprob=added.token_ids_logprob,
            detok=detok,
            grammar=grammar,
        )
