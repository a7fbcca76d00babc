"""Prefill graphs (`PrefillGraphs`): EXTEND forwards replayed per token-count bucket give the
eager forward's logits, KV state and greedy tokens. On CPU the graphs are `EagerGraph` stand-ins
with CUDA-graph buffer semantics, which checks the static buffers, the padding rows and requests
(dummy slot 0) and the device-built compressor row lists; on a GPU the engine captures real
prefill graphs by default (test_cuda_graph_runner.py's CUDA tests run through them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.model_executor.cuda_graph_runner import CudaGraphRunner, EagerGraph
from sgl_dspark.srt.model_executor.model_runner import TapConsumer
from sgl_dspark.srt.model_executor.prefill_graphs import PrefillGraphs, prefill_token_buckets
from sgl_dspark.srt.models.deepseek_v4 import stream_means
from spec_utils import greedy_requests

N_PROMPTS = 6
POISON = -777.0


class CountingGraph(EagerGraph):
    replays = 0

    def replay(self) -> None:
        CountingGraph.replays += 1
        super().replay()


def test_prefill_token_buckets():
    assert prefill_token_buckets(1) == [1]
    assert prefill_token_buckets(16) == [16]
    assert prefill_token_buckets(100) == [16, 32, 64, 100]
    assert prefill_token_buckets(512)[-2:] == [256, 512]
    with pytest.raises(ValueError, match="token limit"):
        prefill_token_buckets(0)


def _padded(batch: ForwardBatch, tokens: int, requests: int) -> ForwardBatch:
    """`batch` laid out as a prefill graph's: padding rows of a padding request (slot 0,
    position 0), padding requests with slot 0, host lengths unknown."""
    b = batch.batch_size
    dev = batch.positions.device

    def pad(x: torch.Tensor, size: int, value: int) -> torch.Tensor:
        return torch.cat([x, torch.full((size - x.shape[0],), value, dtype=x.dtype, device=dev)])

    return dataclasses.replace(
        batch,
        input_ids=pad(batch.input_ids, tokens, 0),
        positions=pad(batch.positions, tokens, 0),
        token_req=pad(batch.token_req, tokens, b),
        out_cache_loc=pad(batch.out_cache_loc, tokens, 0),
        req_pool_indices=pad(batch.req_pool_indices, requests, 0),
        prefix_lens=pad(batch.prefix_lens, requests, 0),
        seq_lens=pad(batch.seq_lens, requests, 0),
        extend_lens_cpu=(),
        prefix_lens_cpu=(),
        host_lens=False,
    )


@pytest.mark.parametrize("seed", range(6))
def test_device_row_lists_equal_host_lists(seed):
    """The device-built lists hold the host-built rows in order, then -1 up to their static
    size, which bounds every batch that fits the padded shape."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 5, (1,), generator=g))
    extends = torch.randint(1, 40, (b,), generator=g).tolist()
    prefixes = torch.randint(0, 50, (b,), generator=g).tolist()
    table = torch.zeros(b + 1, 128, dtype=torch.int64)
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, [[1] * n for n in extends], prefixes, list(range(1, b + 1)), table
    )
    pad_tokens = sum(extends) + int(torch.randint(0, 20, (1,), generator=g))
    padded = _padded(batch, pad_tokens, b + 1 + int(torch.randint(0, 3, (1,), generator=g)))
    for ratio in (1, 3, 4, 128):
        want, got = batch.block_end_rows(ratio), padded.block_end_rows(ratio)
        assert torch.equal(got[: want.numel()], want)
        assert bool((got[want.numel() :] == -1).all())
    for count in (1, 6, 16, 64):
        want, got = batch.last_rows(count), padded.last_rows(count)
        assert torch.equal(got[: want.numel()], want)
        assert bool((got[want.numel() :] == -1).all())


def _poisoned_engine(**kw) -> Engine:
    kw.setdefault("device", "cpu")
    engine = Engine(
        model_path="tiny",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=8,
        **kw,
    )
    for t in _pool_tensors(engine):
        # Never test on zeros: unwritten state keeps this value. Finite, as the pools' contents
        # always are (zeros, then stale rows): the torch attention multiplies masked rows by 0.
        t.fill_(POISON)
    return engine


def _pool_tensors(engine: Engine) -> list[torch.Tensor]:
    out = []
    for layer in engine.runner.kv_pool.layers:
        out += [layer.window, layer.compressed, layer.index_keys]
        for state in (layer.comp_state, layer.index_state):
            if state is not None:
                out += [state.kv, state.score]
    return [t for t in out if t is not None and t.is_floating_point()]


# The Triton kernels run here only compiled: under the CPU interpreter one forward of the tiny
# model over 64 rows takes ~70 s. Their row-list handling has its own kernel test
# (test_compressor_extend.py).
ON_GPU = torch.cuda.is_available()
BACKENDS = [{"kernel_backend": "torch", "attention_backend": "torch"}] + (
    [
        {
            "device": "cuda",
            "dtype": "float32",
            "kernel_backend": "triton",
            "attention_backend": "triton",
        }
    ]
    if ON_GPU
    else []
)


@pytest.mark.parametrize("kw", BACKENDS, ids=lambda kw: kw["kernel_backend"])
def test_prefill_replay_equals_eager_forward(kw):
    """Two engines with the same weights run the same ragged prefill chunks (fresh prompts and
    later chunks after a prefix, more rows than the compressor rings): one eagerly, one from the
    prefill graphs. Logits, taps and every real row of the KV state agree; rows only padding
    writes (slot 0) are excluded."""
    eager, graphed = _poisoned_engine(**kw), _poisoned_engine(**kw)
    factory = None if ON_GPU and kw.get("device") == "cuda" else CountingGraph
    taps: dict[str, torch.Tensor] = {}

    def tap_recorder(name: str, engine: Engine) -> TapConsumer:
        # The tap streams of layer 3 as the consumer sees them, inside the graph or eagerly.
        runner = engine.runner
        hc, dim = runner.model_cfg.hc_mult, runner.model_cfg.hidden_size
        buf = taps[name] = torch.full((128, hc, dim), POISON, device=runner.device)

        def record(batch: ForwardBatch, streams: dict[int, torch.Tensor]) -> None:
            buf[: streams[3].shape[0]].copy_(streams[3])

        return TapConsumer((1, 3), record)

    eager_consumer = tap_recorder("eager", eager)
    runner_graphs = CudaGraphRunner(graphed.runner.device, graph_factory=factory)
    prefill = PrefillGraphs(runner_graphs, graphed.runner, 128, 4, tap_recorder("graphed", graphed))
    runner_graphs.capture()
    g = torch.Generator().manual_seed(11)
    chunks = [[37, 5, 60], [20, 11]]  # chunk 2 continues the first two requests of chunk 1
    ids = [[torch.randint(3, 200, (n,), generator=g).tolist() for n in c] for c in chunks]
    outs: dict[str, list[torch.Tensor]] = {"eager": [], "graphed": []}
    CountingGraph.replays = 0
    for name, engine in (("eager", eager), ("graphed", graphed)):
        pool = engine.runner.req_pool
        slots = [pool.alloc_slot() for _ in chunks[0]]
        prefix = [0] * len(slots)
        for chunk, chunk_ids in zip(chunks, ids):
            reqs = slots[: len(chunk)]
            for s, p, n in zip(reqs, prefix, chunk):
                pool.reserve(s, p + n)
            batch = ForwardBatch.build(
                ForwardMode.EXTEND, chunk_ids, prefix[: len(chunk)], reqs, pool.req_to_token
            )
            if name == "eager":
                out = engine.runner.forward(batch, consumer=eager_consumer)
            else:
                assert prefill.can_run(batch, ())
                out = prefill.replay(batch)
            n = batch.num_tokens
            outs[name] += [out.logits.clone(), stream_means(taps[name][:n]).clone()]
            prefix = [p + n for p, n in zip(prefix, chunk)] + prefix[len(chunk) :]
    assert prefill.replays == 2
    assert CountingGraph.replays == (0 if factory is None else 2)
    # fp32; the GEMMs of T padded rows may sum in another order than those of the real rows
    tol = {"rtol": 1e-4, "atol": 1e-4}
    for a, b in zip(outs["eager"], outs["graphed"]):
        torch.testing.assert_close(b, a, **tol)
    for a, b in zip(_pool_tensors(eager), _pool_tensors(graphed)):
        assert bool((a[1:] != POISON).any())  # the prefill wrote real rows
        torch.testing.assert_close(b[1:], a[1:], **tol)


def _requests():
    return greedy_requests(N_PROMPTS, 5, 45, 4, 3)


def _generate(prefill_tokens: int | None, **kw) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=256,
        max_running_requests=N_PROMPTS,
        chunked_prefill_size=16,
        **kw,
    )
    if prefill_tokens is not None:
        engine.init_graphs(N_PROMPTS, prefill_tokens, graph_factory=CountingGraph)
    engine._eager_extends = 0

    def count_eager_extend(module, args):  # an EXTEND forward that reaches the model eagerly
        if args[0].mode is ForwardMode.EXTEND and args[0].host_lens:
            engine._eager_extends += 1

    engine.runner.model.register_forward_pre_hook(count_eager_extend)
    prompts, params = _requests()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs], engine


@pytest.fixture(scope="module")
def reference():
    return _generate(None)[0]


@pytest.mark.parametrize("spec", [None, 3])
def test_prefill_graphs_equal_eager_greedy(reference, spec):
    """Chunked prefill (16 prompt tokens a step) of 6 prompts into graphs of up to 16 tokens.
    Without DSpark, prompt chunks mix with decode rows of running requests, so most prefill
    steps have more rows and run eagerly; with DSpark, prefill steps hold prompt rows only, so
    every one replays, and the draft's context KV of prompt rows is written inside the graph."""
    kw = (
        {}
        if spec is None
        else {"speculative_algorithm": "DSpark", "speculative_dspark_block_size": spec}
    )
    got, engine = _generate(16, **kw)
    assert got == reference
    executor = engine.spec.decode if engine.spec is not None else engine.executor
    graphs = executor.prefill_graphs
    assert graphs is not None and graphs.buckets == [16] and graphs.replays > 0
    assert (engine._eager_extends > 0) == (spec is None)


def test_prefill_graph_request_limit():
    engine = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=64,
        max_running_requests=4,
    )
    runner_graphs = CudaGraphRunner(engine.runner.device, graph_factory=EagerGraph)
    with pytest.raises(ValueError, match="max-running-requests"):
        PrefillGraphs(runner_graphs, engine.runner, 32, 5, None)
    graphs = PrefillGraphs(runner_graphs, engine.runner, 32, 2, None)
    pool = engine.runner.req_pool
    slots = [pool.alloc_slot() for _ in range(3)]
    for s in slots:
        pool.reserve(s, 40)

    def batch(mode, lens):
        return ForwardBatch.build(
            mode, [[5] * n for n in lens], [0] * len(lens), slots[: len(lens)], pool.req_to_token
        )

    assert graphs.can_run(batch(ForwardMode.EXTEND, [20, 12]), ())
    assert not graphs.can_run(batch(ForwardMode.EXTEND, [20, 13]), ())  # 33 tokens
    assert not graphs.can_run(batch(ForwardMode.EXTEND, [2, 2, 2]), ())  # 3 requests
    assert not graphs.can_run(batch(ForwardMode.DECODE, [1, 1]), ())
    assert not graphs.can_run(batch(ForwardMode.EXTEND, [4]), (1,))  # taps are no outputs
