"""Kernel launches of one decode step, counted on the CPU: a benchmark model's layer structure
at toy widths, run through the Triton kernels (the interpreter) after a real prefill, every
Triton launch and every torch op that launches a device kernel counted, by kernel and by the
source line that issued it.

    TRITON_INTERPRET=1 python benchmark/probe_launches.py --config dsv41_flash_rank --out launches.md

At batch size 1 a decode step is a chain of a few thousand small kernels, and each costs the
device a launch gap whatever its work, so the count is what bounds the step long before the
bytes do. The count is a property of the code, not of the machine: a graph replays the same
launches. Torch ops that launch nothing (views, `empty`, metadata) are left out; what runs inside
the interpreter's emulation of a Triton kernel is not counted (the launch is). Expect a few
minutes: the prefill runs every kernel in the interpreter.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.srt.entrypoints.logprob_format import LogprobOptions  # noqa: E402
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS, engram_primes  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Torch ops that launch no device kernel: views, allocation without a fill, metadata.
NO_LAUNCH = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "as_strided",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "expand",
        "t",
        "permute",
        "transpose",
        "alias",
        "detach",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "narrow",
        "_reshape_alias",
        "lift_fresh",
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "numel",
        "size",
        "stride",
        "sym_size",
        "is_same_size",
        "view_as",
        "expand_as",
        "flatten",
        "unflatten",
        "movedim",
        "diagonal",
        "is_pinned",
        "_has_compatible_shallow_copy_type",
        "set_",
    }
)
# Ops that return their input unchanged when it already has the asked dtype / layout.
RETURN_INPUT_WHEN_NOOP = frozenset({"to", "contiguous", "type_as"})
# The toy widths: every dimension small, the layer structure (depth, roles, sources, Engram
# layers, expert count per rank, top-k) the config's own.
TOY_WIDTHS = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 8,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 4,
    "vocab_size": 512,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 1000,
    "engram_compressed_vocab_size": 400,
    "max_position_embeddings": 2048,
    "sliding_window": 16,
}


def toy_config(name: str) -> dict:
    raw = {**BENCH_CONFIGS[name], **TOY_WIDTHS}
    if raw.get("engram_layer_ids"):
        primes = engram_primes(
            tuple(raw["engram_layer_ids"]),
            raw["engram_max_ngram_size"],
            raw["engram_n_heads"],
            raw["engram_vocab_size"],
        )
        raw["engram_num_embeddings"] = [sum(sum(h) for h in layer) for layer in primes]
    return raw


def _issuer() -> str:
    """The innermost package line on the stack (the one that asked for the op)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "sgl_dspark" in frame.filename:
            return f"{frame.filename.split('sgl_dspark/')[-1]}:{frame.lineno}"
    return "(outside the package)"


class LaunchCounter(TorchDispatchMode):
    """Torch ops that launch a kernel, and Triton launches (`count_triton`), by name and by
    issuing line; ops issued while the interpreter emulates a kernel are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_ops: collections.Counter[str] = collections.Counter()
        self.triton: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[str] = collections.Counter()
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # A conversion to what the tensor already is returns it: nothing launched.
        returned_input = name in RETURN_INPUT_WHEN_NOOP and args and out is args[0]
        if not self.inside_kernel and name not in NO_LAUNCH and not returned_input:
            self.torch_ops[name] += 1
            self.lines[_issuer()] += 1
        return out

    def count_triton(self, name: str) -> None:
        self.triton[name] += 1
        self.lines[_issuer()] += 1


def _patch_interpreter(counter: list[LaunchCounter | None]) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        active = counter[0]
        if active is None:
            return run(self, *args, **kwargs)
        active.count_triton(self.fn.__name__)
        active.inside_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            active.inside_kernel -= 1

    InterpretedFunction.run = counted  # type: ignore[method-assign]


def count_decode_step(name: str, prompt_len: int) -> LaunchCounter:
    """One decode step of `name` at toy widths after a `prompt_len`-token prefill, counted."""
    from sgl_dspark.kernels._triton_utils import interpreted
    from sgl_dspark.kernels.norm.rmsnorm import _rms_norm_kernel

    if not interpreted(_rms_norm_kernel):
        raise SystemExit("run with TRITON_INTERPRET=1: the launches are counted in the interpreter")
    work = Path(tempfile.mkdtemp(prefix="probe_launches_"))
    (work / "config.json").write_text(json.dumps(toy_config(name)))
    engine = Engine(
        model_path=str(work),
        device="cpu",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        load_format="dummy",
        weight_format="native",
        kernel_backend="triton",
        attention_backend="triton",
        context_length=prompt_len + 64,
        max_running_requests=1,
        max_total_tokens=4 * (prompt_len + 64),
        chunked_prefill_size=4096,
    )
    active: list[LaunchCounter | None] = [None]
    _patch_interpreter(active)
    try:
        sched = engine.scheduler
        params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        req = engine._make_req(list(range(3, 3 + prompt_len)), params, LogprobOptions())
        sched.add(req)
        while not (req.prefill_done and req.output_ids):
            sched.step()
        sched.step()  # one decode step first: whatever is set up once is not counted
        counter = LaunchCounter()
        active[0] = counter
        with counter:
            sched.step()
        active[0] = None
        return counter
    finally:
        engine.shutdown()


def render(name: str, prompt_len: int, c: LaunchCounter, top: int) -> str:
    torch_total, triton_total = sum(c.torch_ops.values()), sum(c.triton.values())
    lines = [
        f"One decode step of `{name}` at toy widths (layer structure as configured), batch "
        f"size 1, after a {prompt_len}-token prefill; torch {torch.__version__}.",
        "",
        f"**{torch_total + triton_total} launches: {triton_total} Triton, {torch_total} torch.**",
        "",
        "| launches | Triton kernel |",
        "|---|---|",
        *(f"| {n} | `{k}` |" for k, n in c.triton.most_common()),
        "",
        "| launches | torch op |",
        "|---|---|",
        *(f"| {n} | `{k}` |" for k, n in c.torch_ops.most_common(top)),
        "",
        "| launches | issued at |",
        "|---|---|",
        *(f"| {n} | `{k}` |" for k, n in c.lines.most_common(top)),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="dsv41_flash_rank", choices=sorted(BENCH_CONFIGS))
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--top", type=int, default=40, help="rows of the torch-op and line tables")
    p.add_argument("--out", default=None, help="markdown file (default: stdout)")
    a = p.parse_args()
    counter = count_decode_step(a.config, a.prompt_len)
    text = render(a.config, a.prompt_len, counter, a.top)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
