"""DSpark tools end to end on CPU: the SPS profiler writes a valid diagonal table; STS
collection writes shards whose labels agree with acceptance, and the fit reads them."""

from __future__ import annotations

import glob
import json

import torch
from sgl_dspark import Engine
from sgl_dspark.srt.speculative.dspark.sps import load_sps_table
from sgl_dspark.tools import dspark_sps_profile, dspark_sts_fit


def test_sps_profiler_writes_table(tmp_path):
    out = str(tmp_path / "sps.json")
    dspark_sps_profile.main(
        ["--batch-sizes", "1,3", "--steps", "4", "--warmup-steps", "1", "--out", out]
    )
    table = load_sps_table(out, kind="diagonal")
    gamma = 5  # tiny-dspark's block size
    assert list(table.sample_batch_tokens) == [1 * (gamma + 1), 3 * (gamma + 1)]
    assert all(v > 0 for v in table.sample_steps_per_sec)
    records = [json.loads(line) for line in open(out + ".records.jsonl")]
    assert {r["batch_size"] for r in records} == {1, 3} and len(records) == 8


def test_sts_collection_labels_match_acceptance_and_fit_runs(tmp_path):
    stem = str(tmp_path / "sts")
    engine = Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        speculative_algorithm="DSpark",
        speculative_dspark_sts_collect_path=stem,
    )
    outs = engine.generate(
        input_ids=[[9, 10, 11], [12, 13], [40, 41, 42, 43]],
        sampling_params={"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True},
    )
    spec = engine.spec
    engine.shutdown()
    shards = sorted(glob.glob(stem + ".*.pt"))
    assert shards
    data = [torch.load(s) for s in shards]
    raw = torch.cat([d["raw"] for d in data])
    mask = torch.cat([d["prefix_mask"] for d in data])
    assert raw.shape == mask.shape and raw.shape[1] == spec.worker.gamma
    assert torch.isfinite(raw).all()
    # labels are prefixes (1s then 0s), and their total equals the accepted drafts
    assert torch.all(mask[:, 1:] <= mask[:, :-1])
    assert int(mask.sum()) == spec.metrics.summary().correct_drafts
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) == raw.shape[0]
    sts_out = str(tmp_path / "sts.json")
    dspark_sts_fit.main(["--data-glob", stem + ".*.pt", "--out", sts_out])
    temps = json.load(open(sts_out))["temperatures"]
    assert len(temps) == spec.worker.gamma and all(t > 0 for t in temps)
