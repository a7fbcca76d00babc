"""Profile DSpark step time against verify batch size on this device; write an SPS table.

    python -m sgl_dspark.tools.dspark_sps_profile --model-path tiny --device cpu \\
        --batch-sizes 1,2,4,8 --out sps.json

For each batch size bs, bs requests (16-token prompts) decode with simulated acceptance 1.0 (every
step commits exactly the bonus token, so the batch and its lengths stay fixed) and the full verify
policy; the step time is the median over the steady steps after a warm-up. The diagonal table maps
verify tokens bs * (gamma + 1) to steps per second (`srt/speculative/dspark/sps.py`). A
`<out>.records.jsonl` side file keeps every measured step.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.entrypoints.engine import Engine
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.speculative.dspark.sps import DiagonalSpsTable, save_sps_table

logger = logging.getLogger(__name__)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile_batch(
    engine: Engine, bs: int, warmup: int, steps: int, tokens_per_step: int = 1
) -> list[float]:
    """Step times of `bs` decoding requests (`warmup` steps, then `steps` timed). The requests
    ask for enough tokens never to finish while timed when each step commits at most
    `tokens_per_step` (1 under simulated acceptance 1.0; gamma + 1 otherwise), as far as the
    context length allows."""
    sched = engine.scheduler
    prompt_len = 16
    wanted = (warmup + steps + 8) * tokens_per_step
    room = engine.args.context_length - prompt_len - tokens_per_step
    params = SamplingParams(
        max_new_tokens=max(1, min(wanted, room)), temperature=1.0, ignore_eos=True
    )
    g = torch.Generator().manual_seed(bs)
    vocab = engine.runner.model_cfg.vocab_size
    reqs = [
        Req(
            rid=f"sps-{bs}-{i}",
            params=params,
            prompt_ids=torch.randint(4, vocab, (prompt_len,), generator=g).tolist(),
        )
        for i in range(bs)
    ]
    for r in reqs:
        sched.add(r)
    while any(not r.prefill_done or not r.output_ids for r in reqs):
        sched.step()
    times = []
    for i in range(warmup + steps):
        _sync(engine.args.device)
        t0 = time.perf_counter()
        sched.step()
        _sync(engine.args.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    for r in reqs:
        sched.abort(r.rid)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default="tiny")
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-dspark-block-size", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    sizes = sorted({int(x) for x in a.batch_sizes.split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        raise SystemExit("--batch-sizes needs positive integers")
    engine = Engine(
        model_path=a.model_path,
        device=a.device,
        dtype=a.dtype,
        skip_tokenizer_init=True,
        max_running_requests=max(sizes),
        max_total_tokens=max(sizes) * (16 + a.warmup_steps + a.steps + 64) * 2,
        context_length=256,
        speculative_algorithm="DSpark",
        speculative_draft_model_path=a.speculative_draft_model_path,
        speculative_dspark_block_size=a.speculative_dspark_block_size,
        speculative_dspark_simulate_accept_len=1.0,
    )
    gamma = engine.spec.worker.gamma
    tokens, sps, records = [], [], []
    for bs in sizes:
        times = profile_batch(engine, bs, a.warmup_steps, a.steps)
        med = statistics.median(times)
        tokens.append(bs * (gamma + 1))
        sps.append(1.0 / med)
        records.extend(
            {"batch_size": bs, "verify_tokens": bs * (gamma + 1), "step_s": t} for t in times
        )
        logger.info("bs=%d verify_tokens=%d median step %.2f ms", bs, tokens[-1], med * 1e3)
    table = DiagonalSpsTable(tuple(tokens), tuple(sps), max(tokens))
    save_sps_table(table, a.out)
    with open(a.out + ".records.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
