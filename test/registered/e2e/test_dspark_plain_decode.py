"""Static width 1 = no speculation at that batch size: while the batch is that large the
scheduler runs plain decode steps (overlapped) that only commit the draft's context KV, and DSpark
resumes when the batch shrinks. Greedy output stays equal to decoding without DSpark."""

from __future__ import annotations

import json

import torch
from sgl_dspark import Engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_width_one_runs_plain_decode_and_stays_lossless(tmp_path):
    table = tmp_path / "widths.json"
    table.write_text(json.dumps({"widths_by_batch_size": {"1": 3, "3": 1}}))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 12, 5, 9)]
    # Different lengths: the batch shrinks from 4 (plain) to 2 and 1 (DSpark) as requests end.
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
              for n in (6, 9, 30, 40)]
    common = dict(model_path="tiny", skip_tokenizer_init=True, context_length=256,
                  max_running_requests=8, device=DEVICE)
    with Engine(**common) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts,
                                                        sampling_params=params)]
    with Engine(**common, speculative_algorithm="DSpark",
                speculative_dspark_verify_policy="static",
                speculative_dspark_width_table_path=str(table)) as spec_engine:
        sched = spec_engine.scheduler
        calls = {"plain": 0, "spec": 0}
        overlapped, spec_step = sched._decode_overlapped, sched.spec.step

        def count_plain():
            calls["plain"] += 1
            return overlapped()

        def count_spec(reqs):
            calls["spec"] += 1
            return spec_step(reqs)

        sched._decode_overlapped = count_plain  # type: ignore[method-assign]
        sched.spec.step = count_spec  # type: ignore[method-assign]
        got = [o["output_ids"] for o in spec_engine.generate(input_ids=prompts,
                                                             sampling_params=params)]
    assert got == want
    assert calls["plain"] >= 4 and calls["spec"] >= 4, calls
