"""torch.profiler views of an engine's decode steps (benchmarks' `--profile`)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from sgl_dspark import Engine
from sgl_dspark.srt.entrypoints.logprob_format import LogprobOptions


def profile_steps(engine: Engine, prompts: list[list[int]], path: Path, steps: int = 8) -> None:
    """torch.profiler table (CPU and CUDA time per op, kernel counts) over `steps` decode steps
    after prefill."""
    from torch.profiler import ProfilerActivity, profile

    sched = engine.scheduler
    reqs = [
        engine._make_req(
            p,
            {"max_new_tokens": 10 * steps, "temperature": 0.0, "ignore_eos": True},
            LogprobOptions(),
        )
        for p in prompts
    ]
    for r in reqs:
        sched.add(r)
    while not all(r.prefill_done and r.output_ids for r in reqs):
        sched.step()
    for _ in range(3):
        sched.step()
    # A CPU engine (the benchmarks' CPU tests) has no device kernels: the tables show host ops.
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            sched.step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    device_key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=device_key, row_limit=45)
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    path.write_text(
        f"{steps} steps, {wall * 1e3:.2f} ms/step wall (under the profiler)\n\n"
        f"{table}\n\n{cpu}\n\n{kernel_list(prof, steps)}\n"
    )
    while sched.has_work:
        sched.step()


def kernel_list(prof, steps: int) -> str:
    """Every device kernel of the profiled steps: launches and microseconds per step, by name
    (the key_averages table truncates and mixes CPU ops in)."""
    from torch.autograd import DeviceType

    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            a = agg.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.device_time_total
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    n = sum(v[0] for v in agg.values()) / steps
    t = sum(v[1] for v in agg.values()) / steps
    lines = [
        f"device kernels per step: {n:.1f} launches, {t:.1f} us",
        "",
        "| launches/step | us/step | kernel |",
        "|---|---|---|",
    ]
    lines += [f"| {c / steps:.2f} | {us / steps:.1f} | {name[:140]} |" for name, (c, us) in rows]
    return "\n".join(lines)
