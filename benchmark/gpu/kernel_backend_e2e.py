"""`--kernel-backend triton` vs `torch` on CUDA: the same greedy tokens, end to end.

* the built-in tiny model through the offline Engine: batch of 8, 48 new tokens, with and without
  DSpark, in float32 and bfloat16;
* the DSV4-shaped random model (`BENCH_CONFIGS["dsv4_flash_slice"]`, bf16, weights from
  `bench_one_batch.random_model`, shared by both runners): batch of 4 short random prompts, 16
  greedy steps through the model runner.

Prints a JSON summary; exits 1 when any case differs.

    PYTHONPATH=python python benchmark/gpu/kernel_backend_e2e.py [--out result.json]

Exactness of the Triton families against the torch path: rope bit-exact (the same roundings),
sampling argmax, spec accept and draft inputs exact (integer results), the mHC boundary within a
tolerance (fp32 accumulation in another order), moe: see `srt/layers/moe`. A family within a
tolerance can flip a greedy token where two logits nearly tie; such flips are reported, never
hidden: for the random model the first differing step, the tokens and the logit gap of each
backend at that step.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT))

from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sgl_dspark.srt.core.kernel_choice import KernelChoice  # noqa: E402
from sgl_dspark.srt.layers.sampler import greedy_argmax_impl  # noqa: E402
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS  # noqa: E402
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402

from benchmark.bench_one_batch import random_model  # noqa: E402

TINY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time",
    "DeepSeek-V4 uses",
    "hello",
    "Q: what is 7 * 8?\nA:",
    "x" * 40,
]
EXACTNESS = {
    "rope": "bit-exact",
    "mhc": "tolerance",
    "sampling": "exact",
    "spec": "exact",
    "moe": "see srt/layers/moe",
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- tiny model through the Engine ----------------------------------------------------------
def tiny_case(device: str, dtype: str, new_tokens: int, **spec) -> dict:
    outs, secs = {}, {}
    for backend in ("torch", "triton"):
        e = Engine(
            model_path="tiny",
            device=device,
            dtype=dtype,
            context_length=512,
            max_running_requests=len(TINY_PROMPTS),
            kernel_backend=backend,
            **spec,
        )
        t = time.perf_counter()
        res = e.generate(
            prompt=TINY_PROMPTS,
            sampling_params={"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        sync(device)
        secs[backend] = time.perf_counter() - t
        outs[backend] = [o["output_ids"] for o in res]
        e.shutdown()
    first_diff = {}
    for i, (a, b) in enumerate(zip(outs["torch"], outs["triton"])):
        if a != b:
            first_diff[i] = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
    return {
        "equal": outs["torch"] == outs["triton"],
        "seconds": secs,
        "first_differing_token_per_prompt": first_diff,
    }


# ---- DSV4-shaped random model through the model runner -----------------------------------------
def _runners(
    cfg: ModelConfig,
    device: str,
    dtype: str,
    bs: int,
    ctx: int,
) -> dict[str, ModelRunner]:
    """Two runners over one set of random weights (the Triton model shares the tensors)."""

    def rc(backend: str) -> RunnerConfig:
        return RunnerConfig(
            device=device,
            dtype=dtype,
            max_total_tokens=bs * ctx + 1024,
            max_running_requests=bs,
            context_length=ctx,
            kernel_backend=backend,
        )

    torch_runner = ModelRunner(cfg, rc("torch"), model=random_model(cfg, device))
    # Built on the device, not on meta: layers may build non-persistent buffers (e.g. the MoE
    # sort table) from host values at construction. Its own init is then replaced by the shared
    # weights (transiently one fp32 copy of the model).
    with torch.device(device):
        tri = DeepseekV4ForCausalLM(cfg, KernelChoice("triton"))
    tri.load_state_dict(torch_runner.model.state_dict(), assign=True)
    # Non-persistent rope tables are not in the state dict.
    tri.model.inv_freq_main = torch_runner.model.model.inv_freq_main
    tri.model.inv_freq_compress = torch_runner.model.model.inv_freq_compress
    return {"torch": torch_runner, "triton": ModelRunner(cfg, rc("triton"), model=tri)}


def _greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    steps: int,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode; returns tokens [bs][steps] and the fp32 logits [bs, V] of every step."""
    argmax = greedy_argmax_impl(runner.kernels)
    pool, bs = runner.req_pool, len(prompts)
    slots = [pool.alloc_slot() for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits_per_step = []
    try:
        for s, p in zip(slots, prompts):
            pool.reserve(s, len(p) + steps + 1)
        batch = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * bs, slots, pool.req_to_token)
        for i in range(steps):
            logits = runner.forward(batch).logits
            nxt = argmax(logits).tolist()
            logits_per_step.append(logits.float().cpu())
            for row, t in zip(tokens, nxt):
                row.append(t)
            batch = ForwardBatch.build(
                ForwardMode.DECODE,
                [[t] for t in nxt],
                [len(p) + i for p in prompts],
                slots,
                pool.req_to_token,
            )
    finally:
        for s in slots:
            pool.free_slot(s)
    return tokens, logits_per_step


def random_model_case(
    cfg: ModelConfig, device: str, dtype: str, bs: int, prompt_len: int, steps: int, seed: int = 0
) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, cfg.vocab_size, (prompt_len + 3 * i,), generator=g).tolist()
        for i in range(bs)
    ]
    runners = _runners(cfg, device, dtype, bs, prompt_len + 3 * bs + steps + 16)
    toks, logits, secs = {}, {}, {}
    for name, runner in runners.items():
        t = time.perf_counter()
        toks[name], logits[name] = _greedy(runner, prompts, steps)
        sync(device)
        secs[name] = time.perf_counter() - t
    out: dict = {
        "equal": toks["torch"] == toks["triton"],
        "seconds": secs,
        "prefill_logits_max_abs_diff": float(
            (logits["torch"][0] - logits["triton"][0]).abs().max()
        ),
        "flips": [],
    }
    for row in range(bs):
        a, b = toks["torch"][row], toks["triton"][row]
        step = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None:
            continue
        lt, lx = logits["torch"][step][row], logits["triton"][step][row]
        out["flips"].append(
            {
                "row": row,
                "first_differing_step": step,
                "torch_token": a[step],
                "triton_token": b[step],
                # How far each backend was from choosing the other's token (>= 0).
                "torch_logit_gap": float(lt[a[step]] - lt[b[step]]),
                "triton_logit_gap": float(lx[b[step]] - lx[a[step]]),
                "logits_max_abs_diff_at_step": float((lt - lx).abs().max()),
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny-dtypes", default="float32,bfloat16")
    p.add_argument("--tiny-new-tokens", type=int, default=48)
    p.add_argument("--config", default="dsv4_flash_slice", choices=sorted(BENCH_CONFIGS))
    p.add_argument("--skip-random-model", action="store_true")
    p.add_argument(
        "--random-prompt-len",
        type=int,
        default=12,
        help="first prompt's length (the others 3, 6, 9 longer); >= 113 puts HCA "
        "block ends (every 128 positions) in the decode steps",
    )
    p.add_argument(
        "--random-dtypes",
        default="float32,bfloat16",
        help="fp32: the exactness gate (numeric differences ~1e-6 cannot flip a "
        "greedy choice unless two logits tie); bf16: flips at near-ties are "
        "reported with their logit gaps",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result: dict = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
        "exactness": EXACTNESS,
        "cases": {},
    }
    for dtype in a.tiny_dtypes.split(","):
        for label, spec in (("target", {}), ("dspark", {"speculative_algorithm": "DSpark"})):
            result["cases"][f"tiny_{dtype}_{label}"] = tiny_case(
                a.device, dtype, a.tiny_new_tokens, **spec
            )
    if not a.skip_random_model:
        cfg = ModelConfig.from_hf_dict(BENCH_CONFIGS[a.config])
        for dtype in a.random_dtypes.split(","):
            result["cases"][f"{a.config}_{dtype}"] = random_model_case(
                cfg, a.device, dtype, bs=4, prompt_len=a.random_prompt_len, steps=16
            )
            gc.collect()
            torch.cuda.empty_cache()
    # bf16 random-model flips are numerics at near-ties (reported, with gaps), not wiring bugs;
    # the gate is every fp32 case plus the tiny model in every dtype.
    gate = {
        k: c
        for k, c in result["cases"].items()
        if not (k.startswith(a.config) and k.endswith("bfloat16"))
    }
    result["all_equal"] = all(c["equal"] for c in gate.values())
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    sys.exit(0 if result["all_equal"] else 1)


if __name__ == "__main__":
    main()
