"""The scheduler of one rank among several that run one model together.

Every rank runs the same host-only `Scheduler`. Rank 0 (the leader) takes requests and aborts
as a single-process server does and records them; each `step()` first broadcasts the records
since the last step, and every other rank (a follower, `serve_forever`) replays them on its own
scheduler and then steps. Scheduling is a function of its inputs and of the tokens a step
returns (equal on every rank), so every rank plans the same batches, in the same order, and
their collectives match. Nothing here reads a clock: a decision that does (a timeout, a
disconnect) is made on rank 0 and arrives as an abort.

Stop strings are matched by a detokenizer, so a follower builds one for a request that has
stop strings (from its own tokenizer); every other output (text, logprob records) is rank 0's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

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


@dataclass(frozen=True)
class IterationInputs:
    """What rank 0 broadcasts before each step: the scheduler calls since the last one, in
    order (`("add", AddedReq)` / `("abort", rid)`), and whether to step or to stop."""

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
        self._ops: list[tuple[str, Any]] = []
        self._stopped = False

    # ---- rank 0 ----------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        super().add(req)  # a rejected request raises here and is never broadcast
        if self.is_leader:
            record = AddedReq(req.rid, tuple(req.prompt_ids), req.params, req.return_logprob)
            self._ops.append(("add", record))

    def abort(self, rid: str) -> Req | None:
        req = super().abort(rid)
        if req is not None and self.is_leader:
            self._ops.append(("abort", rid))
        return req

    def step(self) -> StepResult:
        assert self.is_leader, "followers step from serve_forever"
        self._broadcast(IterationInputs(tuple(self._ops)))
        return super().step()

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
        while True:
            inputs: IterationInputs = self.comm.broadcast_object(None)
            for kind, arg in inputs.ops:
                if kind == "add":
                    super().add(self._make_req(arg))
                else:
                    super().abort(arg)
            if inputs.stop:
                return
            if inputs.step:
                try:
                    super().step()
                except Exception:  # rank 0 fails the same step and broadcasts the aborts
                    logger.exception("scheduler step failed on this rank")

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
        return Req(
            rid=added.rid,
            prompt_ids=list(added.prompt_ids),
            params=added.params,
            return_logprob=added.return_logprob,
            detok=detok,
        )
