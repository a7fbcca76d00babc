"""What the ranks of the parallel tests run: engines of one layout built inside a spawned
world (`Engine.for_rank`), driven by the block's first rank while the others follow, with
every target forward's logits recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from sgl_dspark.srt.distributed import ParallelLayout, get_parallel_state, init_parallel_state
from sgl_dspark.srt.entrypoints.engine import Engine
from sgl_dspark.srt.managers.replicated_scheduler import ReplicatedScheduler
from sgl_dspark.srt.server_args import ServerArgs

# Prompts of 9..11 tokens prefill in chunks of 16 (the second one is split over two steps);
# different output lengths make the batch shrink while the requests decode.
PROMPTS = [[(7 * i + 3 * j) % 90 + 40 for j in range(9 + i)] for i in range(3)]
MAX_NEW = [8, 12, 16]


def width_table(path: Path) -> str:
    """Verify widths 8 / 5 / 3 by batch size 3 / 2 / 1 (the block size is 7)."""
    path.write_text(json.dumps({"device": "cpu", "widths_by_batch_size": {"1": 3, "2": 5, "3": 8}}))
    return str(path)


def engine_args(layout: ParallelLayout, combine: str, spec: bool, out_dir: Path) -> ServerArgs:
    extra: dict[str, Any] = {}
    if spec:
        extra = dict(
            speculative_algorithm="DSpark",
            speculative_dspark_block_size=7,
            speculative_dspark_verify_policy="static",
            speculative_dspark_width_table_path=width_table(out_dir / f"widths{os.getpid()}.json"),
        )
    return ServerArgs(
        model_path="tiny",
        device="cpu",
        context_length=128,
        max_total_tokens=1024,
        max_running_requests=4,
        chunked_prefill_size=16,
        tp_size=layout.tp_size,
        ep_size=layout.ep_size,
        ep_combine=combine,
        skip_tokenizer_init=True,
        **extra,
    ).resolved()


def record_logits(engine: Engine) -> list[torch.Tensor]:
    """Every logits tensor the target computes from now on, in order."""
    seen: list[torch.Tensor] = []
    runner = engine.runner
    inner = runner.run_model

    def run_model(*a: Any, **k: Any) -> Any:
        out = inner(*a, **k)
        seen.append(out.logits.detach().clone())
        return out

    runner.run_model = run_model  # type: ignore[method-assign]
    return seen


def run_layout(
    rank: int,
    out_dir: Path,
    name: str,
    layout: ParallelLayout,
    combine: str,
    spec: bool,
    params: list[dict],
    graphs: bool = False,
) -> None:
    """Every rank of the world calls this (group creation is collective); only the first
    block of `layout.world_size` ranks runs the engine, and its first rank saves
    `{name}.pt`: the outputs and every logits tensor. `graphs`: every rank captures the
    engine's graphs (`EagerGraph` stand-ins on CPU, with the collectives inside) and the
    steps replay them (with DSpark and the overlap schedule: fused steps)."""
    from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph

    init_parallel_state(layout, combine)
    if rank >= layout.world_size:
        return
    engine = Engine.for_rank(engine_args(layout, combine, spec, out_dir))
    logits = record_logits(engine)  # graph captures included: the same on every layout
    if graphs:
        engine.init_graphs(len(PROMPTS), prefill_max_tokens=32, graph_factory=EagerGraph)
    scheduler = engine.scheduler
    if rank > 0:
        assert isinstance(scheduler, ReplicatedScheduler)
        scheduler.serve_forever()
        engine.executor.close()
        return
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    if isinstance(scheduler, ReplicatedScheduler):
        scheduler.close()
    engine.executor.close()
    assert get_parallel_state().layout == layout
    torch.save(
        {"output_ids": [o["output_ids"] for o in outs], "logits": logits}, out_dir / f"{name}.pt"
    )


def greedy_params() -> list[dict]:
    return [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in MAX_NEW]


def record_trace(engine: Engine) -> list[tuple]:
    """Every step the executor launches from now on, as (prompt chunks (rid, start, length),
    decoding rids with their committed lengths)."""
    trace: list[tuple] = []
    executor = engine.executor
    inner = executor.launch

    def launch(work: Any, prev: Any) -> Any:
        trace.append(
            (
                tuple((r.rid, r.kv_len, len(chunk)) for r, chunk in work.prefill),
                tuple((r.rid, r.kv_len) for r in work.decode),
            )
        )
        return inner(work, prev)

    executor.launch = launch  # type: ignore[method-assign]
    return trace


def run_abort_and_trace(rank: int, out_dir: Path, layout: ParallelLayout, spec: bool) -> None:
    """Rank 0 queues three requests, aborts one mid-decode and runs the rest to the end; every
    rank saves its scheduling trace and its KV pool's state afterwards
    (`abort_rank{r}.pt`)."""
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.sampling.sampling_params import SamplingParams

    init_parallel_state(layout, "exact")
    if rank >= layout.world_size:
        return
    engine = Engine.for_rank(engine_args(layout, "exact", spec, out_dir))
    scheduler = engine.scheduler
    assert isinstance(scheduler, ReplicatedScheduler)
    trace = record_trace(engine)
    initial_free_slots = engine.runner.req_pool.num_free_slots
    if rank == 0:
        for i, (prompt, params) in enumerate(zip(PROMPTS, greedy_params())):
            scheduler.add(Req(str(i), list(prompt), SamplingParams.from_dict(params)))
        aborted = False
        while scheduler.has_work:
            scheduler.step()
            req = scheduler.running.get("2")
            if not aborted and req is not None and len(req.output_ids) >= 2:
                scheduler.abort("2")
                aborted = True
        assert aborted
        scheduler.close()
    else:
        scheduler.serve_forever()
    engine.executor.close()
    alloc, pool = engine.runner.allocator, engine.runner.req_pool
    state = {
        "trace": trace,
        "free_pages": alloc.num_free_pages,
        "usable_pages": alloc.num_usable_pages,
        "free_slots": pool.num_free_slots,
        "initial_free_slots": initial_free_slots,
        "running": len(scheduler.running) + len(scheduler.waiting),
    }
    torch.save(state, out_dir / f"abort_rank{rank}.pt")


def run_shard_argmax(rank: int, out_dir: Path, triton: bool) -> None:
    """Both ranks of a TP-2 world pick greedy ids from their halves of crafted logits rows
    (ties and NaNs across the shard border); rank 0 saves (picked, torch.argmax of the full
    rows)."""
    from sgl_dspark.srt.layers.vocab_parallel import shard_argmax

    state = init_parallel_state(ParallelLayout(2, 1))
    if rank >= 2:
        return
    g = torch.Generator().manual_seed(5)
    full = torch.randn(9, 64, generator=g)
    full[0, 10] = full[0, 40] = 9.0  # a tie across the border: the smaller index wins
    full[1, 31] = full[1, 32] = 9.0  # a tie at the border itself
    full[2, 50] = float("nan")  # a NaN on the second shard beats every number
    full[3, 5] = full[3, 45] = float("nan")  # NaNs on both: the first
    full[4] = float("-inf")  # all -inf: the first column
    full[5, 33] = 9.0  # first column of the second shard
    full[6, 31] = 9.0  # last column of the first shard
    full[7, :] = 1.0  # all equal
    full[8, 40] = float("inf")
    full[8, 20] = float("inf")
    half = full.shape[1] // 2
    local = full[:, rank * half : (rank + 1) * half].contiguous()
    picked = shard_argmax(local, rank * half, state.tp, triton=triton)
    if rank == 0:
        torch.save(
            {"picked": picked, "expected": torch.argmax(full, -1)},
            out_dir / f"argmax_{'triton' if triton else 'torch'}.pt",
        )
