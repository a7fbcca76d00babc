"""Where greedy DSpark output first parts from greedy no-spec output, module by module.

    python benchmark/gpu/greedy_identity_probe.py --model-path demo --prompts P.jsonl \
        [--limit 6] [--max-new-tokens 128] [--engine-args '{"dtype": "bfloat16"}'] --out DIR

Runs each prompt alone (one request in flight, eager: hooks do not fire inside CUDA graphs)
twice: without speculative decoding, then with DSpark. Every module of the target records a
checksum of each output row (the row's bits summed as integers, two ways), keyed by the row's
position. A DSpark verify row is compared only while its context is the no-spec run's (every
earlier row of its verify holds the token the no-spec run committed there), so rejected rows
with another context never count. For each prompt that parts, the report names the position
and, in the order the modules finished, the first modules whose rows differ: the first one's
children agree, so the difference arises in it (or in the functional code between modules).

Prompts: JSON lines with "question" (a GSM8K-style row, formatted as the demo's zero-shot
prompt) or "prompt". Output: DIR/identity_probe.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sgl_dspark.srt.entrypoints.engine import Engine  # noqa: E402

from benchmark.gsm8k.data import build_prompt  # noqa: E402


def row_checksums(t: torch.Tensor) -> torch.Tensor:
    """[rows, 2] int64: each row's bits summed plainly and position-weighted (equal rows give
    equal sums; a one-ulp change changes both)."""
    flat = t.detach().reshape(t.shape[0], -1)
    if flat.dtype in (torch.bfloat16, torch.float16):
        bits = flat.view(torch.int16).to(torch.int64)
    elif flat.dtype == torch.float32:
        bits = flat.view(torch.int32).to(torch.int64)
    else:
        bits = flat.to(torch.int64)
    weights = torch.arange(1, bits.shape[1] + 1, device=bits.device, dtype=torch.int64)
    return torch.stack((bits.sum(1), (bits * weights).sum(1)), dim=1)


class Recorder:
    """Hooks on every module of `model`: per forward, the rows' (position, input id) and each
    module's row checksums, in the order the modules finished."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None
        self._handles = [model.register_forward_pre_hook(self._begin)]
        for name, module in model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _begin(self, _module: torch.nn.Module, args: tuple) -> None:
        batch = args[0]
        self._current = {
            "positions": batch.positions.tolist(),
            "input_ids": batch.input_ids.tolist(),
            "modules": [],
        }
        self.forwards.append(self._current)

    def _hook(self, name: str):
        def hook(_module: torch.nn.Module, _args: tuple, output: Any) -> None:
            cur = self._current
            if cur is None:
                return
            out = output[0] if isinstance(output, tuple) and output else output
            rows = len(cur["positions"])
            if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[0] == rows:
                if out.is_floating_point():
                    cur["modules"].append((name, row_checksums(out).cpu()))

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def reference_tokens(forwards: list[dict[str, Any]], output_ids: list[int]) -> dict[int, int]:
    """position -> token of the no-spec run: every row it ran is committed, and the last output
    token is the one no forward read."""
    tokens = {p: t for f in forwards for p, t in zip(f["positions"], f["input_ids"], strict=True)}
    if tokens and output_ids:
        tokens[max(tokens) + 1] = output_ids[-1]
    return tokens


def clean_rows(fwd: dict[str, Any], tokens: dict[int, int]) -> list[int]:
    """Rows of a forward whose context is the reference sequence: a row is clean while every
    row of the forward up to it holds the reference token at its position (one request per
    forward)."""
    clean = []
    for r, (pos, tok) in enumerate(zip(fwd["positions"], fwd["input_ids"], strict=True)):
        if tokens.get(pos) != tok:
            break
        clean.append(r)
    return clean


def by_position(forwards: list[dict[str, Any]], tokens: dict[int, int]) -> dict:
    """position -> (module order, module -> checksum) over the clean rows of every forward
    (the first forward that covers a position wins)."""
    table: dict[int, tuple[list[str], dict[str, tuple[int, int]]]] = {}
    for fwd in forwards:
        for r in clean_rows(fwd, tokens):
            pos = fwd["positions"][r]
            if pos in table:
                continue
            order = [name for name, _ in fwd["modules"]]
            sums = {name: tuple(c[r].tolist()) for name, c in fwd["modules"]}
            table[pos] = (order, sums)
    return table


def probe(engine_args: dict[str, Any], prompts: list[str], max_new: int, spec: bool) -> list:
    args = dict(engine_args, max_running_requests=1, disable_cuda_graph=True)
    if spec:
        args["speculative_algorithm"] = "DSpark"
    engine = Engine(**args)
    runs = []
    try:
        for prompt in prompts:
            rec = Recorder(engine.runner.model)
            out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": max_new})
            rec.close()
            runs.append({"output_ids": list(out["output_ids"]), "forwards": rec.forwards})
    finally:
        engine.shutdown()
    return runs


def compare(plain: dict, spec: dict) -> dict[str, Any]:
    a, b = plain["output_ids"], spec["output_ids"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) == len(b):
        return {"identical": True, "tokens": len(a)}
    tokens = reference_tokens(plain["forwards"], a)
    ref = by_position(plain["forwards"], tokens)
    got = by_position(spec["forwards"], tokens)
    for pos in sorted(set(ref) & set(got)):
        order, sums = ref[pos]
        _, other = got[pos]
        differ = [n for n in order if n in other and other[n] != sums[n]]
        if differ:
            return {
                "identical": False,
                "first_token_difference": first,
                "position": pos,
                "first_modules": differ[:6],
                "modules_differing": len(differ),
                "modules_compared": len(order),
            }
    return {"identical": False, "first_token_difference": first, "position": None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="demo")
    p.add_argument("--prompts", required=True, help="JSON lines: question or prompt")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--engine-args", default="{}", help="JSON: further Engine arguments")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if "prompt" in r else build_prompt("", r["question"]) for r in rows]
    prompts = prompts[: a.limit]
    engine_args = {"model_path": a.model_path, **json.loads(a.engine_args)}
    plain = probe(engine_args, prompts, a.max_new_tokens, spec=False)
    spec = probe(engine_args, prompts, a.max_new_tokens, spec=True)
    results = [{"prompt": i, **compare(plain[i], spec[i])} for i in range(len(prompts))]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "identity_probe.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# Greedy identity probe: {a.model_path}, engine args {a.engine_args}",
        "",
        "| prompt | identical | first differing token | position | first modules differing |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['prompt']} | {r['identical']} | {r.get('first_token_difference', '-')} | "
            f"{r.get('position', '-')} | {', '.join(r.get('first_modules', [])) or '-'} |"
        )
    (out / "identity_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
