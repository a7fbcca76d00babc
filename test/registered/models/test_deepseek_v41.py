"""The serving engine on DeepSeek-V4.1 (fp32, CPU, torch path).

* The fixtures (outputs of Hugging Face's V4.1 implementation): `Engine(model_path=dir)` gives
  their prefill and decode logits within 1e-4, for all prompts batched together, and their
  greedy continuations, with and without chunked prefill. On the fixtures' own sequences (prompt
  + greedy continuation, whose quantiser inputs sit far from rounding boundaries), chunked
  prefill and verify with rollback, every quantiser active, agree with the test reference.
* Random checkpoints built like the fixtures, against the independent test reference
  (`v41_reference.py`, one whole sequence per call): chunked prefill split inside ratio-2 groups,
  batched decode across group boundaries, verify of widths 2/3/5/8 with rollback, on every layer
  role (see `v41_random.py` for why their dims leave the quantisers inactive).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from runner_utils import Driver
from safetensors.torch import load_file
from sgl_dspark import Engine
from sgl_dspark.srt.core.forward_batch import ForwardMode
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
from sgl_dspark.srt.models.source import resolve_model
from v41_random import RANDOM_CONFIGS, write_random_v41
from v41_reference import V41Reference

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "deepseek_v41"
CASES = ["c1_hc2_sqrtsoftplus", "c2_hc4_sigmoid_engram"]
PROMPTS = ["p0", "p1", "p2"]
TOL = dict(atol=1e-4, rtol=0.0)
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


class Oracle:
    """Reference logits of whole sequences (memoised)."""

    def __init__(self, ref: V41Reference) -> None:
        self.ref = ref
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, seq: list[int]) -> torch.Tensor:
        key = tuple(seq)
        if key not in self._memo:
            self._memo[key] = self.ref.forward(seq)[0]
        return self._memo[key]


# ---- the fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=CASES)
def fixture_case(request):
    d = FIXTURES / request.param
    return d, load_file(str(d / "vectors.safetensors"))


def test_fixture_prefill_and_decode_logits(fixture_case):
    d, vec = fixture_case
    engine = Engine(model_path=str(d), skip_tokenizer_init=True, context_length=256)
    drv = Driver(engine.runner)
    prompts = [vec[f"{p}.input_ids"].tolist() for p in PROMPTS]
    slots = [drv.new_request() for _ in PROMPTS]
    prefill = drv.step(ForwardMode.EXTEND, list(zip(slots, prompts)))
    decode: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    for step in range(8):
        work = [(s, [int(vec[f"{p}.decode_input_ids"][step])]) for s, p in zip(slots, PROMPTS)]
        for rows, out in zip(decode, drv.step(ForwardMode.DECODE, work)):
            rows.append(out[0])
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(prefill[i], vec[f"{p}.prefill_logits"], **TOL)
        torch.testing.assert_close(torch.stack(decode[i]), vec[f"{p}.decode_logits"], **TOL)
    engine.shutdown()


@pytest.mark.parametrize("chunk", [512, 5])
def test_fixture_greedy_continuations(fixture_case, chunk):
    d, vec = fixture_case
    engine = Engine(
        model_path=str(d),
        skip_tokenizer_init=True,
        context_length=256,
        chunked_prefill_size=chunk,
    )
    outs = engine.generate(
        input_ids=[vec[f"{p}.input_ids"].tolist() for p in PROMPTS], sampling_params=GREEDY
    )
    for p, out in zip(PROMPTS, outs):
        assert out["output_ids"] == vec[f"{p}.greedy_tokens"].tolist(), p
    engine.shutdown()


@pytest.mark.parametrize("width", [2, 3, 5, 8])
def test_fixture_chunks_verify_and_rollback(fixture_case, width):
    """All three prompts in one batch: prefill in chunks ending inside ratio-2 groups, then
    verify rounds of `width` rows whose accepted prefix is the checked continuation and whose
    rejected rows are random tokens; every accepted row equals the reference."""
    d, vec = fixture_case
    oracle = Oracle(V41Reference(d))
    drv = Driver(Engine(model_path=str(d), skip_tokenizer_init=True, context_length=256).runner)
    full = [vec[f"{p}.input_ids"].tolist() + vec[f"{p}.greedy_tokens"].tolist() for p in PROMPTS]
    prompts = [vec[f"{p}.input_ids"].tolist() for p in PROMPTS]
    slots = [drv.new_request() for _ in PROMPTS]
    done = [0] * len(PROMPTS)
    while any(n < len(p) for n, p in zip(done, prompts)):
        work = [(i, min(len(p) - n, 5)) for i, (n, p) in enumerate(zip(done, prompts))]
        work = [(i, k) for i, k in work if k > 0]
        outs = drv.step(
            ForwardMode.EXTEND, [(slots[i], prompts[i][done[i] : done[i] + k]) for i, k in work]
        )
        for (i, k), out in zip(work, outs):
            torch.testing.assert_close(out, oracle(full[i])[done[i] : done[i] + k], **TOL)
            done[i] += k
    g = torch.Generator().manual_seed(width)
    while any(n < len(f) for n, f in zip(done, full)):
        live = [i for i in range(len(full)) if done[i] < len(full[i])]
        accepted, drafts = {}, []
        for i in live:
            n_true = min(
                int(torch.randint(1, width + 1, (1,), generator=g)), len(full[i]) - done[i]
            )
            junk = torch.randint(3, 100, (width - n_true,), generator=g).tolist()
            drafts.append((slots[i], full[i][done[i] : done[i] + n_true] + junk))
            accepted[i] = n_true
        outs = drv.step(ForwardMode.VERIFY, drafts, commit=False)
        for i, out in zip(live, outs):
            n = accepted[i]
            torch.testing.assert_close(out[:n], oracle(full[i])[done[i] : done[i] + n], **TOL)
            drv.commit(slots[i], n)
            done[i] += n


# ---- random checkpoints against the reference --------------------------------------------------


@pytest.fixture(scope="module", params=list(RANDOM_CONFIGS))
def random_model(request, tmp_path_factory):
    d = write_random_v41(request.param, tmp_path_factory.mktemp(request.param), seed=0)
    return d, Oracle(V41Reference(d))


def _driver(model_dir: pathlib.Path) -> Driver:
    cfg, weights = resolve_model(str(model_dir), torch.float32)
    rc = RunnerConfig(max_total_tokens=4096, max_running_requests=8, context_length=128)
    return Driver(ModelRunner(cfg, rc, weights=weights))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_batch_and_chunks_split_inside_groups(random_model):
    d, oracle = random_model
    drv = _driver(d)
    seqs = [_ids(n, 10 + n) for n in (41, 1, 16, 27)]
    slots = [drv.new_request() for _ in seqs]
    for seq, out in zip(seqs, drv.step(ForwardMode.EXTEND, list(zip(slots, seqs)))):
        torch.testing.assert_close(out, oracle(seq), **TOL)
    # chunks ending at odd and even positions, single-token chunks included
    seq, slot, start = _ids(48, 3), drv.new_request(), 0
    for n in (5, 1, 6, 9, 1, 1, 12, 13):
        out = drv.step(ForwardMode.EXTEND, [(slot, seq[start : start + n])])[0]
        torch.testing.assert_close(out, oracle(seq)[start : start + n], **TOL)
        start += n


def test_batched_decode_across_group_boundaries(random_model):
    d, oracle = random_model
    drv = _driver(d)
    prompts = [_ids(n, 20 + n) for n in (4, 9)]
    conts = [_ids(30, 40 + i) for i in range(2)]
    slots = [drv.new_request() for _ in prompts]
    drv.step(ForwardMode.EXTEND, list(zip(slots, prompts)))
    got: list[list[torch.Tensor]] = [[], []]
    for t in range(30):
        outs = drv.step(ForwardMode.DECODE, [(s, [c[t]]) for s, c in zip(slots, conts)])
        for rows, out in zip(got, outs):
            rows.append(out[0])
    for p, c, rows in zip(prompts, conts, got):
        torch.testing.assert_close(torch.stack(rows), oracle(p + c)[len(p) :], **TOL)


@pytest.mark.parametrize("width", [2, 3, 5, 8])
def test_verify_and_rollback(random_model, width):
    """Each round verifies `width` fresh tokens per request (two requests, the second one token
    wider), accepts a random prefix and rolls the rest back; the next round's tokens replace the
    rejected ones at their positions. Every verified row must equal the reference of the
    committed sequence plus that round's tokens."""
    d, oracle = random_model
    drv = _driver(d)
    g = torch.Generator().manual_seed(width)
    committed = [_ids(7, 1), _ids(10, 2)]
    slots = [drv.new_request() for _ in committed]
    drv.step(ForwardMode.EXTEND, list(zip(slots, committed)))
    for _ in range(6):
        drafts = [torch.randint(3, 320, (width + i,), generator=g).tolist() for i in range(2)]
        outs = drv.step(ForwardMode.VERIFY, list(zip(slots, drafts)), commit=False)
        for seq, draft, out in zip(committed, drafts, outs):
            torch.testing.assert_close(out, oracle(seq + draft)[len(seq) :], **TOL)
        for i, (slot, draft) in enumerate(zip(slots, drafts)):
            accepted = int(torch.randint(1, len(draft) + 1, (1,), generator=g))
            committed[i] = committed[i] + draft[:accepted]
            drv.commit(slot, accepted)
    nxt = [_ids(1, 99 + i) for i in range(2)]
    outs = drv.step(ForwardMode.DECODE, list(zip(slots, nxt)))
    for seq, tok, out in zip(committed, nxt, outs):
        torch.testing.assert_close(out[0], oracle(seq + tok)[-1], **TOL)


def test_window_rows_are_computed_once_a_forward(random_model, monkeypatch):
    """Every layer reads the same window rows (one window size): one computation a forward,
    shared through the batch, whatever the depth; the oracle tests above check the values."""
    import sgl_dspark.srt.models.deepseek_v41_attention as attention

    d, oracle = random_model
    drv = _driver(d)
    layers = len(drv.runner.model.model.layers)
    assert layers > 1
    calls = []
    real = attention.window_rows_ref
    monkeypatch.setattr(
        attention, "window_rows_ref", lambda *args: calls.append(args[-1]) or real(*args)
    )
    prompt, cont = _ids(9, 5), _ids(3, 6)
    slot = drv.new_request()
    drv.step(ForwardMode.EXTEND, [(slot, prompt)])
    for t in cont:
        out = drv.step(ForwardMode.DECODE, [(slot, [t])])[0]
    assert len(calls) == 1 + len(cont)
    torch.testing.assert_close(out[0], oracle(prompt + cont)[-1], **TOL)
