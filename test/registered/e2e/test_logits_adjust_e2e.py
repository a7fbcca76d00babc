"""Penalties, logit biases, min_new_tokens, stop token ids and grammars through the Engine, with
and without DSpark: greedy outputs are identical; every greedy token is the argmax of the
model's logits adjusted by a hand-written reference of SGLang's formulas; grammar outputs match
their grammar; logprobs (chosen, top-N, token ids, prompt) equal an independent computation from
the model's logits; DSpark's top logprobs equal plain decoding's. A draft that proposes the
right continuation is accepted whole, so every verify position's adjustment is exercised."""

from __future__ import annotations

import json
import math
import re
import types

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.core.forward_batch import ForwardMode
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.speculative.dspark.sampling import MarkovSampleOutput
from sgl_dspark.srt.speculative.dspark.worker import DraftProposal
from sgl_dspark.srt.tokenizer.byte_tokenizer import BYTE_OFFSET, EOS_ID

CTX = 256
GREEDY = {"temperature": 0.0}
WHITESPACE = {str(BYTE_OFFSET + ord(c)): -100.0 for c in " \t\n\r"}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "boolean"}},
    "required": ["name", "n"],
}
REGEX = "(yes|no)-[0-9]{2,3}"
EBNF = 'root ::= "<" item ("," item)* ">"\nitem ::= [a-d]+'

PENALISED = [
    ("Hello", {"frequency_penalty": 1.5, "max_new_tokens": 12}),
    ("Hello!", {"presence_penalty": 2.0, "max_new_tokens": 12}),
    ("Hello?", {"repetition_penalty": 1.9, "max_new_tokens": 12}),
    ("Hello.", {"repetition_penalty": 0.5, "frequency_penalty": -0.5, "max_new_tokens": 10}),
    ("abc", {"logit_bias": {str(BYTE_OFFSET + ord("z")): 6.0}, "max_new_tokens": 10}),
    ("abcd", {"logit_bias": {str(EOS_ID): 100.0}, "min_new_tokens": 4, "max_new_tokens": 9}),
    ("xy", {"frequency_penalty": 0.8, "stop_token_ids": [BYTE_OFFSET + ord("B")]}),
]
CONSTRAINED = [
    ("Hi", {"regex": REGEX, "max_new_tokens": 12}),
    ("Hi!", {"ebnf": EBNF, "max_new_tokens": 14}),
    ("Hi?", {"json_schema": json.dumps(SCHEMA), "logit_bias": WHITESPACE, "max_new_tokens": 40}),
    ("Hi.", {"regex": "[a-f]{3,5}", "repetition_penalty": 1.8, "max_new_tokens": 10}),
]


def _params(extra: dict) -> dict:
    return {**GREEDY, "max_new_tokens": 12, **extra}


def _engine(**kw) -> Engine:
    return Engine(model_path="tiny", device="cpu", context_length=CTX, **kw)


@pytest.fixture(scope="module")
def plain():
    return _engine()


@pytest.fixture(scope="module")
def spec():
    return _engine(speculative_algorithm="DSpark", speculative_dspark_block_size=3)


@pytest.fixture(scope="module")
def reference(plain):
    cases = PENALISED + CONSTRAINED
    outs = plain.generate([p for p, _ in cases], [_params(sp) for _, sp in cases])
    return cases, outs


def _model_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The model's logits [len(ids), V] of one forward over `ids` (no sampler, no executor)."""
    from sgl_dspark.srt.core.forward_batch import ForwardBatch

    runner = engine.runner
    pool = runner.req_pool
    slot = pool.alloc_slot()
    try:
        pool.reserve(slot, len(ids))
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, [ids], [0], [slot], pool.req_to_token, logits_rows="all"
        )
        with torch.inference_mode():
            return runner.forward(batch).logits.double()
    finally:
        pool.free_slot(slot)


def _sglang_adjusted(logits: list[float], output: list[int], p: SamplingParams) -> list[float]:
    """SGLang's penalizers written out: frequency / presence subtract, min_new_tokens holds back
    EOS and the stop token ids, repetition scales seen tokens, the logit bias is added."""
    out = list(logits)
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(output) < p.min_new_tokens:
        for t in {EOS_ID, *p.stop_token_ids}:
            out[t] = -math.inf
    for t in counts:
        out[t] = out[t] * p.repetition_penalty if out[t] < 0 else out[t] / p.repetition_penalty
    for t, b in p.logit_bias:
        out[t] += b
    return out


def test_greedy_follows_sglang_formulas(plain, reference):
    cases, outs = reference
    changed = 0
    for (prompt, sp), out in zip(cases[: len(PENALISED)], outs):
        params = SamplingParams.from_dict(_params(sp))
        ids = plain.tokenizer.encode(prompt)
        output = out["output_ids"]
        logits = _model_logits(plain, ids + output[:-1])
        for n, tok in enumerate(output):
            row = logits[len(ids) - 1 + n].tolist()
            adjusted = _sglang_adjusted(row, output[:n], params)
            assert tok == max(range(len(adjusted)), key=lambda t: (adjusted[t], -t)), (sp, n)
            changed += int(tok != max(range(len(row)), key=lambda t: (row[t], -t)))
    assert changed >= 5  # the adjustments really change the greedy choice


def test_min_new_tokens_holds_back_eos(reference):
    cases, outs = reference
    out = outs[[i for i, (_, sp) in enumerate(cases) if sp.get("min_new_tokens")][0]]
    assert out["output_ids"][-1] == EOS_ID and len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}


def test_grammar_outputs_match(reference):
    cases, outs = reference
    by_kind = {}
    for (_, sp), out in zip(cases[len(PENALISED) :], outs[len(PENALISED) :]):
        by_kind[next(k for k in ("regex", "ebnf", "json_schema") if k in sp), sp.get("regex")] = out
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert re.fullmatch(REGEX, by_kind["regex", REGEX]["text"])
    assert re.fullmatch(r"<[a-d]+(,[a-d]+)*>", by_kind["ebnf", None]["text"])
    doc = json.loads(by_kind["json_schema", None]["text"])
    assert set(doc) == {"name", "n"} and isinstance(doc["n"], bool) and len(doc["name"]) <= 4
    assert re.fullmatch("[a-f]{3,5}", by_kind["regex", "[a-f]{3,5}"]["text"])


def test_dspark_greedy_equals_plain(spec, reference):
    cases, outs = reference
    got = spec.generate([p for p, _ in cases], [_params(sp) for _, sp in cases])
    for (_, sp), want, out in zip(cases, outs, got):
        assert out["output_ids"] == want["output_ids"], sp
        assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def _oracle(spec: Engine, continuation: dict[tuple[int, ...], list[int]]) -> None:
    """Replace the DSpark proposal with `continuation` (per prompt) from each request's
    position: drafts the target accepts whole when it is the right output."""
    current: list = []
    eager_step = spec.spec.eager_step

    def step(reqs):
        current[:] = reqs
        return eager_step(reqs)

    def propose(self, batch_size, anchors, seq_t, slot_t, info, gamma):
        rows = []
        for r in current:
            ref = continuation[tuple(r.prompt_ids)]
            k = len(r.output_ids)
            nxt = ref[k : k + gamma]
            rows.append(nxt + [BYTE_OFFSET] * (gamma - len(nxt)))
        drafts = torch.tensor(rows, dtype=torch.int64, device=anchors.device)
        vocab = self.runner.model_cfg.vocab_size
        z = torch.zeros(batch_size, gamma, vocab, device=anchors.device)
        e = torch.zeros(batch_size, gamma, self.worker.dcfg.markov_rank, device=anchors.device)
        return DraftProposal(MarkovSampleOutput(drafts, z, e), None)

    spec.spec.eager_step = step
    spec.spec._propose = types.MethodType(propose, spec.spec)


@pytest.mark.parametrize("drafts", ["right", "unadjusted"])
def test_dspark_window_positions_see_their_drafts(plain, reference, drafts):
    """Drafts of the right (adjusted) output are accepted whole: every verify position applies
    the penalties, biases and grammar state of the drafts before it. Drafts of the unadjusted
    greedy output diverge mid-window and are rejected there. Outputs equal plain decoding."""
    cases, outs = reference
    engine = _engine(speculative_algorithm="DSpark", speculative_dspark_block_size=4)
    prompts = [p for p, _ in cases]
    ids = [tuple(plain.tokenizer.encode(p)) for p in prompts]
    if drafts == "right":
        continuation = {i: o["output_ids"] for i, o in zip(ids, outs)}
    else:
        raw = plain.generate(prompts, [_params({"max_new_tokens": 40})] * len(prompts))
        continuation = {i: o["output_ids"] for i, o in zip(ids, raw)}
    assert len(set(ids)) == len(ids)  # the continuation table is keyed by prompt
    _oracle(engine, continuation)
    got = engine.generate(prompts, [_params(sp) for _, sp in cases])
    for case, want, out in zip(cases, outs, got):
        assert out["output_ids"] == want["output_ids"], case
    if drafts == "right":
        # Every request longer than a window took whole windows.
        lengths = [o["meta_info"]["spec_accept_length"] for o in got if len(o["output_ids"]) > 6]
        assert lengths and min(lengths) > 2.0, lengths


def _independent_logprobs(engine: Engine, ids: list[int], output: list[int], temperature: float):
    logits = _model_logits(engine, ids + output[:-1])
    prompt_lp = torch.log_softmax(logits[: len(ids) - 1], dim=-1)
    out_lp = torch.log_softmax(logits[len(ids) - 1 :] / temperature, dim=-1)
    return prompt_lp, out_lp


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_the_model(plain, spec, temperature):
    prompt = "Logprobs!"
    sp = {"temperature": temperature, "max_new_tokens": 10, "seed": 11}
    token_ids = [BYTE_OFFSET + ord("a"), EOS_ID, 300]
    outs = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        outs[name] = engine.generate(
            prompt,
            sp,
            return_logprob=True,
            logprob_start_len=2,
            top_logprobs_num=5,
            token_ids_logprob=token_ids,
            return_text_in_logprobs=True,
        )
    ids = plain.tokenizer.encode(prompt)
    for name, out in outs.items():
        meta = out["meta_info"]
        output = out["output_ids"]
        prompt_lp, out_lp = _independent_logprobs(
            plain, ids, output, temperature if temperature > 0 else 1.0
        )
        # Prompt tokens from logprob_start_len: the first None, then scored by the position before.
        inp = meta["input_token_logprobs"]
        assert [t for _, t, _ in inp] == ids[2:] and inp[0][0] is None
        for k, (lp, tok, text) in enumerate(inp[1:], start=3):
            assert lp == pytest.approx(float(prompt_lp[k - 1, tok]), abs=2e-4)
            assert text == plain.tokenizer.decode([tok], skip_special_tokens=False)
        assert meta["input_top_logprobs"][0] is None
        for k, row in enumerate(meta["input_top_logprobs"][1:], start=3):
            best = torch.topk(prompt_lp[k - 1], 5)
            assert [t for _, t, _ in row] == best.indices.tolist()
            assert [lp for lp, _, _ in row] == pytest.approx(best.values.tolist(), abs=2e-4)
        # Output tokens: the distribution each was sampled from (temperature-scaled).
        got = meta["output_token_logprobs"]
        assert [t for _, t, _ in got] == output
        want = [float(out_lp[n, t]) for n, t in enumerate(output)]
        assert [lp for lp, _, _ in got] == pytest.approx(want, abs=2e-4)
        for n, row in enumerate(meta["output_top_logprobs"]):
            best = torch.topk(out_lp[n], 5)
            assert [t for _, t, _ in row] == best.indices.tolist(), (name, n)
            assert [lp for lp, _, _ in row] == pytest.approx(best.values.tolist(), abs=2e-4)
        for n, row in enumerate(meta["output_token_ids_logprobs"]):
            assert [t for _, t, _ in row] == token_ids
            assert [lp for lp, _, _ in row] == pytest.approx(
                [float(out_lp[n, t]) for t in token_ids], abs=2e-4
            )
    assert outs["spec"]["output_ids"] == outs["plain"]["output_ids"]
    for key in ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs"):
        a, b = outs["plain"]["meta_info"][key], outs["spec"]["meta_info"][key]
        for row_a, row_b in zip(a, b):
            if row_a is None:
                assert row_b is None
                continue
            assert [t for _, t, _ in row_a] == [t for _, t, _ in row_b]
            assert [v for v, _, _ in row_a] == pytest.approx([v for v, _, _ in row_b], abs=1e-4)


def test_logprobs_of_adjusted_rows(plain, spec):
    """With a penalty the reported logprobs are those of the adjusted distribution (SGLang's),
    identical with DSpark."""
    sp = {**GREEDY, "max_new_tokens": 8, "frequency_penalty": 1.2, "logit_bias": {"80": 3.0}}
    outs = [e.generate("Hello", sp, return_logprob=True, top_logprobs_num=3) for e in (plain, spec)]
    ids = plain.tokenizer.encode("Hello")
    output = outs[0]["output_ids"]
    assert outs[1]["output_ids"] == output
    logits = _model_logits(plain, ids + output[:-1])
    params = SamplingParams.from_dict(sp)
    for n, tok in enumerate(output):
        adjusted = torch.tensor(
            _sglang_adjusted(logits[len(ids) - 1 + n].tolist(), output[:n], params)
        )
        lp = torch.log_softmax(adjusted, dim=-1)
        for out in outs:
            assert out["meta_info"]["output_token_logprobs"][n][0] == pytest.approx(
                float(lp[tok]), abs=2e-4
            )
            top = out["meta_info"]["output_top_logprobs"][n]
            assert [t for _, t, _ in top] == torch.topk(lp, 3).indices.tolist()


def test_grammar_needs_a_tokenizer():
    engine = Engine(model_path="tiny", device="cpu", context_length=CTX, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="regex constrained decoding needs a tokenizer"):
        engine.generate(input_ids=[5, 6], sampling_params={"regex": "a+"})


def test_grammar_refused_with_simulated_acceptance():
    engine = _engine(speculative_algorithm="DSpark", speculative_dspark_simulate_accept_len=2.0)
    with pytest.raises(ValueError, match="regex: constrained decoding cannot run with simulated"):
        engine.generate("x", {"regex": "a+", "max_new_tokens": 3})
