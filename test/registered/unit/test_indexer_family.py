"""The "indexer" kernel family wired into the model: what each choice binds, the runtime torch
math against the kernels' references (the scoring's torch path is `indexer_logits_ref` itself),
and the tiny model end to end (`indexer=triton` gives torch's greedy tokens over decode
steps that cross many CSA (m=4) and several HCA (m=16) block boundaries).

The Triton pieces are within a tolerance of torch (fp32 sums in another order, see
test_indexer_logits.py and test_compressor_pool.py), so the end-to-end check compares greedy tokens plus
a loose logit bound.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from sgl_dspark.kernels.compressor.decode import compressor_decode
from sgl_dspark.kernels.compressor.reference import compressor_pool_ref
from sgl_dspark.kernels.indexer.logits import indexer_logits
from sgl_dspark.kernels.indexer.reference import indexer_logits_ref
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.attention.compressor import (
    BlockCompressor,
    decode_step_impl,
    indexer_scores_impl,
)
from sgl_dspark.srt.layers.rotary import apply_rope_tail, rope_cos_sin
from sgl_dspark.srt.mem_cache.allocator import PagedTokenAllocator, ReqToTokenPool
from sgl_dspark.srt.mem_cache.kv_pool import CompressorState
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.tiny import tiny_config, tiny_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
TORCH, TRITON = KernelChoice("torch"), KernelChoice("torch", (("indexer", "triton"),))
_POOL_MODULE = importlib.import_module("sgl_dspark.kernels.compressor.pool")


def _force_split(monkeypatch: pytest.MonkeyPatch, split: bool) -> None:
    """With `split`, the pooling kernel splits every row's channels over 16-wide programs (the
    last arrival norms the row), so these small shapes take the path of wide HCA rows."""
    if not split:
        return
    default = _POOL_MODULE._pool_meta
    monkeypatch.setattr(
        _POOL_MODULE, "_pool_meta", lambda d, s: {**default(d, s), "BLOCK_C": 16, "SPAN_BLOCK": 16}
    )


def test_choice_binds_implementations() -> None:
    assert indexer_scores_impl(TORCH) is indexer_logits_ref
    assert decode_step_impl(TORCH) is None
    assert indexer_scores_impl(TRITON) is indexer_logits
    assert decode_step_impl(TRITON) is compressor_decode
    assert KernelChoice("triton").of("indexer") == "triton"
    with pytest.raises(ValueError, match="indexer='cuda'"):
        KernelChoice.parse("torch", "indexer=cuda")


def _batch(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], gen: torch.Generator
) -> ForwardBatch:
    """Requests in shuffled request slots over scattered pages of a ReqToTokenPool."""
    allocator = PagedTokenAllocator(num_pages=96, page_size=16)
    pages = allocator.alloc(allocator.num_free_pages)
    allocator.free([pages[i] for i in torch.randperm(len(pages), generator=gen)])
    pool = ReqToTokenPool(max_reqs=8, max_context_len=256, allocator=allocator, device=DEVICE)
    slots = [pool.alloc_slot() for _ in range(len(prefix_lens) + 2)][2:]
    for slot, p, n in zip(slots, prefix_lens, extend_lens):
        pool.reserve(slot, p + n)
    ids = [[3] * n for n in extend_lens]
    return ForwardBatch.build(mode, ids, prefix_lens, slots, pool.req_to_token, "all")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_scores_mask_and_weight_scale(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    batch = _batch(ForwardMode.VERIFY, [2, 61, 130], [3, 4, 2], gen)
    tokens, n_max = batch.num_tokens, batch.max_seq_len // 4
    qi = torch.randn(tokens, 6, 32, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(tokens, 6, generator=gen).to(dtype).to(DEVICE)  # the projection's dtype
    keys = torch.randn(96 * 16 // 4, 32, generator=gen).to(dtype).to(DEVICE)
    slot = batch.req_pool_indices[batch.token_req]
    args = (qi, w, keys, batch.positions, slot, batch.req_to_token, 4, n_max)
    want = indexer_logits_ref(*args, weight_scale=6**-0.5)
    assert torch.isneginf(want).any() and torch.isfinite(want).any()
    # -inf exactly at the entries a token cannot see yet (n >= (position + 1) // 4).
    visible = (batch.positions + 1) // 4
    beyond = torch.arange(n_max, device=DEVICE)[None, :] >= visible[:, None]
    assert torch.equal(torch.isneginf(want), beyond)
    # The scale applies to the fp32 weights, as the layer's scaled copy did.
    scaled = (w.float() * 6**-0.5, *args[2:])
    assert torch.equal(indexer_logits_ref(qi, *scaled), want)


def _compress(
    comp: BlockCompressor,
    batch: ForwardBatch,
    state: CompressorState,
    entries: torch.Tensor,
    x: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    class Rope:
        def compress_table(
            self, positions: torch.Tensor, cache_key: object = None, shift: int = 0
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return rope_cos_sin(positions - shift, inv_freq)

        def rotate_compress(
            self, v: torch.Tensor, positions: torch.Tensor, cache_key: object = None
        ) -> torch.Tensor:
            return apply_rope_tail(v, *self.compress_table(positions))

    rope = Rope()
    comp.compress(comp.kv_proj(x), comp.gate_proj(x), batch, state, entries, rope)


def _both_choices(
    batch: ForwardBatch,
    state0: CompressorState,
    x: torch.Tensor,
    hidden: int,
    head_dim: int,
    ratio: int,
    overlap: bool,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, tuple[torch.Tensor, CompressorState, BlockCompressor]]:
    """One compressor with the same parameters per "indexer" choice, run on `batch` from copies
    of `state0` into NaN entry pools: name -> (entries, state, compressor)."""
    inv_freq = 1.0 / 1000 ** (torch.arange(0, 16, 2) / 16)
    results = {}
    for name, kernels in (("torch", TORCH), ("triton", TRITON)):
        comp = BlockCompressor(hidden, head_dim, ratio, overlap, 1e-6, kernels=kernels)
        init = torch.Generator().manual_seed(seed)  # the same parameters for both choices
        for p in comp.parameters():
            p.data = torch.randn(p.shape, generator=init) * (0.2 if p.dim() == 2 else 1.0)
        comp = comp.to(dtype).to(DEVICE)
        comp.position_bias.data = comp.position_bias.data.float()  # fp32, as the runner keeps it
        comp.kv_norm.weight.data = comp.kv_norm.weight.data.float()
        entries = torch.full((96 * 16 // ratio, head_dim), float("nan"), dtype=dtype, device=DEVICE)
        counters = torch.zeros(entries.shape[0], dtype=torch.int32, device=DEVICE)
        state = CompressorState(
            state0.kv.clone().to(DEVICE), state0.score.clone().to(DEVICE), counters
        )
        _compress(comp, batch, state, entries, x.to(DEVICE), inv_freq)
        assert (counters == 0).all()  # the kernel leaves its arrival counters as it found them
        results[name] = (entries, state, comp)
    return results


@pytest.mark.parametrize(
    "overlap, ratio, split",
    [(True, 4, False), (False, 16, False), (True, 4, True), (False, 16, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_decode_branch(
    overlap: bool, ratio: int, split: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch decode branch equals `compressor_pool_ref` (+ rope) bit for bit on the rows
    that end a block; the Triton binding writes the same entries within tolerance and leaves
    the same ring (also with each row's channels split over programs)."""
    _force_split(monkeypatch, split)
    gen = torch.Generator().manual_seed(11 + ratio)
    hidden, head_dim = 48, 32
    batch = _batch(ForwardMode.VERIFY, [13, 46, 2, 27], [3, 2, 2, 5], gen)
    width = 2 * head_dim if overlap else head_dim
    ring, req_slots = 32, batch.req_to_token.shape[0]
    state0 = CompressorState(
        kv=torch.randn(req_slots, ring, width, generator=gen).to(dtype),
        score=torch.randn(req_slots, ring, width, generator=gen).to(dtype),
    )
    x = torch.randn(batch.num_tokens, hidden, generator=gen).to(dtype)
    inv_freq = 1.0 / 1000 ** (torch.arange(0, 16, 2) / 16)
    results = _both_choices(batch, state0, x, hidden, head_dim, ratio, overlap, dtype, seed=5)
    entries, state, comp = results["torch"]
    slot_tok = batch.req_pool_indices[batch.token_req]
    ref = compressor_pool_ref(
        comp.kv_proj(x.to(DEVICE)),
        comp.gate_proj(x.to(DEVICE)),
        state0.kv.to(DEVICE),
        state0.score.to(DEVICE),
        comp.position_bias,
        comp.kv_norm.weight,
        batch.positions,
        slot_tok,
        batch.prefix_lens[batch.token_req],
        batch.req_to_token,
        ratio,
        overlap,
        1e-6,
    )
    ends = (batch.positions + 1) % ratio == 0
    assert ends.sum() >= 2
    start = batch.positions - (ratio - 1)
    want = apply_rope_tail(ref.entries, *rope_cos_sin(start, inv_freq))[ends]
    assert torch.equal(entries[ref.slots[ends]], want)
    got_entries, got_state, _ = results["triton"]
    written = ref.slots[ends]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(got_entries[written].float(), want.float(), **tol)
    untouched = torch.ones(entries.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[0] = False
    untouched[written] = False
    assert torch.isnan(got_entries[untouched]).all()  # no other entry was written
    assert torch.equal(got_state.kv, state.kv) and torch.equal(got_state.score, state.score)


@pytest.mark.parametrize(
    "overlap, ratio, split",
    [(True, 4, False), (False, 16, False), (True, 4, True), (False, 16, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_extend_branch(
    overlap: bool, ratio: int, split: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks longer than the ring, some after a prefix whose ring rows they read: the
    torch branch (block-end and ring rows listed from host lengths, no device read) equals
    `compressor_pool_ref` (+ rope) bit for bit on the block ends and leaves exactly the last R
    rows of each request in the ring; the Triton binding (`compressor_extend`) writes the same
    entries within tolerance and the same ring (also with each row's channels split)."""
    _force_split(monkeypatch, split)
    gen = torch.Generator().manual_seed(21 + ratio)
    hidden, head_dim, ring = 48, 32, 32
    batch = _batch(ForwardMode.EXTEND, [0, 21, 40, 3], [37, 50, 19, 2], gen)
    width = 2 * head_dim if overlap else head_dim
    req_slots = batch.req_to_token.shape[0]
    state0 = CompressorState(
        kv=torch.randn(req_slots, ring, width, generator=gen).to(dtype),
        score=torch.randn(req_slots, ring, width, generator=gen).to(dtype),
    )
    x = torch.randn(batch.num_tokens, hidden, generator=gen).to(dtype)
    inv_freq = 1.0 / 1000 ** (torch.arange(0, 16, 2) / 16)
    results = _both_choices(batch, state0, x, hidden, head_dim, ratio, overlap, dtype, seed=6)
    entries, state, comp = results["torch"]
    assert comp._extend_step is None and results["triton"][2]._extend_step is not None
    slot_tok = batch.req_pool_indices[batch.token_req]
    kv, score = comp.kv_proj(x.to(DEVICE)), comp.gate_proj(x.to(DEVICE))
    ref = compressor_pool_ref(
        kv,
        score,
        state0.kv.to(DEVICE),
        state0.score.to(DEVICE),
        comp.position_bias,
        comp.kv_norm.weight,
        batch.positions,
        slot_tok,
        batch.prefix_lens[batch.token_req],
        batch.req_to_token,
        ratio,
        overlap,
        1e-6,
    )
    ends = (batch.positions + 1) % ratio == 0
    assert ends.sum() >= 3
    start = batch.positions - (ratio - 1)
    want = apply_rope_tail(ref.entries, *rope_cos_sin(start, inv_freq))[ends]
    assert torch.equal(entries[ref.slots[ends]], want)
    want_ring = [state0.kv.clone().to(DEVICE), state0.score.clone().to(DEVICE)]
    kept = batch.positions >= batch.seq_lens[batch.token_req] - ring
    assert (~kept).any()  # some chunk is longer than the ring
    for t, rows in zip(want_ring, (kv, score)):
        t[slot_tok[kept], batch.positions[kept] % ring] = rows[kept].to(dtype)
    assert torch.equal(state.kv, want_ring[0]) and torch.equal(state.score, want_ring[1])
    got_entries, got_state, _ = results["triton"]
    written = ref.slots[ends]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(got_entries[written].float(), want.float(), **tol)
    untouched = torch.ones(entries.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.isnan(got_entries[untouched]).all()  # no other entry was written
    assert torch.equal(got_state.kv, state.kv) and torch.equal(got_state.score, state.score)


def _runner(overrides: str | None, weights: list[tuple[str, torch.Tensor]]) -> ModelRunner:
    rc = RunnerConfig(
        device=DEVICE,
        max_total_tokens=2048,
        max_running_requests=4,
        context_length=128,
        kernel_backend_overrides=overrides,
    )
    return ModelRunner(tiny_config(), rc, weights=weights)


def _greedy(
    runner: ModelRunner, prompts: list[list[int]], verify: list[list[int]], steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill, one committed verify forward, then `steps` greedy decode steps."""
    pool = runner.req_pool
    slots = [pool.alloc_slot() for _ in prompts]
    lens = [0] * len(prompts)
    logits: list[torch.Tensor] = []

    def step(mode: ForwardMode, work: list[list[int]]) -> list[int]:
        for i, ids in enumerate(work):
            pool.reserve(slots[i], lens[i] + len(ids))
        batch = ForwardBatch.build(mode, work, list(lens), slots, pool.req_to_token, "all")
        for i, ids in enumerate(work):
            lens[i] += len(ids)
        out = runner.forward(batch).logits
        logits.append(out)
        ends = torch.tensor([len(ids) for ids in work]).cumsum(0) - 1
        return out[ends.to(out.device)].argmax(-1).tolist()

    step(ForwardMode.EXTEND, prompts)
    nxt = step(ForwardMode.VERIFY, verify)
    tokens = [[t] for t in nxt]
    for _ in range(steps):
        nxt = step(ForwardMode.DECODE, [[t] for t in nxt])
        for seq, t in zip(tokens, nxt):
            seq.append(t)
    return tokens, logits


def test_tiny_model_greedy_tokens_match_torch() -> None:
    cfg = tiny_config()
    shapes = [(k, tuple(v.shape)) for k, v in DeepseekV4ForCausalLM(cfg).state_dict().items()]
    weights = tiny_weights(cfg, shapes, seed=0)
    gen = torch.Generator().manual_seed(2)
    # After the verify forward the requests decode positions 8..47, 16..55 and 34..73: about 10
    # CSA blocks each and 2-3 HCA boundaries (multiples of 16) each.
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 15, 30)]
    verify = [torch.randint(3, 512, (w,), generator=gen).tolist() for w in (3, 1, 4)]
    runner = _runner("indexer=triton", weights)
    comp = runner.model.model.layers[1].self_attn.compressor
    assert comp is not None and comp._decode_step is compressor_decode
    assert comp.indexer._scores is indexer_logits
    want_tokens, want_logits = _greedy(_runner(None, weights), prompts, verify, 40)
    got_tokens, got_logits = _greedy(runner, prompts, verify, 40)
    assert got_tokens == want_tokens
    assert len(set(t for seq in want_tokens for t in seq)) > 5  # not a degenerate repetition
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32, reordered sums


def test_every_pooling_shape_binds_the_kernel() -> None:
    # Wide rows (HCA m 128 at Dh 512) split their channels over programs instead of keeping
    # the torch pooling, as they did while one program pooled a whole row.
    for ratio, head_dim, overlap in ((4, 512, True), (128, 128, False), (128, 512, False)):
        comp = BlockCompressor(64, head_dim, ratio, overlap, 1e-6, kernels=TRITON)
        assert comp._decode_step is not None and comp._extend_step is not None
    assert not BlockCompressor(64, 32, 4, True, 1e-6, kernels=TORCH)._decode_step


def test_index_topk_choice_selects_the_torch_set():
    """The triton choice binds the one-launch select; on untied scores it picks the same entries
    as the torch path (in ascending order rather than by score) and both return their pool
    rows through the request's table, invalid picks row 0."""
    from sgl_dspark.kernels.indexer.topk import index_topk
    from sgl_dspark.srt.layers.attention.compressor import index_topk_impl

    assert index_topk_impl(TRITON) is index_topk
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(5, 40, generator=gen)
    visible = torch.tensor([0, 3, 17, 40, 25])
    scores[torch.arange(40)[None, :] >= visible[:, None]] = float("-inf")
    ratio = 4
    # Shuffled pages: an entry's pool row is not its id.
    table = (torch.randperm(3 * 160, generator=gen)[: 3 * 160].view(3, 160) // ratio) * ratio
    token_slot = torch.tensor([2, 0, 1, 1, 2])
    entry_rows = (table.to(DEVICE), token_slot.to(DEVICE), ratio)
    want_ids, want_valid = index_topk_impl(TORCH)(
        scores.to(DEVICE), visible.to(DEVICE), 8, entry_rows=entry_rows
    )
    got_ids, got_valid = index_topk_impl(TRITON)(
        scores.to(DEVICE), visible.to(DEVICE), 8, entry_rows=entry_rows
    )
    assert torch.equal(got_valid.sum(1), want_valid.sum(1))
    top = scores.topk(8, dim=-1).indices
    for r in range(5):
        assert sorted(got_ids[r][got_valid[r]].tolist()) == sorted(
            want_ids[r][want_valid[r]].tolist()
        )
        picked = top[r][top[r] < visible[r]]
        assert sorted(want_ids[r][want_valid[r]].tolist()) == sorted(
            (table[token_slot[r], picked * ratio] // ratio).tolist()
        )
        assert (got_ids[r][~got_valid[r]] == 0).all()
