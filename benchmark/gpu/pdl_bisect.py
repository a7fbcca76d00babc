"""Which programmatically launched kernel changes the engine's greedy tokens (a race shows as
CUDA graphs != eager): the tiny model's requests of `test_cuda_graph_runner.py` with PDL off,
all on, then on for one kernel at a time, then for growing prefixes of the kernel list.

    python3 benchmark/gpu/pdl_bisect.py [--spec] [--with=KERNEL_NAME]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(ROOT / "python"),
    str(ROOT / "test/registered/e2e"),
    str(ROOT / "test/registered/kernels"),
]

from gpu_targets_check import PDL_KERNELS  # noqa: E402
from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.kernels import _triton_utils  # noqa: E402
from test_cuda_graph_runner import N_PROMPTS, _requests  # noqa: E402


def generate(only: set[str] | None, pdl: bool = True, **kw) -> list[list[int]]:
    _triton_utils.set_programmatic_launch(pdl, only)
    engine = Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=N_PROMPTS,
        device="cuda",
        dtype="float32",
        kernel_backend="triton",
        **kw,
    )
    try:
        prompts, params = _requests()
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        engine.shutdown()
        _triton_utils.set_programmatic_launch(True)


def main() -> None:
    kw = (
        {"speculative_algorithm": "DSpark", "speculative_dspark_block_size": 4}
        if "--spec" in sys.argv
        else {}
    )
    names = [key.split(".")[1] for key in PDL_KERNELS]
    t0 = time.time()
    want = generate(None, pdl=False, disable_cuda_graph=True, **kw)
    print(f"eager, PDL off: reference ({time.time() - t0:.0f} s)", flush=True)
    checks = [
        ("graphs, PDL off", None, False, {}),
        ("eager, PDL on", None, True, {"disable_cuda_graph": True}),
        ("graphs, PDL on", None, True, {}),
    ]
    for label, only, pdl, extra in checks:
        print(
            f"{label}: {'same' if generate(only, pdl, **extra, **kw) == want else 'DIFFERENT'}",
            flush=True,
        )
    partner = next((a.split("=")[1] for a in sys.argv if a.startswith("--with=")), None)
    for name in names:
        if partner is not None and name == partner:
            continue
        same = generate({name} | ({partner} if partner else set()), **kw) == want
        print(
            f"graphs, PDL only {name} (with {partner}): {'same' if same else 'DIFFERENT'}",
            flush=True,
        )
    for i in range(2, len(names) + 1):
        same = generate(set(names[:i]), **kw) == want
        print(
            f"graphs, PDL for the first {i} ({names[i - 1]} last): "
            f"{'same' if same else 'DIFFERENT'}",
            flush=True,
        )
        if not same:
            break
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
