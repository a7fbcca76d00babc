"""Time one static batch through the model runner: prefill of `--input-len` tokens per request,
then `--output-len` greedy decode steps, at several batch sizes (SGLang's bench_one_batch).

    python benchmark/bench_one_batch.py --config mid_910m --device cuda --batch-sizes 1,8,32

Random weights (seeded, generated on the device); prints prefill latency, median decode step
latency, tok/s/user and total tok/s, and writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sgl_dspark.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sgl_dspark.srt.core.kernel_choice import KernelChoice  # noqa: E402
from sgl_dspark.srt.model_executor.cuda_graph_runner import (  # noqa: E402
    CudaGraphRunner,
    graph_batch_sizes,
)
from sgl_dspark.srt.model_executor.decode_executor import DecodeExecutor  # noqa: E402
from sgl_dspark.srt.model_executor.model_runner import (  # noqa: E402
    ModelRunner,
    RunnerConfig,
    default_page_size,
)
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS  # noqa: E402
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402


def random_model(
    cfg: ModelConfig, device: str, seed: int = 0, kernels: KernelChoice | None = None
) -> DeepseekV4ForCausalLM:
    """Seeded random weights generated on the device (std 0.02 matrices, unit norms).

    Built on the device itself, not on "meta" + `to_empty`: some modules derive non-persistent
    buffers in their constructors (the triton MoE's expert-sort table, from a host tensor), which
    a meta build cannot compute and `to_empty` would leave undefined. Integer buffers other than
    the hash table keep those values."""
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, kernels)
    model = model.to(device)  # buffers a constructor built on the host
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                t.copy_(torch.randint(0, cfg.n_routed_experts, t.shape, generator=g, device=device))
            elif not t.is_floating_point():
                continue
            elif name.endswith(("norm.weight", "scale", "hc_scale")) or "layernorm" in name:
                t.fill_(1.0)
            elif name.endswith(
                ("sinks", "position_bias", ".base", "hc_base", "e_score_correction_bias")
            ):
                t.zero_()
            elif name.startswith("model.inv_freq"):
                continue
            else:
                t.normal_(0.0, 0.02, generator=g)
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(executor: DecodeExecutor, bs: int, input_len: int, output_len: int, device: str) -> dict:
    runner = executor.runner
    pool = runner.req_pool
    g = torch.Generator().manual_seed(bs)
    vocab = runner.model_cfg.vocab_size
    prompts = [torch.randint(0, vocab, (input_len,), generator=g).tolist() for _ in range(bs)]
    slots = [pool.alloc_slot() for _ in range(bs)]
    try:
        for s in slots:
            pool.reserve(s, input_len + output_len + 1)
        sync(device)
        t0 = time.perf_counter()
        batch = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * bs, slots, pool.req_to_token)
        nxt = torch.argmax(executor.forward(batch).logits, dim=-1).tolist()
        sync(device)
        prefill_s = time.perf_counter() - t0
        steps = []
        for i in range(output_len):
            t0 = time.perf_counter()
            batch = ForwardBatch.build(
                ForwardMode.DECODE,
                [[t] for t in nxt],
                [input_len + i] * bs,
                slots,
                pool.req_to_token,
            )
            nxt = torch.argmax(executor.forward(batch).logits, dim=-1).tolist()
            sync(device)
            steps.append(time.perf_counter() - t0)
    finally:
        for s in slots:
            pool.free_slot(s)
    step = statistics.median(steps)
    return {
        "batch_size": bs,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_s": prefill_s,
        "decode_step_ms": step * 1e3,
        "tok_s_per_user": 1.0 / step,
        "tok_s_total": bs / step,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="mid_910m", choices=sorted(BENCH_CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kernel-backend", default=None, help="default: triton on cuda, else torch")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay decode steps from CUDA graphs captured for the batch sizes",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cfg = ModelConfig.from_hf_dict(BENCH_CONFIGS[a.config])
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    ctx = a.input_len + a.output_len + 32
    backend = a.kernel_backend or ("triton" if a.device.startswith("cuda") else "torch")
    kernels = KernelChoice.parse(backend)
    # Requests hold whole pages: budget each one its context rounded up to a page.
    page = default_page_size(cfg)
    per_request = -(-ctx // page) * page
    runner = ModelRunner(
        cfg,
        RunnerConfig(
            device=a.device,
            dtype=a.dtype,
            max_total_tokens=max(sizes) * per_request + 1024,
            max_running_requests=max(sizes),
            context_length=ctx,
            kernel_backend=backend,
        ),
        model=random_model(cfg, a.device, kernels=kernels),
    )
    executor = DecodeExecutor(runner)
    if a.cuda_graph:
        graphs = CudaGraphRunner(runner.device)
        executor.register_graphs(graphs, graph_batch_sizes(max(sizes)))
        graphs.capture()
    rows = [bench(executor, bs, a.input_len, a.output_len, a.device) for bs in sizes]
    for r in rows:
        print(json.dumps(r))
    if a.out:
        Path(a.out).write_text(
            json.dumps({"config": a.config, "dtype": a.dtype, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
