"""Where a bs 1 DSpark step's time goes: each part of the fused step replayed alone
from its own CUDA graph on the device, next to the no-spec decode step of the same build.

Parts (all at bs 1, the bench's mid-size model, draft of `--draft-layers` stages, block `--gamma`):
the no-spec decode graph; the DSpark engine's target graphs at width 1 and `--width` (both with
the tap hook that writes the draft context KV); the whole fused step; and, captured here, the
draft body (inputs, embedding, stages), its base logits, the Markov loop (`--width` - 1 drafts),
the epilogue (acceptance + logprobs) and the draft context-KV write alone (in the step's graph it
runs on a side stream). Replay times are CUDA-event medians over `--batches` batches of
`--iters` replays; the graphs' inputs are reset before each batch so positions stay inside the
context. Parts timed alone replay with their weights warm in L2 where they fit, so they need not
add up to the step.

    python benchmark/probe_dspark_step.py --out $OUT/probe.md
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_dspark.srt.model_executor.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from sgl_dspark.srt.model_executor.target_graphs import FAMILY as TARGET  # noqa: E402
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS  # noqa: E402
from sgl_dspark.srt.speculative.dspark.fused_step import FAMILY as FUSED  # noqa: E402

from benchmark.bench_engine import build_hf, prompts_for, write_checkpoints  # noqa: E402
from benchmark.step_profile import kernel_list  # noqa: E402


def time_replays(
    replay: Callable[[], None],
    reset: Callable[[], None],
    iters: int,
    batches: int,
    device: torch.device,
) -> float:
    """Median microseconds per replay over `batches` batches of `iters` replays (CUDA events;
    wall time on CPU, where the script only smoke-tests)."""
    times = []
    for _ in range(batches + 1):  # the first batch warms up
        reset()
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                replay()
            times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times[1:])


def capture(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """`fn` as a CUDA graph (the engine's graph class: programmatic launches as at bs 1)."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    graphs = CudaGraphRunner(device)
    graphs.register("probe", 0, fn, launch_batch=1)
    graphs.capture()
    return functools.partial(graphs.replay, "probe", 0)


def profile_replays(replay: Callable[[], None], reset: Callable[[], None], iters: int) -> str:
    """The device kernels of `iters` replays under torch.profiler, per replay (the profiler
    stretches small kernels: read launch counts and shares, not the absolute times)."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    return kernel_list(prof, iters)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="mid_910m", choices=sorted(BENCH_CONFIGS))
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--draft-layers", type=int, default=3)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="probe_dspark_step.md")
    p.add_argument(
        "--profile",
        default="",
        help="also write each part's device kernels "
        "(torch.profiler over --iters replays) to this file (CUDA only)",
    )
    a = p.parse_args()
    dev = torch.device(a.device)
    raw = dict(BENCH_CONFIGS[a.config])
    cfg = ModelConfig.from_hf_dict(raw)
    work = tempfile.mkdtemp(prefix="probe_dspark_")
    hf = build_hf(raw, a.device)
    write_checkpoints(hf, cfg, work, a.draft_layers, a.gamma)
    del hf
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    ctx = a.input_len + 256
    base = dict(
        model_path=work,
        device=a.device,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        kernel_backend="triton" if dev.type == "cuda" else "torch",
        attention_backend=a.attention_backend,
        context_length=ctx,
        max_running_requests=1,
        max_total_tokens=ctx + 4096,
        chunked_prefill_size=4096,
    )
    prompt = prompts_for(1, a.input_len, cfg.vocab_size)
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    rows: list[tuple[str, float]] = []
    kernels: list[str] = []

    def timed(name: str, replay: Callable[[], None], reset: Callable[[], None]) -> None:
        rows.append((name, time_replays(replay, reset, a.iters, a.batches, dev)))
        if a.profile and dev.type == "cuda":
            kernels.append(f"## {name}\n\n{profile_replays(replay, reset, a.iters)}\n")

    def time_target(name: str, engine: Engine, w: int) -> None:
        executor = engine.spec.decode if engine.spec is not None else engine.executor
        graphs = executor.target_graphs._by_width[w]
        static = graphs.static  # ids, positions, token slots [1, w]; slot, prefix, seq [1]

        def reset() -> None:
            static[1][:1] = torch.arange(a.input_len, a.input_len + w, device=dev)
            static[2][:1] = static[1][:1]
            static[3][:1], static[4][:1], static[5][:1] = 1, a.input_len, a.input_len + w

        graph = engine.graphs.graph(TARGET.format(w), 1)
        timed(name, graph.replay, reset)

    engine = Engine(**base)
    engine.generate(input_ids=prompt, sampling_params=params)
    time_target("no-spec decode graph (width 1)", engine, 1)
    engine.shutdown()
    del engine
    gc.collect()

    table = Path(work) / "widths.json"
    table.write_text(json.dumps({"widths_by_batch_size": {"1": a.width}}))
    engine = Engine(
        **base,
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=a.gamma,
        speculative_dspark_simulate_accept_len=3.2,
        speculative_dspark_verify_policy="static",
        speculative_dspark_width_table_path=str(table),
    )
    engine.generate(input_ids=prompt, sampling_params=params)
    worker = engine.spec.worker
    time_target("DSpark engine target graph width 1 (+ context-KV writer)", engine, 1)
    time_target(
        f"DSpark engine target graph width {a.width} (verify, + context-KV writer)", engine, a.width
    )
    fused = engine.spec.fused
    seq0 = a.input_len + 1

    def reset_fused() -> None:
        fused.inputs[:, 0] = torch.tensor([5, seq0, 1, a.width, 2], device=dev)

    graph = engine.graphs.graph(FUSED, (a.width, 1))
    timed(f"fused step (width {a.width}, forced accept 2)", graph.replay, reset_fused)

    anchors = torch.tensor([5], device=dev)
    seq = torch.tensor([seq0], device=dev)
    slot = torch.tensor([1], device=dev)
    runner = worker.runner
    target = runner.model
    state: dict[str, torch.Tensor] = {}

    def body() -> None:
        inputs = worker.draft_inputs_fn(
            anchors,
            seq,
            slot,
            runner.req_pool.req_to_token,
            a.gamma,
            worker.window,
            worker.dcfg.noise_token_id,
        )
        embeds = target.model.embed_tokens(inputs.input_ids)
        state["y"], state["yn"] = worker.draft(
            embeds, inputs.positions, worker.ctx_kv, inputs.ctx_slots, inputs.ctx_valid
        )

    def logits() -> None:
        state["u"] = target.compute_logits(state["yn"])

    w1, w2 = worker.draft.markov_head.embed.weight, worker.draft.markov_head.head.weight

    def markov() -> None:
        state["ms"] = worker.markov_greedy_fn(state["u"][:, : a.width - 1], w1, w2, anchors)

    nothing = lambda: None  # noqa: E731
    for name, fn in (
        (f"draft body ({a.draft_layers} stages, {a.gamma} rows)", body),
        ("draft base logits", logits),
        (f"Markov loop ({a.width - 1} drafts)", markov),
    ):
        timed(name, capture(fn, dev), nothing)
    W = a.width
    verify_ids = torch.full((1, W), 7, device=dev)
    lens = torch.tensor([W], device=dev)
    vlogits = torch.randn(1, W, cfg.vocab_size, device=dev)
    positions = (seq[:, None] + torch.arange(W, device=dev)[None, :]).reshape(-1)
    cache_loc = runner.req_pool.req_to_token[slot, positions]
    taps = {
        k: torch.randn(W, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=runner.dtype)
        for k in worker.tap_layers
    }
    forced = torch.tensor([2], device=dev)
    timed(
        f"epilogue (acceptance + logprobs, width {W})",
        capture(lambda: worker.greedy_epilogue(verify_ids, lens, seq, vlogits, forced), dev),
        nothing,
    )
    timed(
        f"draft context-KV write ({W} rows; in the step it overlaps the logits)",
        capture(lambda: worker.inject(positions, cache_loc, taps), dev),
        nothing,
    )
    engine.shutdown()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    text = (
        f"# DSpark bs 1 step parts ({name}, {a.config}, gamma "
        f"{a.gamma}, {a.draft_layers} draft stages, width {a.width}, attention "
        f"{a.attention_backend})\n\n| part | us per replay |\n|---|---|\n"
        + "".join(f"| {n} | {t:.1f} |\n" for n, t in rows)
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    if kernels:
        Path(a.profile).write_text(
            f"# Device kernels per replay ({name}, {a.config})\n\n" + "\n".join(kernels)
        )


if __name__ == "__main__":
    main()
