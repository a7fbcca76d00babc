"""The "triton" attention backend against the "torch" one (its spec): on hand-built ForwardBatches
over a paged ReqToTokenPool, end to end in the tiny model (greedy tokens of prefill, verify
and decode steps), and in tiny-v41, whose layers attend keys they gathered (`attend_gathered`).

Not bit-exact: the kernel's online softmax (and split-K merge for small batches) sums in another
order than the torch backend's one-shot softmax; fp32 agrees to ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.layers.attention import ATTENTION_BACKENDS, create_attention_backend
from sgl_dspark.srt.mem_cache.allocator import PagedTokenAllocator, ReqToTokenPool
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.tiny import tiny_config, tiny_weights
from sgl_dspark.srt.models.tiny_v41 import tiny_v41_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], gen: torch.Generator
) -> ForwardBatch:
    """Requests in shuffled request slots, their pages taken from a shuffled free list."""
    allocator = PagedTokenAllocator(num_pages=64, page_size=4)
    pages = allocator.alloc(allocator.num_free_pages)
    allocator.free([pages[i] for i in torch.randperm(len(pages), generator=gen)])  # scattered
    pool = ReqToTokenPool(max_reqs=8, max_context_len=128, allocator=allocator, device=DEVICE)
    slots = [pool.alloc_slot() for _ in range(len(prefix_lens) + 2)][2:]  # not slots 1..n
    for slot, p, n in zip(slots, prefix_lens, extend_lens):
        pool.reserve(slot, p + n)
    ids = [[3] * n for n in extend_lens]
    return ForwardBatch.build(mode, ids, prefix_lens, slots, pool.req_to_token, "all")


BATCHES = [
    # (mode, prefix_lens, extend_lens, window, extra keys per token or None, head_dim)
    (ForwardMode.DECODE, [7, 0, 40], [1, 1, 1], 16, None, 64),
    (ForwardMode.VERIFY, [20, 3], [4, 3], 32, 9, 64),
    (ForwardMode.EXTEND, [0, 12], [13, 6], 8, 0, 64),
    # Dh 256 uses 32-key tiles: 2 window + 2 extra tiles, so the one token takes the split path.
    (ForwardMode.DECODE, [90], [1], 64, 37, 256),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(len(BATCHES)))
def test_matches_torch_backend(index: int, dtype: torch.dtype) -> None:
    mode, prefix, extend, window, num_extra, head_dim = BATCHES[index]
    gen = torch.Generator().manual_seed(50 + index)
    batch = _batch(mode, prefix, extend, gen)
    tokens, heads = batch.num_tokens, 5
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * 2).to(dtype).to(DEVICE)
    window_kv = torch.randn(64 * 4, head_dim, generator=gen).to(dtype).to(DEVICE)
    sinks = (torch.randn(heads, generator=gen) * 3).to(DEVICE)
    extra_kv = extra_valid = extra_slots = None
    if num_extra is not None:
        # The indexer's selection (CSA layers): pool rows per token, read where valid.
        extra_kv = torch.randn(3 * tokens * num_extra + 1, head_dim, generator=gen)
        extra_kv = extra_kv.to(dtype).to(DEVICE)
        extra_slots = torch.randint(0, extra_kv.shape[0], (tokens, num_extra), generator=gen)
        extra_slots = extra_slots.to(DEVICE)
        extra_valid = (torch.rand(tokens, num_extra, generator=gen) < 0.5).to(DEVICE)
        extra_valid[0] = False  # a token that sees no compressed entry
    args = (q, window_kv, batch, sinks, window, head_dim**-0.5, extra_kv, extra_valid)
    want = create_attention_backend("torch").forward(*args, extra_slots=extra_slots)
    got = create_attention_backend("triton").forward(*args, extra_slots=extra_slots)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # reordered fp32 sums
    else:
        # The torch backend rounds logits and probabilities to bf16, the kernel keeps them in
        # fp32 (and the interpreter truncates the bf16 output): ~0.03 absolute at these scales.
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    "mode, prefix, extend, ratio",
    [
        (ForwardMode.DECODE, [7, 0, 40], [1, 1, 1], 4),
        (ForwardMode.VERIFY, [20, 3], [4, 3], 8),
        (ForwardMode.EXTEND, [0, 12], [13, 6], 4),
    ],
)
def test_dense_entries_match_torch_backend(
    mode: ForwardMode, prefix: list[int], extend: list[int], ratio: int
) -> None:
    """extra_entries (HCA): every complete entry of the request, read in place from the entry
    pool; the triton backend derives rows and visibility inside the kernel, the torch backend
    builds them (`entry_slots`, visible counts)."""
    gen = torch.Generator().manual_seed(ratio + len(prefix))
    batch = _batch(mode, prefix, extend, gen)
    tokens, heads, head_dim = batch.num_tokens, 3, 64
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * 2).to(DEVICE)
    window_kv = torch.randn(64 * 4, head_dim, generator=gen).to(DEVICE)
    entries = torch.randn(64 * 4 // ratio, head_dim, generator=gen).to(DEVICE)
    sinks = (torch.randn(heads, generator=gen) * 3).to(DEVICE)
    args = (q, window_kv, batch, sinks, 8, head_dim**-0.5, entries, None, None)
    num_entries = batch.max_seq_len // ratio
    want = create_attention_backend("torch").forward(*args, extra_entries=(num_entries, ratio))
    got = create_attention_backend("triton").forward(*args, extra_entries=(num_entries, ratio))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    without = create_attention_backend("torch").forward(
        q, window_kv, batch, sinks, 8, head_dim**-0.5, None, None
    )
    assert not torch.allclose(want, without)  # some token sees an entry


def test_registered_under_triton() -> None:
    assert "triton" in ATTENTION_BACKENDS
    assert type(create_attention_backend("triton")).__name__ == "TritonAttentionBackend"


def _runner(backend: str, weights: list[tuple[str, torch.Tensor]]) -> ModelRunner:
    cfg = tiny_config()
    rc = RunnerConfig(
        device=DEVICE,
        max_total_tokens=2048,
        max_running_requests=4,
        context_length=128,
        attention_backend=backend,
    )
    return ModelRunner(cfg, rc, weights=weights)


def _greedy(
    runner: ModelRunner, prompts: list[list[int]], verify: list[list[int]], decode_steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill, one verify step (committed), then greedy decode; returns tokens and logits."""
    pool = runner.req_pool
    slots = [pool.alloc_slot() for _ in prompts]
    lens = [0] * len(prompts)
    logits: list[torch.Tensor] = []

    def step(mode: ForwardMode, work: list[list[int]]) -> torch.Tensor:
        for i, ids in enumerate(work):
            pool.reserve(slots[i], lens[i] + len(ids))
        batch = ForwardBatch.build(mode, work, list(lens), slots, pool.req_to_token, "last")
        for i, ids in enumerate(work):
            lens[i] += len(ids)
        out = runner.forward(batch).logits
        logits.append(out)
        return out

    step(ForwardMode.EXTEND, prompts)
    nxt = step(ForwardMode.VERIFY, verify).argmax(-1).tolist()
    tokens = [[t] for t in nxt]
    for _ in range(decode_steps):
        nxt = step(ForwardMode.DECODE, [[t] for t in nxt]).argmax(-1).tolist()
        for seq, t in zip(tokens, nxt):
            seq.append(t)
    return tokens, logits


def test_tiny_model_greedy_equal() -> None:
    # Prompts cross the CSA (4) and HCA (16) compress blocks and the 32-token sliding window.
    cfg = tiny_config()
    shapes = [(k, tuple(v.shape)) for k, v in DeepseekV4ForCausalLM(cfg).state_dict().items()]
    weights = tiny_weights(cfg, shapes, seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 19, 41)]
    verify = [torch.randint(3, 512, (w,), generator=gen).tolist() for w in (3, 1, 4)]
    want_tokens, want_logits = _greedy(_runner("torch", weights), prompts, verify, 6)
    got_tokens, got_logits = _greedy(_runner("triton", weights), prompts, verify, 6)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32, reordered sums


def _v41_logits(attention_backend: str, record=None) -> list[torch.Tensor]:
    """tiny-v41 (every layer attends gathered keys): a prefill of two requests, one past the
    32-token window, then a decode step of both; the logits of each forward. `record` wraps the
    triton backend's kernel."""
    engine = Engine(
        model_path="tiny-v41",
        device=DEVICE,
        dtype="float32",
        skip_tokenizer_init=True,
        context_length=128,
        max_running_requests=2,
        attention_backend=attention_backend,
    )
    try:
        runner = engine.runner
        backend = runner.attn_backend
        if record is not None:
            backend._attention = record(backend._attention)
        pool = runner.req_pool
        slots = [pool.alloc_slot() for _ in range(2)]
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (41, 9)]
        steps = [(prompts, [0, 0]), ([[17], [42]], [41, 9])]
        logits = []
        for ids, prefix in steps:
            for slot, p, work in zip(slots, prefix, ids):
                pool.reserve(slot, p + len(work))
            mode = ForwardMode.EXTEND if prefix == [0, 0] else ForwardMode.DECODE
            batch = ForwardBatch.build(mode, ids, prefix, slots, pool.req_to_token, "last")
            logits.append(runner.forward(batch).logits)
        return logits
    finally:
        engine.shutdown()


def test_gathered_attention_builds_its_indices_once_per_forward() -> None:
    """Every layer of one forward gets the same row-index and placeholder tensors (one row
    index per key width: window-only layers gather fewer keys than compressed ones); the next
    forward builds its own. The logits stay those of the torch backend."""
    calls: list[dict[str, torch.Tensor]] = []

    def record(kernel):
        def wrapped(q, pool, positions, token_slot, req_to_token, *args, extra_slots, **kw):
            calls.append(
                dict(positions=positions, slots=token_slot, table=req_to_token, rows=extra_slots)
            )
            return kernel(
                q, pool, positions, token_slot, req_to_token, *args, **kw, extra_slots=extra_slots
            )

        return wrapped

    got = _v41_logits("triton", record)
    layers = tiny_v41_config().num_hidden_layers
    assert len(calls) == 2 * layers
    forwards = [calls[:layers], calls[layers:]]
    for tokens, forward in zip((50, 2), forwards):
        first = forward[0]
        for call in forward:
            for name in ("positions", "slots", "table"):
                assert call[name] is first[name], name
            rows = call["rows"]
            width = rows.shape[1]
            assert rows.shape[0] == tokens
            assert rows.flatten().tolist() == list(range(tokens * width))
            same_width = [c["rows"] for c in forward if c["rows"].shape[1] == width]
            assert all(r is rows for r in same_width)
        widths = {c["rows"].shape[1] for c in forward}
        assert len(widths) > 1  # window-only and compressed layers both covered
        assert len({id(c["rows"]) for c in forward}) == len(widths)
    prefill_objects = {id(c[n]) for c in forwards[0] for n in ("positions", "rows")}
    assert prefill_objects.isdisjoint(id(c[n]) for c in forwards[1] for n in ("positions", "rows"))
    want = _v41_logits("torch")
    # fp32 with reordered sums. On the CPU both backends feed the model's quantisers the same
    # values; compiled kernels sum attention in another order, so a value next to an FP8 window
    # or FP4 index rounding border can round one step the other way in a later layer, which moves
    # a whole row by up to a few 1e-3 (on the H200: one of the two rows, 3e-3; on the CPU a
    # relative nudge of 1e-5 to the attention outputs moves a row by 0.2, one of 1e-6 by 2e-5).
    tol = 1e-4 if DEVICE == "cpu" else 1e-2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
