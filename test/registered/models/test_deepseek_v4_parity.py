"""Parity of the serving model with HF transformers' DeepseekV4ForCausalLM (fp32, CPU).

Every check compares against HF's no-cache prefill logits of the same committed sequence, which
equal HF's own cached decode to < 1e-6 in fp32.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import PARITY_CONFIGS, hf_logits, make_hf_model
from runner_utils import Driver
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardMode
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig

TOL = dict(atol=1e-5, rtol=1e-5)
CONFIGS = list(PARITY_CONFIGS)


@pytest.fixture(scope="module", params=CONFIGS)
def setup(request):
    hf = make_hf_model(request.param, seed=CONFIGS.index(request.param))
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    return hf, cfg


def _runner(setup) -> tuple[object, Driver]:
    hf, cfg = setup
    runner = ModelRunner(
        cfg,
        RunnerConfig(max_total_tokens=8192, max_running_requests=16, context_length=256),
        weights=hf.state_dict().items(),
    )
    return hf, Driver(runner)


def _rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def test_flat_batch_prefill_different_lengths(setup):
    hf, drv = _runner(setup)
    seqs = [_rand_ids(n, 10 + n) for n in (80, 37, 1, 16, 53)]
    slots = [drv.new_request() for _ in seqs]
    outs = drv.step(ForwardMode.EXTEND, list(zip(slots, seqs)))
    for ids, out in zip(seqs, outs):
        torch.testing.assert_close(out, hf_logits(hf, ids), **TOL)


def test_chunked_prefill(setup):
    hf, drv = _runner(setup)
    ids = _rand_ids(80, 3)
    ref = hf_logits(hf, ids)
    slot = drv.new_request()
    start = 0
    for n in (13, 22, 1, 44):
        out = drv.step(ForwardMode.EXTEND, [(slot, ids[start : start + n])])[0]
        torch.testing.assert_close(out, ref[start : start + n], **TOL)
        start += n


def test_decode_token_by_token_in_a_batch(setup):
    """Three requests of different prompt lengths decode 100 tokens each in one batch, crossing
    many CSA/HCA block boundaries and the sliding window."""
    hf, drv = _runner(setup)
    prompts = [_rand_ids(n, 20 + n) for n in (5, 17, 30)]
    conts = [_rand_ids(100, 40 + i) for i in range(3)]
    slots = [drv.new_request() for _ in prompts]
    drv.step(ForwardMode.EXTEND, list(zip(slots, prompts)))
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for t in range(100):
        outs = drv.step(ForwardMode.DECODE, [(s, [c[t]]) for s, c in zip(slots, conts)])
        for i, o in enumerate(outs):
            got[i].append(o[0])
    for p, c, g in zip(prompts, conts, got):
        ref = hf_logits(hf, p + c)[len(p) :]
        torch.testing.assert_close(torch.stack(g), ref, **TOL)


@pytest.mark.parametrize("width", [2, 3, 5, 8])
def test_verify_equals_decode_steps(setup, width):
    """Verify W tokens per request (ragged: W differs per request) == W decode steps."""
    hf, drv = _runner(setup)
    prompts = [_rand_ids(n, 60 + n) for n in (29, 44)]
    widths = [width, max(1, width - 1)]
    slots = [drv.new_request() for _ in prompts]
    drv.step(ForwardMode.EXTEND, list(zip(slots, prompts)))
    seqs = [list(p) for p in prompts]
    for rnd in range(4):
        win = [_rand_ids(w, 100 * rnd + w + i) for i, w in enumerate(widths)]
        outs = drv.step(ForwardMode.VERIFY, list(zip(slots, win)))
        for i, (seq, o) in enumerate(zip(seqs, outs)):
            seq.extend(win[i])
            torch.testing.assert_close(o, hf_logits(hf, seq)[-widths[i] :], **TOL)
    # and against our own decode steps on a fresh runner
    _, drv2 = _runner(setup)
    s2 = drv2.new_request()
    drv2.step(ForwardMode.EXTEND, [(s2, prompts[0][:-1])])
    dec = [drv2.step(ForwardMode.DECODE, [(s2, [t])])[0][0] for t in seqs[0][len(prompts[0]) - 1 :]]
    ver_ref = hf_logits(hf, seqs[0])[len(prompts[0]) - 1 :]
    torch.testing.assert_close(torch.stack(dec), ver_ref, **TOL)


def test_rejected_verify_rollback(setup):
    """Verify 8 draft tokens, accept only a prefix, then decode other tokens: logits equal never
    having verified the rejected ones (every cache: window, compressed, indexer, rings)."""
    hf, drv = _runner(setup)
    slot = drv.new_request()
    seq = _rand_ids(21, 7)
    drv.step(ForwardMode.EXTEND, [(slot, seq)])
    g = torch.Generator().manual_seed(11)
    for rnd in range(12):
        drafts = torch.randint(0, 512, (8,), generator=g).tolist()
        drv.step(ForwardMode.VERIFY, [(slot, drafts)], commit=False)
        accepted = int(torch.randint(0, 8, (1,), generator=g))
        drv.commit(slot, accepted)
        seq.extend(drafts[:accepted])
        # the next tokens differ from the rejected drafts
        nxt = torch.randint(0, 512, (3,), generator=g).tolist()
        outs = drv.step(ForwardMode.EXTEND if rnd % 2 else ForwardMode.VERIFY, [(slot, nxt)])
        seq.extend(nxt)
        torch.testing.assert_close(outs[0], hf_logits(hf, seq)[-3:], **TOL)
