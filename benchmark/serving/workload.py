"""Workload specs for the A/B harness: "KIND:key=value,..." strings -> BenchConfig templates.

Kinds and keys:
    random:in=4096,out=1024,conc=1,n=8[,rate=R][,ratio=1.0][,name=LABEL]
    gsm8k:path=test.jsonl,out=256,conc=8,n=32[,train=train.jsonl,shots=5][,rate=R][,name=LABEL]
`conc` is the fixed concurrency (batch) level, `n` the requests per timed run, `rate` a Poisson
request rate (default: all at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmark.bench_serving import BenchConfig

_KEYS = {
    "random": {"in", "out", "conc", "n", "rate", "ratio", "name"},
    "gsm8k": {"path", "train", "shots", "out", "conc", "n", "rate", "name"},
}


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    kind: str
    params: dict[str, str]

    def config(self, base_url: str, backend: str, seed: int, run_index: int = 0) -> BenchConfig:
        """The benchmark config of this workload against `base_url` (no warm-up requests: the
        harness runs whole warm-up runs instead; no progress bar).

        Run i of a launch gets its own prompts (random seed `seed + i`, GSM8K questions from
        i * n on), so a prefix cache cannot serve a timed run from an earlier run's prompts, while
        every arm sees the same prompt sequence."""
        p = self.params
        n = int(p.get("n", 16))
        is_random = self.kind == "random"
        return BenchConfig(
            base_url=base_url,
            backend=backend,
            dataset=self.kind,
            dataset_path=None if is_random else p["path"],
            train_path=p.get("train"),
            num_shots=int(p.get("shots", 0)),
            num_prompts=n,
            input_len=int(p.get("in", 1024)),
            output_len=int(p.get("out", 128)),
            range_ratio=float(p.get("ratio", 1.0)),
            max_concurrency=int(p.get("conc", 1)),
            request_rate=float(p.get("rate", math.inf)),
            seed=seed + run_index,
            prompt_offset=run_index * n,
            warmup_requests=0,
            progress=False,
        )


def parse_workload(spec: str) -> Workload:
    """Parses one "KIND:key=value,..." string; raises ValueError naming the bad field."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in _KEYS:
        raise ValueError(f"workload kind must be one of {sorted(_KEYS)}, got {kind!r} in {spec!r}")
    params: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in _KEYS[kind]:
            raise ValueError(
                f"workload {spec!r}: bad field {item!r}; allowed: {sorted(_KEYS[kind])}"
            )
        params[key] = value
    if kind == "gsm8k" and "path" not in params:
        raise ValueError(f"workload {spec!r}: gsm8k needs path=<test.jsonl>")
    if kind == "random":
        default = f"random-in{params.get('in', 1024)}-out{params.get('out', 128)}-c{params.get('conc', 1)}"
    else:
        default = f"gsm8k-out{params.get('out', 128)}-c{params.get('conc', 1)}"
    return Workload(params.pop("name", default), kind, params)
