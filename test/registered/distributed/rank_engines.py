"""What the ranks of the parallel tests run: engines of one layout built inside a spawned
world (`Engine.for_rank`), driven by the block's first rank while the others follow, with
every target forward's logits recorded."""

from __future__ import annotations

import json
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
            speculative_dspark_width_table_path=width_table(out_dir / "widths.json"),
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
) -> None:
    """Every rank of the world calls this (group creation is collective); only the first
    block of `layout.world_size` ranks runs the engine, and its first rank saves
    `{name}.pt`: the outputs and every logits tensor."""
    init_parallel_state(layout, combine)
    if rank >= layout.world_size:
        return
    engine = Engine.for_rank(engine_args(layout, combine, spec, out_dir))
    scheduler = engine.scheduler
    if rank > 0:
        assert isinstance(scheduler, ReplicatedScheduler)
        scheduler.serve_forever()
        engine.executor.close()
        return
    logits = record_logits(engine)
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
