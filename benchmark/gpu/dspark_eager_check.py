"""DSpark eager on a GPU vs CPU greedy: the built-in tiny pair, a batch of 8, every
verify policy; prints whether the GPU tokens equal the CPU target-only greedy tokens.

    PYTHONPATH=python python benchmark/gpu/dspark_eager_check.py [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "registered" / "e2e"))

from sgl_dspark import Engine  # noqa: E402
from spec_utils import POLICIES, policy_kwargs, write_policy_tables  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time",
    "DeepSeek-V4 uses",
    "hello",
    "Q: what is 7 * 8?\nA:",
    "x" * 40,
]


KERNEL_BACKEND = "torch"


def run(device: str, **kw) -> tuple[list[list[int]], float]:
    backend = KERNEL_BACKEND if device == "cuda" else "torch"
    e = Engine(
        model_path="tiny",
        device=device,
        dtype="float32",
        context_length=512,
        max_running_requests=8,
        kernel_backend=backend,
        **kw,
    )
    t = time.perf_counter()
    outs = e.generate(
        prompt=PROMPTS,
        sampling_params={"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True},
    )
    if device == "cuda":
        torch.cuda.synchronize()
    return [o["output_ids"] for o in outs], time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument(
        "--kernel-backend",
        default="torch",
        choices=("torch", "triton"),
        help="backend of the GPU runs (the CPU reference always uses torch)",
    )
    a = p.parse_args()
    global KERNEL_BACKEND
    KERNEL_BACKEND = a.kernel_backend
    ref, t_cpu = run("cpu")
    result = {
        "device": torch.cuda.get_device_name(),
        "kernel_backend": a.kernel_backend,
        "cpu_target_s": t_cpu,
        "cases": {},
    }
    gpu_plain, t = run("cuda")
    result["cases"]["target_only"] = {"equal_cpu": gpu_plain == ref, "s": t}
    with tempfile.TemporaryDirectory() as tmp:
        for gamma in (3, 5, 7):
            tables = write_policy_tables(tmp, gamma)
            for policy in POLICIES:
                got, t = run(
                    "cuda",
                    speculative_algorithm="DSpark",
                    speculative_dspark_block_size=gamma,
                    **policy_kwargs(policy, tables),
                )
                result["cases"][f"dspark_g{gamma}_{policy}"] = {"equal_cpu": got == ref, "s": t}
    ok = all(c["equal_cpu"] for c in result["cases"].values())
    result["all_equal"] = ok
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
