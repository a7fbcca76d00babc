"""With a draft that proposes exactly the target's greedy continuation, every verified draft is
accepted: accept length reaches gamma + 1 and the number of steps falls accordingly (the
machinery really accepts, not only rejects)."""

from __future__ import annotations

import types

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.speculative.dspark.sampling import MarkovSampleOutput
from sgl_dspark.srt.speculative.dspark.worker import DraftProposal

PROMPTS = [[40 + i, 50, 60 + i] for i in range(6)]
N_NEW = 29


def _oracle_propose(reference: dict[tuple[int, ...], list[int]], reqs: list):
    """The executor's proposal replaced by the reference continuation of the step's `reqs`."""

    def propose(self, batch_size, anchors, seq_t, slot_t, info, gamma):
        assert batch_size == len(reqs)
        rows = []
        for r in reqs:
            ref = reference[tuple(r.prompt_ids)]
            k = len(r.output_ids)
            nxt = ref[k : k + gamma]
            rows.append(nxt + [0] * (gamma - len(nxt)))
        drafts = torch.tensor(rows, dtype=torch.int64, device=anchors.device)
        vocab = self.runner.model_cfg.vocab_size
        z = torch.zeros(len(reqs), gamma, vocab, device=anchors.device)
        e = torch.zeros(len(reqs), gamma, self.worker.dcfg.markov_rank, device=anchors.device)
        return DraftProposal(MarkovSampleOutput(drafts, z, e), None)

    return propose


@pytest.mark.parametrize("gamma", [3, 5, 7])
def test_oracle_draft_accepts_whole_blocks(gamma):
    params = {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}
    base = Engine(model_path="tiny", device="cpu", skip_tokenizer_init=True, context_length=256)
    reference = {
        tuple(p): o["output_ids"]
        for p, o in zip(PROMPTS, base.generate(input_ids=PROMPTS, sampling_params=params))
    }
    engine = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=256,
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=gamma,
    )
    spec = engine.spec
    current: list = []
    eager_step = spec.eager_step

    def step(reqs):
        current[:] = reqs
        return eager_step(reqs)

    spec.eager_step = step
    spec._propose = types.MethodType(_oracle_propose(reference, current), spec)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    for p, o in zip(PROMPTS, outs):
        assert o["output_ids"] == reference[tuple(p)]
        # token 1 comes from prefill; the other N_NEW-1 in blocks of gamma+1
        steps = -(-(N_NEW - 1) // (gamma + 1))
        assert o["meta_info"]["spec_verify_ct"] == steps
        assert o["meta_info"]["spec_accept_length"] == pytest.approx((N_NEW - 1) / steps)
    summary = spec.metrics.summary()
    assert summary.correct_drafts == summary.verified_drafts
    assert max(s.accept_length for s in spec.metrics.step_records()) == gamma + 1
