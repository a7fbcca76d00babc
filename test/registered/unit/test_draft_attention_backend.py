"""The DSpark draft model's attention core per `--attention-backend`: "triton" (one
`draft_attention` launch per stage, context rows read through the slots) against "torch" (its
spec, `draft_attention_ref` itself) on a tiny random draft and end to end in the built-in tiny
model with DSpark (the worker passes the target's backend to the draft).

Not bit-exact: the kernel keeps the softmax in fp32 and sums the keys tile by tile, so fp32
draft outputs agree to ~1e-6 (asserted at 1e-4 after the stages' MoE and mHC mixing, which can
amplify a last-ulp difference somewhat).
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.kernels.attention.draft import draft_attention
from sgl_dspark.kernels.attention.reference import draft_attention_ref
from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.model_executor.model_runner import load_weights
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, tiny_weights

# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GAMMA = 4


def _dcfg() -> DSparkConfig:
    target = ModelConfig.from_hf_dict(TINY_HF_CONFIG)
    raw = {
        **TINY_HF_CONFIG,
        "dspark_block_size": GAMMA,
        "dspark_markov_rank": 8,
        "dspark_noise_token_id": 3,
        "dspark_target_layer_ids": [3, 4],
    }
    return DSparkConfig.from_dict(raw, target)


def _drafts(kernels: KernelChoice) -> dict[str, DSparkDraftModel]:
    dcfg = _dcfg()
    out = {}
    for backend in ("torch", "triton"):
        model = DSparkDraftModel(dcfg, kernels, attention_backend=backend)
        shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        load_weights(model, tiny_weights(dcfg.stage_config, shapes, seed=5))
        out[backend] = model.to(DEVICE).eval()
    return out


def _step_inputs(draft: DSparkDraftModel, seq_lens: list[int], gen: torch.Generator):
    """Context pools written for every committed position of each request (shuffled slots, slot
    0 is the dummy), then one draft block per request at s .. s + gamma - 1; the context window
    is [s - window, s) with positions < 0 invalid and pointing at slot 0."""
    cfg = draft.cfg
    window, d = cfg.sliding_window, cfg.hidden_size
    num_slots = sum(seq_lens) + 8
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    table, used = [], 0
    for s in seq_lens:
        table.append(perm[used : used + s])
        used += s
    slots = torch.cat(table)
    positions = torch.cat([torch.arange(s) for s in seq_lens])
    feats = torch.randn(slots.shape[0], len(draft.dcfg.target_layer_ids) * d, generator=gen)
    pools = [
        torch.randn(num_slots, cfg.head_dim, generator=gen).to(DEVICE)
        for _ in range(draft.dcfg.num_stages)
    ]
    with torch.no_grad():
        draft.write_context_kv(feats.to(DEVICE), positions.to(DEVICE), pools, slots.to(DEVICE))
    ctx_pos = torch.tensor(seq_lens)[:, None] - window + torch.arange(window)[None, :]
    ctx_valid = ctx_pos >= 0
    ctx_slots = torch.stack(
        [torch.where(ctx_valid[r], row[ctx_pos[r].clamp(min=0)], 0) for r, row in enumerate(table)]
    )
    block_pos = torch.tensor(seq_lens)[:, None] + torch.arange(GAMMA)[None, :]
    embeds = torch.randn(len(seq_lens), GAMMA, d, generator=gen)
    return (
        embeds.to(DEVICE),
        block_pos.to(DEVICE),
        pools,
        ctx_slots.to(DEVICE),
        ctx_valid.to(DEVICE),
    )


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_triton_draft_matches_torch_draft(kernel_backend: str) -> None:
    # kernel_backend triton also binds the fused mHC boundary, i.e. the other stage loop.
    drafts = _drafts(KernelChoice(kernel_backend))
    gen = torch.Generator().manual_seed(17)
    # A request before the window fills (leading invalid context) and one past it.
    args = _step_inputs(drafts["torch"], [9, 45], gen)
    with torch.no_grad():
        want = drafts["torch"](*args)
        got = drafts["triton"](*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # The context positions that are not visible are never read: poisoning every pool row that
    # no visible position names (the dummy slot 0 included) leaves the triton draft's output
    # unchanged, bit for bit.
    embeds, block_pos, pools, ctx_slots, ctx_valid = args
    unread = torch.ones(pools[0].shape[0], dtype=torch.bool, device=DEVICE)
    unread[ctx_slots[ctx_valid]] = False
    poisoned = [p.masked_fill(unread[:, None], float("nan")) for p in pools]
    with torch.no_grad():
        again = drafts["triton"](embeds, block_pos, poisoned, ctx_slots, ctx_valid)
    assert all(torch.equal(a, g) for a, g in zip(again, got))


def test_backend_binds_the_attention_core() -> None:
    drafts = _drafts(KernelChoice())
    for backend, fn in (("torch", draft_attention_ref), ("triton", draft_attention)):
        assert all(stage.self_attn.attention is fn for stage in drafts[backend].model.layers)
    with pytest.raises(ValueError, match="--attention-backend 'flash'"):
        DSparkDraftModel(_dcfg(), attention_backend="flash")


def _dspark_greedy(attention_backend: str) -> list[list[int]]:
    engine = Engine(
        model_path="tiny",
        device=DEVICE,
        dtype="float32",
        context_length=128,
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=3,
        attention_backend=attention_backend,
    )
    try:
        draft = engine.spec.worker.draft
        want_fn = draft_attention if attention_backend == "triton" else draft_attention_ref
        calls = [0]
        for stage in draft.model.layers:
            assert stage.self_attn.attention is want_fn

            def counted(*args, _fn=want_fn, **kwargs):
                calls[0] += 1
                return _fn(*args, **kwargs)

            stage.self_attn.attention = counted
        params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        outs = engine.generate(prompt=["Hi", "1+1="], sampling_params=params)
        assert calls[0] >= len(draft.model.layers), "the draft never ran"
        return [o["output_ids"] for o in outs]
    finally:
        engine.shutdown()


def test_engine_dspark_greedy_tokens_per_attention_backend() -> None:
    # Greedy DSpark commits the target's greedy tokens whatever the drafts are, so this checks
    # the wiring (the worker binds the draft to --attention-backend and its step runs with the
    # pools + slots signature); the numerics are checked above.
    want = _dspark_greedy("torch")
    assert all(len(ids) == 6 for ids in want)
    assert _dspark_greedy("triton") == want
