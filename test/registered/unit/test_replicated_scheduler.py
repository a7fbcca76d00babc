"""The replicated scheduler without a world: rank 0's broadcasts are recorded and a follower
replays them afterwards, over the fake executor of the host scheduler's tests. Groups, batched
aborts, queue expiry and requests failed alone on rank 0 must leave the follower with the same
scheduling trace and the same free KV pages; a follower that fails a request rank 0 kept
stops with an error naming the requests."""

from __future__ import annotations

from typing import Any

import pytest
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.core.step import InflightStep, StepWork
from sgl_dspark.srt.managers.replicated_scheduler import ReplicatedScheduler
from sgl_dspark.srt.managers.scheduler import SchedulerConfig
from sgl_dspark.srt.mem_cache.allocator import PagedTokenAllocator, ReqToTokenPool
from sgl_dspark.srt.sampling import SamplingParams
from test_scheduler import PAGE, VOCAB, FakeExecutor

SLOTS = 8
PROMPTS = {f"r{i}": [(5 * i + j) % (VOCAB - 1) + 1 for j in range(6 + 3 * i)] for i in range(5)}


class Recorder:
    """Rank 0's communicator: keeps every broadcast."""

    rank = 0

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.sent.append(obj)
        return obj


class Replay:
    """A follower's communicator: receives rank 0's recorded broadcasts in order."""

    rank = 1

    def __init__(self, sent: list[Any]) -> None:
        self._sent = iter(sent)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return next(self._sent)


class TracingExecutor(FakeExecutor):
    """The fake executor that records every launch as (prefill (rid, start, length), decode
    (rid, committed length)) and, with `fail_rid`, raises for any step holding that request
    once it has `fail_after` output tokens."""

    def __init__(self, fail_rid: str | None = None, fail_after: int = 0) -> None:
        super().__init__()
        self.trace: list[tuple] = []
        self.fail_rid, self.fail_after = fail_rid, fail_after

    def launch(self, work: StepWork, prev: InflightStep | None) -> InflightStep:
        self.trace.append(
            (
                tuple((r.rid, r.kv_len, len(c)) for r, c in work.prefill),
                tuple((r.rid, r.kv_len) for r in work.decode),
            )
        )
        for r in work.reqs:
            if r.rid == self.fail_rid and len(r.output_ids) >= self.fail_after:
                raise RuntimeError(f"device fault on {r.rid}")
        return super().launch(work, prev)


def build(comm: Any, executor: TracingExecutor, max_running: int = 3) -> ReplicatedScheduler:
    allocator = PagedTokenAllocator(64 + 1, PAGE)
    pool = ReqToTokenPool(SLOTS, 128, allocator, "cpu")
    cfg = SchedulerConfig(
        chunked_prefill_size=8,
        max_running_requests=max_running,
        eos_token_ids=(),
        vocab_size=VOCAB,
        overlap_schedule=False,
    )
    return ReplicatedScheduler(cfg, pool, allocator, executor, comm)


def req(rid: str, max_new: int = 6) -> Req:
    return Req(rid, list(PROMPTS[rid]), SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def follow(
    sent: list[Any], executor: TracingExecutor | None = None
) -> tuple[ReplicatedScheduler, dict[str, Req]]:
    """A follower that replays `sent`; returns it and the requests it built, by rid."""
    follower = build(Replay(sent), executor or TracingExecutor())
    made: dict[str, Req] = {}
    inner = follower._make_req

    def make_req(added: Any) -> Req:
        made[added.rid] = inner(added)
        return made[added.rid]

    follower._make_req = make_req  # type: ignore[method-assign]
    follower.serve_forever()
    return follower, made


def run_to_end(leader: ReplicatedScheduler) -> None:
    while leader.has_work:
        leader.step()
    leader.close()


def assert_same_state(leader: ReplicatedScheduler, follower: ReplicatedScheduler) -> None:
    assert isinstance(leader.executor, TracingExecutor)
    assert isinstance(follower.executor, TracingExecutor)
    assert follower.executor.trace == leader.executor.trace
    for s in (leader, follower):
        assert not s.running and not s.waiting
        assert s.allocator.num_free_pages == s.allocator.num_usable_pages
        assert s.req_pool.num_free_slots == SLOTS


def ops_of(sent: list[Any]) -> list[tuple[str, Any]]:
    return [op for inputs in sent for op in inputs.ops]


def test_groups_batched_aborts_and_queue_expiry_replay_on_followers() -> None:
    comm = Recorder()
    leader = build(comm, TracingExecutor())
    leader.add_group([req("r0"), req("r1")])
    leader.add(req("r2"))
    leader.step()
    leader.step()
    leader.abort("r0")
    leader.abort("r1")  # one record for both
    leader.add(req("r3"))
    leader.add(req("r4"))  # waits: r2 and r3 run (max 3 running), r4 is admitted next step
    leader.step()
    leader.add(req("r0", max_new=3))  # a finished rid is free again; it waits behind nobody
    expired = leader.expire_waiting(float("inf"))  # the clock's decision, on rank 0
    run_to_end(leader)
    assert [r.rid for r in expired] == ["r0"]
    ops = ops_of(comm.sent)
    assert ("abort", ("r0", "r1")) in ops
    assert ("abort", ("r0",)) in ops  # the expiry
    groups = [tuple(a.rid for a in arg) for kind, arg in ops if kind == "add_group"]
    assert groups == [("r0", "r1"), ("r2",), ("r3",), ("r4",), ("r0",)]

    follower, made = follow(comm.sent)
    assert_same_state(leader, follower)
    assert made["r2"].output_ids and made["r4"].output_ids
    assert made["r0"].finish_reason == {"type": "abort"}


def test_a_group_rejected_on_rank_0_is_never_broadcast() -> None:
    comm = Recorder()
    leader = build(comm, TracingExecutor())
    leader.add(req("r0"))
    with pytest.raises(ValueError, match="already in use"):
        leader.add_group([req("r1"), req("r0")])
    run_to_end(leader)
    groups = [tuple(a.rid for a in arg) for kind, arg in ops_of(comm.sent) if kind == "add_group"]
    assert groups == [("r0",)]
    follower, _ = follow(comm.sent)
    assert_same_state(leader, follower)


def test_a_request_failed_alone_on_rank_0_fails_on_every_rank() -> None:
    """A host-side failure on rank 0 only (here: applying r1's third token) reaches the
    followers as a failure before the next plan."""
    comm = Recorder()
    leader = build(comm, TracingExecutor())
    inner = leader._append_tokens

    def append_tokens(r: Req, u: Any) -> None:
        if r.rid == "r1" and len(r.output_ids) == 2:
            raise RuntimeError("detokenizer fault")
        inner(r, u)

    leader._append_tokens = append_tokens  # type: ignore[method-assign]
    for rid in ("r0", "r1", "r2"):
        leader.add(req(rid))
    failed: list[str] = []
    while leader.has_work:
        failed += [r.rid for r in leader.step().failed]
    leader.close()
    assert failed == ["r1"]
    follower, made = follow(comm.sent)
    assert_same_state(leader, follower)
    assert made["r1"].finish_reason == {
        "type": "abort",
        "message": "RuntimeError: detokenizer fault",
    }
    assert made["r1"].error == "RuntimeError: detokenizer fault"
    assert len(made["r0"].output_ids) == len(made["r2"].output_ids) == 6


def test_a_step_fault_isolated_on_every_rank_fails_the_same_request() -> None:
    """A device fault every rank sees: each retries the step request by request and fails the
    same request; rank 0's failure record is then a no-op on the followers."""
    comm = Recorder()
    leader = build(comm, TracingExecutor(fail_rid="r1", fail_after=2))
    for rid in ("r0", "r1", "r2"):
        leader.add(req(rid))
    failed: list[str] = []
    while leader.has_work:
        failed += [r.rid for r in leader.step().failed]
    leader.close()
    assert failed == ["r1"]
    follower, made = follow(comm.sent, TracingExecutor(fail_rid="r1", fail_after=2))
    assert_same_state(leader, follower)
    assert made["r1"].error is not None and "device fault on r1" in made["r1"].error
    assert len(made["r0"].output_ids) == 6


def test_a_follower_that_fails_a_request_rank_0_kept_stops_with_an_error() -> None:
    comm = Recorder()
    leader = build(comm, TracingExecutor())
    for rid in ("r0", "r1"):
        leader.add(req(rid))
    run_to_end(leader)
    with pytest.raises(RuntimeError, match=r"rank 1 failed requests that rank 0 kept \(\['r1'\]\)"):
        follow(comm.sent, TracingExecutor(fail_rid="r1", fail_after=2))


def test_followers_rebuild_the_logprob_options_of_each_request() -> None:
    comm = Recorder()
    leader = build(comm, TracingExecutor())
    r = req("r0")
    r.return_logprob, r.logprob_start_len, r.top_logprobs_num = True, 2, 3
    r.token_ids_logprob = (4, 9)
    leader.add(r)
    run_to_end(leader)
    _, made = follow(comm.sent)
    got = made["r0"]
    assert (got.return_logprob, got.logprob_start_len, got.top_logprobs_num) == (True, 2, 3)
    assert got.token_ids_logprob == (4, 9)
