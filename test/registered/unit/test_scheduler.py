"""The host-only scheduler over a fake executor (no model): admission and admission control,
chunked prefill, overlap chaining, aborts mid-step, finish reasons and KV page accounting."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.core.step import (
    BaseStepExecutor,
    CompletedStep,
    InflightStep,
    ReqUpdate,
    StepWork,
)
from sgl_dspark.srt.managers.scheduler import RequestRejected, Scheduler, SchedulerConfig
from sgl_dspark.srt.mem_cache.allocator import PagedTokenAllocator, ReqToTokenPool
from sgl_dspark.srt.sampling import SamplingParams

PAGE = 4
VOCAB = 50


def next_token(prev: int) -> int:
    """The fake model: a fixed successor of the previous token."""
    return (prev * 7 + 3) % VOCAB


class FakeInflight(InflightStep):
    kind = "decode"

    def __init__(self, work: StepWork, updates: list[ReqUpdate], chainable: bool) -> None:
        self.work = work
        self._updates = updates
        self.chainable = chainable
        self.waited = False

    @property
    def reqs(self) -> tuple[Req, ...]:
        return self.work.reqs

    def wait(self) -> list[ReqUpdate]:
        assert not self.waited, "a step is read once"
        self.waited = True
        return self._updates


class FakeExecutor(BaseStepExecutor):
    """Samples `next_token` of the last token; a decode step chained onto one in flight reads
    that step's tokens (as a device-side chain would) instead of the requests' lagging state."""

    def __init__(self, window: int = 1) -> None:
        self.window = window
        self.launches: list[tuple[StepWork, bool]] = []  # (work, chained)
        self.admitted: list[str] = []
        self.released: list[str] = []

    @property
    def step_window(self) -> int:
        return self.window

    def on_admit(self, req: Req) -> None:
        self.admitted.append(req.rid)

    def on_release(self, req: Req) -> None:
        assert req.slot >= 0, "released before its slot is freed"
        self.released.append(req.rid)

    def can_chain(self, work: StepWork, prev: InflightStep) -> bool:
        return (
            isinstance(prev, FakeInflight)
            and prev.chainable
            and not work.prefill
            and list(work.decode) == list(prev.work.decode)
        )

    def launch(self, work: StepWork, prev: InflightStep | None) -> InflightStep:
        self.launches.append((work, prev is not None))
        pending: dict[str, int] = {}
        if prev is not None:
            assert isinstance(prev, FakeInflight)
            pending = {u.req.rid: u.tokens[-1] for u in prev._updates if u.tokens}
        updates = []
        for req, chunk in work.prefill:
            assert list(chunk) == req.prompt_ids[req.kv_len : req.kv_len + len(chunk)]
            done = req.kv_len + len(chunk) == len(req.prompt_ids)
            tok = (next_token(chunk[-1]),) if done else ()
            updates.append(ReqUpdate(req, len(chunk), tok, tuple(-0.5 for _ in tok)))
        for req in work.decode:
            last = pending.get(req.rid, req.output_ids[-1] if req.output_ids else None)
            assert last is not None
            updates.append(ReqUpdate(req, 1, (next_token(last),), (-0.25,)))
        return FakeInflight(work, updates, chainable=not work.prefill)


def make(
    overlap: bool = False,
    pages: int = 64,
    slots: int = 8,
    chunk: int = 16,
    max_running: int = 8,
    window: int = 1,
    eos: tuple[int, ...] = (),
    executor: FakeExecutor | None = None,
) -> tuple[Scheduler, FakeExecutor]:
    allocator = PagedTokenAllocator(pages + 1, PAGE)
    pool = ReqToTokenPool(slots, 128, allocator, "cpu")
    executor = executor or FakeExecutor(window)
    cfg = SchedulerConfig(
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        eos_token_ids=eos,
        vocab_size=VOCAB,
        overlap_schedule=overlap,
    )
    return Scheduler(cfg, pool, allocator, executor), executor


def req(rid: str, prompt: list[int], max_new: int = 5, **params) -> Req:
    return Req(
        rid=rid,
        prompt_ids=prompt,
        params=SamplingParams(max_new_tokens=max_new, temperature=0.0, **params),
    )


def expected_output(prompt: list[int], n: int) -> list[int]:
    out, prev = [], prompt[-1]
    for _ in range(n):
        prev = next_token(prev)
        out.append(prev)
    return out


def run(sched: Scheduler, limit: int = 200) -> int:
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
        assert steps < limit, "the scheduler did not finish"
    return steps


def test_scheduler_module_imports_no_torch():
    code = (
        "import sys\n"
        "import sgl_dspark.srt.managers.scheduler\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_finish_reasons_and_pages_come_back(overlap):
    sched, executor = make(overlap=overlap, eos=(next_token(next_token(9)),))
    reqs = [
        req("a", [1, 2, 3], max_new=6),
        req("b", list(range(5, 30)), max_new=3),  # 25 prompt tokens: two prefill chunks
        req("c", [7, 8, 9], max_new=10),  # hits the eos token after two tokens
        req("d", [4, 4], max_new=10, stop_token_ids=(next_token(4),)),
        req("e", [11], max_new=0),
    ]
    for r in reqs:
        sched.add(r)
    run(sched)
    assert reqs[0].output_ids == expected_output([1, 2, 3], 6)
    assert reqs[0].finish_reason == {"type": "length", "length": 6}
    assert reqs[1].output_ids == expected_output(list(range(5, 30)), 3)
    assert reqs[2].output_ids == expected_output([7, 8, 9], 2)
    assert reqs[2].finish_reason == {"type": "stop", "matched": reqs[2].output_ids[-1]}
    assert reqs[3].output_ids == [next_token(4)]
    assert reqs[3].finish_reason["type"] == "stop"
    assert reqs[4].output_ids == [] and reqs[4].finish_reason == {"type": "length", "length": 0}
    for r in reqs:
        assert r.slot == -1
        assert r.output_logprobs == [-0.5] + [-0.25] * (len(r.output_ids) - 1) or not r.output_ids
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert sched.req_pool.num_free_slots == 8 and sched._reserved_pages == 0
    assert sorted(executor.released) == sorted(executor.admitted) == sorted("abcde")


def test_chunked_prefill_budget_is_shared_in_order():
    sched, executor = make(chunk=10)
    long_a, long_b = req("a", list(range(1, 24)), 2), req("b", list(range(30, 42)), 2)
    sched.add(long_a)
    sched.add(long_b)
    sched.step()
    work, _ = executor.launches[-1]
    assert [(r.rid, len(c)) for r, c in work.prefill] == [("a", 10)]
    sched.step()
    assert [(r.rid, len(c)) for r, c in executor.launches[-1][0].prefill] == [("a", 10)]
    sched.step()  # a's last 3 tokens, then 7 of b's
    assert [(r.rid, len(c)) for r, c in executor.launches[-1][0].prefill] == [("a", 3), ("b", 7)]
    assert long_a.output_ids and not long_b.output_ids
    run(sched)
    assert long_b.output_ids == expected_output(long_b.prompt_ids, 2)


def test_admission_control_reserves_pages_and_keeps_fcfs_order():
    # 8 usable pages of 4 tokens: each request reserves ceil((prompt + max_new + 1) / 4) pages.
    sched, _ = make(pages=8)
    big = req("big", list(range(1, 20)), max_new=5)  # 25 tokens -> 7 pages
    small = req("small", [1, 2], max_new=2)  # 5 tokens -> 2 pages: would fit, but waits (FCFS)
    first = req("first", [3, 4], max_new=2)
    for r in (first, big, small):
        sched.add(r)
    sched.step()
    assert list(sched.running) == ["first"] and list(sched.waiting) == ["big", "small"]
    assert sched.allocator.num_free_pages == 8 - 2  # pages are mapped at admission
    run(sched)
    assert all(r.finished for r in (first, big, small))
    assert sched.allocator.num_free_pages == 8


def test_max_running_requests_and_slots_bound_the_batch():
    sched, executor = make(max_running=2)
    reqs = [req(str(i), [i + 1, i + 2], max_new=3) for i in range(5)]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
        assert len(sched.running) <= 2
        work, _ = executor.launches[-1]
        assert len(work.reqs) <= 2
    assert all(r.output_ids == expected_output(r.prompt_ids, 3) for r in reqs)


def test_requests_that_can_never_run_are_rejected():
    sched, _ = make(pages=4)
    with pytest.raises(RequestRejected, match="empty"):
        sched.add(req("x", []))
    with pytest.raises(RequestRejected, match="context length"):
        sched.add(req("x", [1] * 120, max_new=20))
    with pytest.raises(RequestRejected, match="pool"):
        sched.add(req("x", [1] * 20, max_new=5))
    with pytest.raises(RequestRejected, match="out of range"):
        sched.add(req("x", [1, VOCAB]))
    sched.add(req("y", [1]))
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add(req("y", [2]))


def test_the_step_window_is_part_of_the_reservation():
    sched, _ = make(pages=8, window=8)
    sched.add(req("a", [1, 2, 3, 4], max_new=4))  # 4 + 4 + 8 = 16 tokens -> 4 pages
    sched.step()
    assert sched._reserved_pages == 4 and sched.allocator.num_free_pages == 4


def test_overlap_chains_decode_steps_and_matches_step_by_step():
    outs = {}
    for overlap in (False, True):
        sched, executor = make(overlap=overlap)
        reqs = [req("a", [1, 2], 9), req("b", [3, 4, 5], 4), req("c", [6], 12)]
        for r in reqs:
            sched.add(r)
        run(sched)
        outs[overlap] = [list(r.output_ids) for r in reqs], executor.launches
    (want, plain), (got, overlapped) = outs[False], outs[True]
    assert got == want
    assert not any(chained for _, chained in plain)
    assert sum(chained for _, chained in overlapped) >= 5
    # The batch changes (b finishes, or a prompt joins): those launches are never chained.
    for (work, chained), (prev, _) in zip(overlapped[1:], overlapped):
        if chained:
            assert list(work.decode) == list(prev.decode) and not work.prefill


def test_a_request_finished_in_flight_rides_along_and_takes_nothing():
    sched, executor = make(overlap=True)
    a, b = req("a", [1, 2], 2), req("b", [3, 4], 8)
    sched.add(a)
    sched.add(b)
    run(sched)
    assert a.output_ids == expected_output([1, 2], 2) and a.finish_reason["type"] == "length"
    assert b.output_ids == expected_output([3, 4], 8)
    # a's last token was read while the next step (with a in it) ran: that step's token for a
    # was dropped, and a was never part of a launch after it.
    rides = [w for w, _ in executor.launches if a in w.decode]
    assert len(rides) == 2  # its one decode step, and the step launched before it was read


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_step_releases_at_once_and_drops_its_results(overlap):
    sched, executor = make(overlap=overlap)
    a, b = req("a", [1, 2], 20), req("b", [3], 20)
    waiting = req("w", [5, 6], 3)
    sched.add(a)
    sched.add(b)
    for _ in range(4):
        sched.step()
    free_before = sched.allocator.num_free_pages
    n = len(a.output_ids)
    assert sched.abort("a") is a and a.finish_reason == {"type": "abort"}
    assert a.slot == -1 and sched.allocator.num_free_pages > free_before
    assert sched.abort("a") is None  # aborting twice is a no-op
    sched.add(waiting)
    assert sched.abort("w") is waiting and "w" not in sched.waiting
    run(sched)
    assert len(a.output_ids) == n  # nothing arrived after the abort
    assert b.output_ids == expected_output([3], 20)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert executor.released.count("a") == 1 and "w" not in executor.admitted


def test_completed_steps_are_applied_at_once():
    """An executor step that is not chainable (here: every one) is read in the same call."""

    class Eager(FakeExecutor):
        def launch(self, work, prev):
            step = super().launch(work, prev)
            return CompletedStep(work.reqs, step.wait())

    allocator = PagedTokenAllocator(33, PAGE)
    pool = ReqToTokenPool(4, 64, allocator, "cpu")
    sched = Scheduler(SchedulerConfig(overlap_schedule=True), pool, allocator, Eager())
    r = req("a", [1, 2, 3], 3)
    sched.add(r)
    result = sched.step()
    assert result.updated == [r] and r.output_ids == expected_output([1, 2, 3], 1)
    while sched.has_work:
        sched.step()
    assert r.output_ids == expected_output([1, 2, 3], 3)


# ---- failure isolation ----------------------------------------------------------------------
class PoisonExecutor(FakeExecutor):
    """Raises when a step holds a request whose prompt starts with POISON (at launch, or when
    the step is read with `fail_at_wait`), and for one batch shape only with `fail_batch_of`."""

    POISON = 13

    def __init__(self, fail_at_wait: bool = False, fail_batch_of: int | None = None) -> None:
        super().__init__()
        self.fail_at_wait = fail_at_wait
        self.fail_batch_of = fail_batch_of

    def _doomed(self, work: StepWork) -> bool:
        if self.fail_batch_of is not None:
            return len(work.reqs) == self.fail_batch_of
        return any(r.prompt_ids[0] == self.POISON for r in work.reqs)

    def launch(self, work: StepWork, prev: InflightStep | None) -> InflightStep:
        step = super().launch(work, prev)
        if self._doomed(work):
            if not self.fail_at_wait:
                raise RuntimeError("device fault")
            step.wait = lambda: (_ for _ in ()).throw(RuntimeError("device fault at read"))
        return step


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fail_at_wait", [False, True])
def test_a_step_failure_fails_only_the_request_it_is_attributed_to(overlap, fail_at_wait):
    sched, _ = make(overlap=overlap, executor=PoisonExecutor(fail_at_wait=fail_at_wait))
    good = [req(f"g{i}", [1 + i, 2 + i, 3 + i], max_new=8) for i in range(3)]
    for r in good[:2]:
        sched.add(r)
    sched.step()
    sched.step()  # the good ones are decoding (and, with overlap, a step is in flight)
    bad = req("bad", [PoisonExecutor.POISON, 1, 2], max_new=8)
    sched.add(bad)
    sched.add(good[2])
    failed = []
    while sched.has_work:
        failed += sched.step().failed
    assert failed == [bad]
    assert bad.error == "RuntimeError: device fault" + (" at read" if fail_at_wait else "")
    assert bad.finish_reason == {"type": "abort", "message": bad.error} and bad.slot == -1
    for r in good:
        assert r.output_ids == expected_output(r.prompt_ids, 8), r.rid
        assert r.finish_reason == {"type": "length", "length": 8}
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert sched._reserved_pages == 0 and sched.req_pool.num_free_slots == 8


def test_a_failure_of_one_batch_shape_is_retried_and_fails_nobody():
    sched, _ = make(executor=PoisonExecutor(fail_batch_of=3))
    reqs = [req(f"r{i}", [2 * i + 1, 2 * i + 2], max_new=6) for i in range(3)]
    for r in reqs:
        sched.add(r)
    failed = []
    while sched.has_work:
        failed += sched.step().failed
    assert failed == []
    for r in reqs:
        assert r.output_ids == expected_output(r.prompt_ids, 6)


def test_a_failure_applying_one_update_fails_that_request_alone():
    class ExplodingDetok:
        def append(self, tokens):
            raise UnicodeError("detokenizer exploded")

    sched, _ = make()
    good, bad = req("good", [1, 2], max_new=4), req("bad", [3, 4], max_new=4)
    bad.detok = ExplodingDetok()  # type: ignore[assignment]
    sched.add_group([good, bad])
    results = []
    while sched.has_work:
        results.append(sched.step())
    assert [r for res in results for r in res.failed] == [bad]
    assert all(bad not in res.updated for res in results)
    assert bad.error == "UnicodeError: detokenizer exploded"
    assert good.output_ids == expected_output([1, 2], 4)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_groups_are_queued_together_or_not_at_all():
    sched, _ = make()
    ok = req("x", [1, 2])
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add_group([ok, req("x", [3])])
    with pytest.raises(RequestRejected, match="out of range"):
        sched.add_group([req("y", [1]), req("z", [VOCAB + 1])])
    assert not sched.waiting
    sched.add_group([ok, req("y", [1])])
    assert list(sched.waiting) == ["x", "y"]


def test_expire_waiting_takes_the_oldest_from_the_head_only():
    sched, _ = make(slots=1, max_running=1)
    reqs = [req(f"q{i}", [1, 2], max_new=3) for i in range(4)]
    for i, r in enumerate(reqs):
        r.queued_at = 10.0 + i
        sched.add(r)
    sched.step()  # q0 runs, the others wait
    assert list(sched.waiting) == ["q1", "q2", "q3"]
    expired = sched.expire_waiting(queued_before=12.5)
    assert expired == reqs[1:3] and list(sched.waiting) == ["q3"]
    assert all(r.finish_reason == {"type": "abort", "message": "queue timeout"} for r in expired)
    assert sched.expire_waiting(queued_before=5.0) == []
    run(sched)
    assert reqs[0].output_ids and reqs[3].output_ids
