"""What torch.compile emits for a benchmark case, and where each side's device time goes.

For every case of `run_all.py` whose name contains one of `--only`, at each `--m`: Inductor's
generated source for the reference (the Triton kernels and their launch meta) and a per-kernel
table of device time for the reference compiled and for ours (torch.profiler over CUDA-graph
replays, so launch gaps are not counted). Used to find why a one-launch kernel of ours is
slower than compile's one launch.

    python3 benchmark/kernels/probe_compiled.py --only rmsnorm,silu_mul_clamp,moe_reduce --m 1,32 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from benchmark.kernels.run_all import MODULES, capture_calls  # noqa: E402


def kernel_times(fn, calls: int = 20, replays: int = 20) -> list[tuple[str, float]]:
    """Device microseconds per call of each kernel `fn` launches, replayed in a CUDA graph."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    g = capture_calls(fn, calls)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    # The i-th launch of a call (two launches of one kernel, e.g. the router's GEMV and route,
    # are told apart by their place in the call).
    per_call = max(1, len(kernels) // (calls * replays))
    agg: dict[tuple[int, str], float] = {}
    for i, e in enumerate(kernels):
        key = (i % per_call, e.name)
        agg[key] = agg.get(key, 0.0) + e.device_time_total
    return [(f"#{i} {name}", v / (calls * replays)) for (i, name), v in sorted(agg.items())]


def main() -> None:
    torch._dynamo.config.recompile_limit = 64
    p = argparse.ArgumentParser()
    p.add_argument("--only", required=True, help="comma list of case-name substrings")
    p.add_argument("--m", default="1,32")
    p.add_argument("--out-dir", default=".")
    a = p.parse_args()
    from torch._inductor.utils import run_and_get_code

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = []
    for mod_name in MODULES:
        for case in importlib.import_module(mod_name).CASES:
            if not any(k in case["name"] for k in a.only.split(",")):
                continue
            compiled = torch.compile(case["reference"], dynamic=False)
            for m in (int(x) for x in a.m.split(",")):
                inputs = case["make_inputs"](m, "cuda")
                tag = "".join(c if c.isalnum() else "_" for c in case["name"])[:60] + f"_m{m}"
                try:
                    _, code = run_and_get_code(compiled, **inputs)
                    (out / f"inductor_{tag}.py").write_text("\n\n".join(code))
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    report.append(f"{case['name']} M={m}: code dump failed: {e}")
                for side, fn in (("compile", compiled), ("ours", case["launcher"])):
                    try:
                        rows = kernel_times(lambda f=fn, x=inputs: f(**x))
                    except Exception as e:  # noqa: BLE001
                        report.append(f"{case['name']} M={m} {side}: failed: {e}")
                        continue
                    total = sum(us for _, us in rows)
                    report.append(f"{case['name']} M={m} {side}: {total:.2f} us device")
                    report += [f"    {us:7.2f} us  {name[:110]}" for name, us in rows]
                print("\n".join(report[-8:]), flush=True)
                (out / "probe_compiled.txt").write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
