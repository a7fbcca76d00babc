"""What the ranks of the parallel tests run: engines of one layout built inside a spawned
world (`Engine.for_rank`), driven by the block's first rank while the others follow, with
every target forward's logits recorded."""

from __future__ import annotations

import functools
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


def sps_table(path: Path) -> str:
    """A diagonal SPS table (10 ms + 0.4 ms per verify token) for the confidence policy."""
    tokens = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    steps = [1000.0 / (10.0 + 0.4 * t) for t in tokens]
    table = {"sample_batch_tokens": tokens, "sample_steps_per_sec": steps, "max_batch_tokens": 256}
    path.write_text(json.dumps(table))
    return str(path)


def engine_args(
    layout: ParallelLayout, combine: str, spec: bool, out_dir: Path, **options: Any
) -> ServerArgs:
    extra: dict[str, Any] = {}
    if spec:
        extra.update(
            speculative_algorithm="DSpark",
            speculative_dspark_block_size=7,
            speculative_dspark_verify_policy="static",
            speculative_dspark_width_table_path=width_table(out_dir / f"widths{os.getpid()}.json"),
        )
    args: dict[str, Any] = dict(
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
    )
    # `options` may replace any of these and the DSpark defaults (another model or policy)
    args.update(extra)
    args.update(options)
    return ServerArgs(**args).resolved()


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
    **options: Any,
) -> None:
    """Every rank of the world calls this (group creation is collective); only the first
    block of `layout.world_size` ranks runs the engine, and its first rank saves
    `{name}.pt`: the outputs, every logits tensor and the graph replays. `graphs`: every rank captures the
    engine's graphs (`EagerGraph` stand-ins on CPU, with the collectives inside) and the
    steps replay them (with DSpark and the overlap schedule: fused steps). `options`: more
    server arguments (`engine_args`)."""
    from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph

    # pytest --poison-stale-graph-outputs (conftest.py) reaches a spawned rank through this.
    EagerGraph.poison_by_default = (
        os.environ.get("SGL_DSPARK_TEST_POISON_STALE_GRAPH_OUTPUTS") == "1"
    )

    init_parallel_state(layout, combine)
    if rank >= layout.world_size:
        return
    engine = Engine.for_rank(engine_args(layout, combine, spec, out_dir, **options))
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
    replays = dict(engine.graphs.replays) if engine.graphs is not None else {}
    torch.save(
        {"output_ids": [o["output_ids"] for o in outs], "logits": logits, "replays": replays},
        out_dir / f"{name}.pt",
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


_GATHERED: list[tuple[int, ...]] = []
_GATHERS_COUNTED = False


def count_gathers() -> list[tuple[int, ...]]:
    """The shape of every tensor this process all-gathers from now on (every
    `TorchDistCommunicator.all_gather` call), in order."""
    global _GATHERS_COUNTED
    from sgl_dspark.srt.distributed import TorchDistCommunicator

    if not _GATHERS_COUNTED:
        inner = TorchDistCommunicator.all_gather

        def all_gather(self: Any, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
            _GATHERED.append(tuple(x.shape))
            return inner(self, x, dim)

        TorchDistCommunicator.all_gather = all_gather  # type: ignore[method-assign]
        _GATHERS_COUNTED = True
    _GATHERED.clear()
    return _GATHERED


_SPLITS: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
_SPLITS_RECORDED = False


def record_splits() -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every step's split of its rows between the greedy picks and whole rows in this process
    from now on (each `RowSplit` built: its greedy and its whole positions), in order."""
    global _SPLITS_RECORDED
    from sgl_dspark.srt.layers.vocab_parallel import RowSplit

    if not _SPLITS_RECORDED:
        inner = RowSplit.__init__

        def init(self: Any, greedy: Any, whole: Any, device: torch.device) -> None:
            inner(self, greedy, whole, device)
            _SPLITS.append((self.greedy, self.whole))

        RowSplit.__init__ = init  # type: ignore[method-assign]
        _SPLITS_RECORDED = True
    _SPLITS.clear()
    return _SPLITS


def count_calls(obj: Any, name: str) -> list[int]:
    """One entry per call of `obj.name` from now on."""
    calls: list[int] = []
    inner = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return inner(*a, **k)

    setattr(obj, name, wrapper)
    return calls


def run_counted(
    rank: int,
    out_dir: Path,
    name: str,
    layout: ParallelLayout,
    spec: bool,
    params: list[dict],
    graphs: bool = False,
    engine_options: dict[str, Any] | None = None,
    req_options: list[dict[str, Any]] | None = None,
    **logprob_options: Any,
) -> None:
    """`run_layout` without recording logits (a recording reads whole rows): rank 0 saves
    `{name}.pt` with the outputs (with `logprob_options` for `Engine.generate`, their output
    logprobs), the shape of every tensor its TP group all-gathered, the number of whole-row
    logits the DSpark draft asked for (`compute_logits`) and every step's split of its rows
    (`record_splits`); every other rank saves its own gathers and splits
    (`{name}_rank{rank}.pt`). `engine_options`: more server args; `req_options`: per
    request, `Req` fields to set over `logprob_options` (e.g. top-N logprobs for one request
    only), whose top-N and prompt logprobs are then saved too."""
    from sgl_dspark.srt.model_executor.cuda_graph_runner import EagerGraph

    # pytest --poison-stale-graph-outputs (conftest.py) reaches a spawned rank through this.
    EagerGraph.poison_by_default = (
        os.environ.get("SGL_DSPARK_TEST_POISON_STALE_GRAPH_OUTPUTS") == "1"
    )

    init_parallel_state(layout, "exact")
    if rank >= layout.world_size:
        return
    engine = Engine.for_rank(engine_args(layout, "exact", spec, out_dir, **(engine_options or {})))
    gathered = count_gathers()
    splits = record_splits()
    draft_logits = count_calls(engine.runner.model, "compute_logits")
    if graphs:
        engine.init_graphs(len(PROMPTS), prefill_max_tokens=32, graph_factory=EagerGraph)
    del gathered[:], draft_logits[:]  # the graph captures' own calls
    scheduler = engine.scheduler
    if rank > 0:
        assert isinstance(scheduler, ReplicatedScheduler)
        scheduler.serve_forever()
        engine.executor.close()
        torch.save(
            {"gathered": list(gathered), "splits": list(splits)},
            out_dir / f"{name}_rank{rank}.pt",
        )
        return
    made = []
    if req_options is not None:
        make = engine._make_req
        fields = iter(req_options)

        def make_req(*a: Any, **k: Any) -> Any:
            req = make(*a, **k)
            for key, value in next(fields).items():
                setattr(req, key, value)
            made.append(req)
            return req

        engine._make_req = make_req  # type: ignore[method-assign]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, **logprob_options)
    if isinstance(scheduler, ReplicatedScheduler):
        scheduler.close()
    engine.executor.close()
    replays = dict(engine.graphs.replays) if engine.graphs is not None else {}
    logprobs = [
        [entry[0] for entry in o["meta_info"]["output_token_logprobs"]]
        for o in outs
        if logprob_options.get("return_logprob")
    ]
    torch.save(
        {
            "output_ids": [o["output_ids"] for o in outs],
            "logprobs": logprobs,
            "gathered": list(gathered),
            "draft_logits": len(draft_logits),
            "splits": list(splits),
            "top_logprobs": [r.output_top_logprobs for r in made],
            "prompt_logprobs": [r.input_logprobs for r in made],
            "replays": replays,
            "shard_width": engine.runner.model.logits_reader.shard_width,
        },
        out_dir / f"{name}.pt",
    )


def edge_rows(border: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Logits rows whose greedy choice is decided at or across the column `border` between
    two shards (ties, NaN, +-inf, signed zeros), then large-magnitude and random rows."""
    nan, inf = float("nan"), float("inf")
    b = border
    rows = torch.randn(16, width, generator=gen) * 4
    rows[0, b - 5] = rows[0, b + 5] = 50.0  # tie across the border: the smaller index
    rows[1, b - 1] = rows[1, b] = 50.0  # tie at the border itself
    rows[2, b + 3] = nan  # a NaN on the second shard beats every number
    rows[3, 2] = rows[3, b + 2] = nan  # NaNs on both shards: the first
    rows[4] = -inf  # all -inf: column 0
    rows[5, :b] = -inf  # the first shard all -inf, the second finite
    rows[6, b] = 50.0  # first column of the second shard
    rows[7, b - 1] = 50.0  # last column of the first shard
    rows[8] = 1.0  # all equal: column 0
    rows[9, b + 1] = rows[9, 3] = inf  # +inf on both shards: the first
    rows[10] = -1.0
    rows[10, b - 1], rows[10, b] = -0.0, 0.0  # -0.0 == +0.0: the first
    rows[11, b:] = nan  # the second shard all NaN: its first column
    rows[12] = rows[12] * 2500 + 3e4  # large logits: no cancellation in the logprobs
    rows[13, b + 4] = inf  # one +inf on the second shard
    rows[14, b:] = -inf  # the second shard all -inf
    return rows


def run_shard_greedy(rank: int, out_dir: Path) -> None:
    """Both ranks of a TP-2 world pick greedy ids, logprobs and probe logprobs from their
    columns of crafted rows (`edge_rows`) through `shard_greedy` (torch and the
    `kernels/sampling` kernels), for an even split of 64 columns and an uneven one (37 | 27);
    every rank saves the rows, the probes and what it picked (`greedy_{split}_{impl}_r{rank}`)."""
    from sgl_dspark.srt.layers.vocab_parallel import shard_greedy

    state = init_parallel_state(ParallelLayout(2, 1))
    if rank >= 2:
        return
    for split, widths in (("even", (32, 32)), ("uneven", (37, 27))):
        gen = torch.Generator().manual_seed(11)
        width = sum(widths)
        full = torch.cat([edge_rows(widths[0], width, gen), torch.randn(40, width, generator=gen)])
        probes = torch.randint(0, width, (full.shape[0],), generator=gen)
        probes[:3] = torch.tensor([widths[0] - 1, widths[0], width - 1])
        start = sum(widths[:rank])
        local = full[:, start : start + widths[rank]].contiguous()
        for impl in ("torch", "triton"):
            pick = shard_greedy(local, start, state.tp, impl == "triton", probe_ids=probes)
            torch.save(
                {"full": full, "probes": probes, "pick": tuple(pick)},
                out_dir / f"greedy_{split}_{impl}_r{rank}.pt",
            )


MARKOV_GAMMA = 5
MARKOV_RANK = 8


def markov_inputs(border: int, width: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A greedy Markov loop's inputs over `width` columns whose drafts are decided at or
    across the column `border` between two shards (`markov_edge_cases` lists them).

    W1 and W2 hold multiples of 1/2 in [-1, 1] and the rank is 8, so every Markov correction
    `e @ W2^T` is exact in fp32 whatever the summation order: the whole-row loop and the
    per-shard loop compute the same step logits bit for bit, and a tie stays a tie. Each tie
    pairs two columns with equal W2 rows, so their corrections are equal for every previous
    token and the tie holds at every step."""
    nan, inf = float("nan"), float("inf")
    b, g = border, MARKOV_GAMMA

    def halves(*shape: int) -> torch.Tensor:
        return torch.randint(-2, 3, shape, generator=gen).float() / 2

    w1, w2 = halves(width, MARKOV_RANK), halves(width, MARKOV_RANK)
    # |correction| <= 8 and |U| stays far below 100 - 2 * 8: a 100 is each row's maximum.
    base = torch.randn(12, g, width, generator=gen)
    w2[b + 5] = w2[b - 5]
    base[0, :, b - 5] = base[0, :, b + 5] = 100.0  # tie across the border: the smaller index
    w2[b] = w2[b - 1]
    base[1, :, b - 1] = base[1, :, b] = 100.0  # tie at the border itself
    base[2, 1, b + 3] = nan  # a NaN on the second shard beats every number
    base[3, 2] = -inf  # all -inf (a finite correction keeps them -inf): column 0
    base[4, 0, b] = 100.0  # first column of the second shard
    base[4, 1, b - 1] = 100.0  # last column of the first shard
    base[5, 0, :b] = -inf  # the first shard all -inf, the second finite
    base[5, 1, b:] = -inf  # the second shard all -inf
    base[6, 3, 2] = base[6, 3, b + 2] = nan  # NaNs on both shards: the first
    base[6, 4, b + 1] = base[6, 4, 3] = inf  # +inf on both shards: the first
    anchors = torch.randint(0, width, (12,), generator=gen)
    anchors[:2] = torch.tensor([b - 1, b])
    return {"base": base, "w1": w1, "w2": w2, "anchors": anchors}


def markov_edge_cases(border: int) -> dict[tuple[int, int], int]:
    """(row, step) -> the draft `markov_inputs` forces there, worked out by hand."""
    b = border
    cases = {(0, k): b - 5 for k in range(MARKOV_GAMMA)}
    cases.update({(1, k): b - 1 for k in range(MARKOV_GAMMA)})
    cases.update({(2, 1): b + 3, (3, 2): 0, (4, 0): b, (4, 1): b - 1, (6, 3): 2, (6, 4): 3})
    return cases


def run_shard_markov(rank: int, out_dir: Path) -> None:
    """Both ranks of a TP-2 world run the greedy Markov loop over their columns of
    `markov_inputs` (`markov_greedy_shard` with `shard_argmax`, torch and the
    `kernels/sampling` kernels), for an even split of 64 columns and an uneven one (37 | 27);
    every rank saves the inputs, its outputs and the shape of every tensor it all-gathered
    (`markov_{split}_{impl}_r{rank}`)."""
    from sgl_dspark.srt.layers.vocab_parallel import shard_argmax
    from sgl_dspark.srt.speculative.dspark.sampling import markov_greedy_shard

    state = init_parallel_state(ParallelLayout(2, 1))
    if rank >= 2:
        return
    for split, widths in (("even", (32, 32)), ("uneven", (37, 27))):
        gen = torch.Generator().manual_seed(5)
        inputs = markov_inputs(widths[0], sum(widths), gen)
        start = sum(widths[:rank])
        cols = slice(start, start + widths[rank])
        for impl in ("torch", "triton"):
            gathered = count_gathers()
            out = markov_greedy_shard(
                inputs["base"][:, :, cols].contiguous(),
                inputs["w1"],
                inputs["w2"][cols],
                inputs["anchors"],
                functools.partial(
                    shard_argmax, vocab_start=start, tp=state.tp, triton=impl == "triton"
                ),
            )
            torch.save(
                {**inputs, "out": tuple(out), "gathered": list(gathered), "start": start},
                out_dir / f"markov_{split}_{impl}_r{rank}.pt",
            )
