"""Penalties, logit biases, min_new_tokens and grammar masks (`srt/layers/logits_adjust.py`)
against a hand-written reference of SGLang's formulas; verify windows against the same request
advanced token by token; the grammar matcher's state after a window; top-N / token-id logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from sgl_dspark.srt.constrained import GrammarBackend
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.layers.logits_adjust import build_logits_adjust, unpack_bitmask
from sgl_dspark.srt.layers.logprobs import logprob_extras, row_logprobs
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.tokenizer.byte_tokenizer import BYTE_OFFSET, EOS_ID, ByteTokenizer

VOCAB = 300
EOS = (1,)


def _reference(logits: list[float], output: list[int], p: SamplingParams) -> list[float]:
    """SGLang's penalizers, one token at a time: frequency and presence subtract, min_new_tokens
    holds back the stop tokens and EOS, repetition divides positive / multiplies negative
    logits of seen tokens, then the logit bias is added."""
    out = list(logits)
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(output) < p.min_new_tokens:
        for t in set(EOS) | set(p.stop_token_ids):
            out[t] = -math.inf
    for t in counts:
        out[t] = out[t] * p.repetition_penalty if out[t] < 0 else out[t] / p.repetition_penalty
    for t, b in p.logit_bias:
        out[t] += b
    return out


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    if kind == 0:
        return SamplingParams()  # neutral
    return SamplingParams(
        max_new_tokens=64,
        frequency_penalty=rng.choice([0.0, 0.5, -1.3, 2.0]),
        presence_penalty=rng.choice([0.0, 1.0, -0.7]),
        repetition_penalty=rng.choice([1.0, 1.5, 0.6, 2.0]),
        min_new_tokens=rng.choice([0, 3, 9]),
        stop_token_ids=rng.sample(range(VOCAB), rng.randrange(3)),
        logit_bias={str(t): rng.uniform(-100, 100) for t in rng.sample(range(VOCAB), 4)},
    )


def _req(i: int, params: SamplingParams, output: list[int]) -> Req:
    return Req(rid=str(i), prompt_ids=[5, 6], params=params, output_ids=list(output))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adjust_matches_sglang_formulas(seed):
    rng = random.Random(seed)
    batch = 12
    params = [_random_params(rng) for _ in range(batch)]
    # Repeated tokens, so counts above 1 occur; output lengths around min_new_tokens.
    outputs = [[rng.randrange(20) for _ in range(rng.randrange(12))] for _ in range(batch)]
    reqs = [_req(i, p, o) for i, (p, o) in enumerate(zip(params, outputs))]
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    adjust = build_logits_adjust(reqs, VOCAB, torch.device("cpu"), EOS)
    assert adjust is not None
    got = adjust.apply(logits)
    assert not torch.equal(got, logits)
    for r in range(batch):
        want = torch.tensor(_reference(logits[r].tolist(), outputs[r], params[r]))
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-4)


def test_neutral_requests_build_nothing():
    reqs = [_req(0, SamplingParams(), [3, 3, 4])]
    assert build_logits_adjust(reqs, VOCAB, torch.device("cpu"), EOS) is None


@pytest.mark.parametrize("width", [2, 4, 6])
def test_verify_window_sees_the_drafts_before_each_position(width):
    """Row (r, j) of a window equals the one-row adjustment of the request whose output also
    holds drafts d_1..d_j."""
    rng = random.Random(width)
    batch = 6
    params = [_random_params(rng) for _ in range(batch)]
    outputs = [[rng.randrange(15) for _ in range(rng.randrange(6))] for _ in range(batch)]
    drafts = [[rng.randrange(15) for _ in range(width - 1)] for _ in range(batch)]
    reqs = [_req(i, p, o) for i, (p, o) in enumerate(zip(params, outputs))]
    logits = torch.randn(batch * width, VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    adjust = build_logits_adjust(
        reqs,
        VOCAB,
        torch.device("cpu"),
        EOS,
        width=width,
        drafts=torch.tensor(drafts),
        drafts_host=drafts,
    )
    assert adjust is not None
    got = adjust.apply(logits)
    for r in range(batch):
        for j in range(width):
            alone = _req(r, params[r], outputs[r] + drafts[r][:j])
            one = build_logits_adjust([alone], VOCAB, torch.device("cpu"), EOS)
            row = logits[r * width + j : r * width + j + 1]
            want = row if one is None else one.apply(row)
            torch.testing.assert_close(got[r * width + j], want[0], rtol=1e-5, atol=1e-4)


def _byte(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


def test_grammar_window_masks_follow_the_drafts_and_roll_back():
    backend = GrammarBackend(ByteTokenizer(), VOCAB, [EOS_ID])
    regex = "(ab|cd)[0-9]{2}x"
    width = 5
    cases = [
        ("a", _byte("b12x")),  # every draft valid, the last completes the grammar
        ("", _byte("cd9z")),  # the fourth draft is invalid
        ("ab1", _byte("x") + [EOS_ID] * 3),  # invalid: "1" then "x" (needs two digits)
    ]
    reqs = []
    for i, (prefix, _) in enumerate(cases):
        req = _req(i, SamplingParams(regex=regex), _byte(prefix))
        req.grammar = backend.matcher("regex", regex)
        for t in req.output_ids:
            assert req.grammar.accept(t)
        reqs.append(req)
    drafts = [d for _, d in cases]
    adjust = build_logits_adjust(
        reqs,
        VOCAB,
        torch.device("cpu"),
        EOS,
        width=width,
        drafts=torch.tensor(drafts),
        drafts_host=drafts,
    )
    assert adjust is not None and adjust.allowed is not None
    allowed = adjust.allowed
    for r, (prefix, window) in enumerate(cases):
        fresh = backend.matcher("regex", regex)
        ok = all(fresh.accept(t) for t in _byte(prefix))
        assert ok
        last_valid = None
        for j in range(width):
            if j > 0 and last_valid is not None and not fresh.accept(window[j - 1]):
                last_valid = None
            if j == 0 or last_valid is not None:
                mask = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
                fresh.fill_mask(mask, 0)
                last_valid = unpack_bitmask(mask, VOCAB)[0]
                assert torch.equal(allowed[r * width + j], last_valid), (r, j)
            else:
                # After a rejected draft the row repeats the last valid one (never accepted).
                assert torch.equal(allowed[r * width + j], allowed[r * width + j - 1])
        # The request's own matcher is back where it was: the same next tokens as a fresh one.
        probe = torch.zeros((2, (VOCAB + 31) // 32), dtype=torch.int32)
        reqs[r].grammar.fill_mask(probe, 0)
        again = backend.matcher("regex", regex)
        for t in _byte(prefix):
            again.accept(t)
        again.fill_mask(probe, 1)
        assert torch.equal(probe[0], probe[1])
    # The completed grammar allows only EOS; masked logits are -inf outside the allowed set.
    out = adjust.apply(torch.zeros(len(cases) * width, VOCAB))
    assert torch.isinf(out[4]).sum() == VOCAB - 1 and out[4, EOS_ID] == 0


def test_bad_grammars_name_their_field():
    backend = GrammarBackend(ByteTokenizer(), VOCAB, [EOS_ID])
    for kind, source in (("regex", "(ab"), ("json_schema", "{nope"), ("ebnf", "root ::= x")):
        with pytest.raises(ValueError, match=f"^{kind} invalid grammar: ") as info:
            backend.matcher(kind, source)
        assert info.value.param == kind  # type: ignore[attr-defined]


def test_logprob_extras_against_sorting():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 50, generator=gen)
    logits[2, 10] = logits[2, 3] = 9.0  # a tie: the lower id first
    temps = torch.tensor([1.0, 0.5, 1.0, 2.0, 1.0, 0.7, 1.3])
    lp = row_logprobs(logits, temps)
    want_lp = torch.log_softmax(logits.double() / temps[:, None].double(), dim=-1)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=1e-5)
    ids = [(1, 2), (), (3, 10, 49), (0,), (), (5,), (7, 7)]
    ex = logprob_extras(lp, 4, ids)
    for r in range(7):
        order = sorted(range(50), key=lambda t: (-float(lp[r, t]), t))[:4]
        assert ex.top_ids[r].tolist() == order
        assert ex.top_values[r].tolist() == [float(lp[r, t]) for t in order]
        assert ex.id_values[r, : len(ids[r])].tolist() == [float(lp[r, t]) for t in ids[r]]
    assert ex.top_ids[2, :2].tolist() == [3, 10]


def test_a_grammar_that_must_end_wins_over_min_new_tokens():
    """A grammar complete after its output allows only EOS, which min_new_tokens holds back: the
    row keeps EOS (a token to sample) instead of masking everything."""
    backend = GrammarBackend(ByteTokenizer(), VOCAB, [EOS_ID])
    req = _req(0, SamplingParams(regex="ab", min_new_tokens=5), _byte("ab"))
    req.grammar = backend.matcher("regex", "ab")
    for t in req.output_ids:
        assert req.grammar.accept(t)
    other = _req(1, SamplingParams(min_new_tokens=5), [9])
    adjust = build_logits_adjust([req, other], VOCAB, torch.device("cpu"), EOS)
    assert adjust is not None
    out = adjust.apply(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [EOS_ID]
    assert torch.isneginf(out[1, EOS_ID]) and torch.isfinite(out[1]).sum() == VOCAB - 1


def test_grammar_over_a_byte_level_bpe_vocabulary(tmp_path):
    """A Hugging Face byte-level BPE vocabulary (multi-byte tokens, the Ġ space mapping): every
    token the regex allows first decodes to a valid start, and the tokenizer's own encoding of a
    matching string walks the grammar to its end."""
    from sgl_dspark.srt.tokenizer.hf_tokenizer import HFTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["the cat 12 sat on 345 mats", "a cat and 6789 dogs"] * 30, trainer)
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer.from_dir(str(tmp_path))
    vocab = 320  # the model's vocabulary may be wider than the tokenizer's
    eos = raw.token_to_id("</s>")
    assert eos is not None
    backend = GrammarBackend(tok, vocab, [eos])
    regex = "(the|a) cat [0-9]+"
    matcher = backend.matcher("regex", regex)
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    matcher.fill_mask(mask, 0)
    allowed = unpack_bitmask(mask, vocab)[0].nonzero().flatten().tolist()
    assert allowed and all(i < raw.get_vocab_size() for i in allowed)
    for i in allowed:
        text = tok.decode([i])
        assert "the cat 0".startswith(text) or "a cat 0".startswith(text), text
    ids = tok.encode("the cat 345", add_special_tokens=False)
    assert len(ids) < len("the cat 345")  # multi-byte tokens
    for t in ids:
        assert matcher.accept(t), tok.decode([t])
    assert matcher.accept(eos) and matcher.terminated
