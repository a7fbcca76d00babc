"""Where the time of a 1-token call (prefill of a 512-token prompt) and of a decode step goes on
the GPU machine: wall, torch.profiler CPU/CUDA tables, cProfile of the host side.

    python3 benchmark/gpu/profile_prefill.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_dspark.srt.entrypoints.logprob_format import LogprobOptions  # noqa: E402
from sgl_dspark.srt.model_loader.export import save_released_checkpoint  # noqa: E402
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS  # noqa: E402

from benchmark.bench_engine import build_hf, prompts_for  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="mid_910m")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--out-dir", default=".")
    a = p.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(BENCH_CONFIGS[a.config])
    cfg = ModelConfig.from_hf_dict(raw)
    work = tempfile.mkdtemp()
    hf = build_hf(raw, "cuda")
    save_released_checkpoint({k: v.detach().cpu() for k, v in hf.state_dict().items()}, cfg, work)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    eng = Engine(
        model_path=work,
        device="cuda",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        kernel_backend="triton",
        attention_backend="triton",
        context_length=1024,
        max_running_requests=8,
        max_total_tokens=16384,
        chunked_prefill_size=4096,
    )
    prompts = prompts_for(1, a.input_len, cfg.vocab_size)

    def call(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        call(8)
    walls = [call(1) for _ in range(5)]
    report = [
        f"1-token call (bs 1, {a.input_len} prompt tokens): median "
        f"{statistics.median(walls) * 1e3:.2f} ms, all {[round(w * 1e3, 2) for w in walls]}"
    ]
    walls8 = [call(33) for _ in range(3)]
    report.append(f"33-token call: median {statistics.median(walls8) * 1e3:.2f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(1)
    ka = prof.key_averages()
    report.append(ka.table(sort_by="self_cpu_time_total", row_limit=40))
    report.append(ka.table(sort_by="self_cuda_time_total", row_limit=40))
    n_kernels = sum(e.count for e in ka if e.device_type.name == "CUDA")
    report.append(f"device events in the call: {n_kernels}")
    pr = cProfile.Profile()
    pr.enable()
    call(1)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
    report.append(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
    report.append(s.getvalue())
    # Decode: host time per scheduler step vs device time (graphs + overlap).
    sched = eng.scheduler
    req = eng._make_req(
        prompts[0],
        {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True},
        LogprobOptions(),
    )
    sched.add(req)
    while not (req.prefill_done and req.output_ids):
        sched.step()
    for _ in range(5):
        sched.step()
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pr.enable()
    host = []
    for _ in range(50):
        h0 = time.perf_counter()
        sched.step()
        host.append(time.perf_counter() - h0)
    pr.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 50
    report.append(
        f"decode bs1: {wall * 1e3:.3f} ms/step wall under cProfile, host step median "
        f"{statistics.median(host) * 1e3:.3f} ms"
    )
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    report.append(s.getvalue())
    while sched.has_work:
        sched.step()
    (out / "profile_prefill.txt").write_text("\n\n".join(report))
    print("\n".join(report[:2]))


if __name__ == "__main__":
    main()
