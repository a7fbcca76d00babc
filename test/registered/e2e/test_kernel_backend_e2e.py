"""`--kernel-backend triton` end to end on the built-in tiny model: the same greedy tokens as the
torch backend, with and without DSpark; per-family overrides bind what they name; bad choices are
rejected. On CPU the kernels run under the Triton interpreter (slow: few, short prompts); on a GPU
the same tests run compiled.

Exactness of the wired kernels against the torch path: rope, greedy argmax, accept and draft
inputs are exact; the mHC boundary agrees within an fp32 tolerance, so the
greedy comparison relies on the tiny model's clear logit margins (its lm_head is wide on purpose).
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.kernels.sampling.vocab_argmax import vocab_argmax
from sgl_dspark.srt.server_args import ServerArgs
from sgl_dspark.srt.speculative.dspark.ops import draft_inputs_torch

# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["Hi", "1+1="]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
# A short draft block keeps the interpreted verify forward small.
DSPARK = {"speculative_algorithm": "DSpark", "speculative_dspark_block_size": 2}


def _engine(**kw) -> Engine:
    return Engine(model_path="tiny", device=DEVICE, dtype="float32", context_length=128, **kw)


def _generate(params: dict, **kw) -> list[list[int]]:
    e = _engine(**kw)
    try:
        return [o["output_ids"] for o in e.generate(prompt=PROMPTS, sampling_params=params)]
    finally:
        e.shutdown()


def _triton_rope(fn) -> bool:
    """Whether `rope_impl` bound the Triton rope kernel's wrapper (its torch binding composes
    `apply_rope_tail` with the norm family's RMSNorm)."""
    return fn.__name__ == "rope_tail_triton"


def _triton_rope_q_kv(fn) -> bool:
    """Whether `rope_q_kv_impl` bound the fused q + KV rope launch (`rope_q_kv`)."""
    return fn.__name__ == "q_kv_triton"


def _bound(e: Engine) -> dict[str, bool]:
    """Which families the engine's layers bound to Triton (read from the built objects)."""
    model = e.runner.model
    attn = model.model.layers[0].self_attn
    spec = e.spec
    decode = spec.decode if spec is not None else e.executor
    out = {
        "rope": _triton_rope_q_kv(attn.rope_q_kv) and _triton_rope(model.compress_rope),
        "mhc": model.hc_boundary is not None,
        "sampling": decode.sampler.greedy_argmax is vocab_argmax,
    }
    if spec is not None:
        worker = spec.worker
        draft_attn = worker.draft.model.layers[0].self_attn
        assert _triton_rope_q_kv(draft_attn.rope_q_kv) == out["rope"]
        assert (worker.draft.hc_boundary is not None) == out["mhc"]
        out["spec"] = worker.accept_fn.__name__ == "accept_triton"
        assert (worker.draft_inputs_fn is not draft_inputs_torch) == out["spec"]
    return out


@pytest.mark.parametrize("spec", [{}, DSPARK], ids=["target", "dspark"])
def test_triton_backend_gives_torch_greedy_tokens(spec):
    want = _generate(GREEDY, kernel_backend="torch", **spec)
    got = _generate(GREEDY, kernel_backend="triton", **spec)
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in want)
    assert got == want


def test_triton_accept_gives_torch_sampled_dspark_tokens():
    # With the model families on torch the verify logits are the same bits, so seeded sampling
    # (Markov draft, accept coins, the fixed-point bonus draw) must commit the same tokens.
    sampled = {
        "max_new_tokens": 8,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 7,
        "ignore_eos": True,
    }
    want = _generate(sampled, kernel_backend="torch", **DSPARK)
    got = _generate(
        sampled,
        kernel_backend="torch",
        kernel_backend_overrides="spec=triton,sampling=triton",
        **DSPARK,
    )
    assert got == want


@pytest.mark.parametrize(
    "backend, overrides, want",
    [
        ("torch", None, dict(rope=False, mhc=False, sampling=False, spec=False)),
        ("triton", None, dict(rope=True, mhc=True, sampling=True, spec=True)),
        ("triton", "mhc=torch, spec=torch", dict(rope=True, mhc=False, sampling=True, spec=False)),
        (
            "torch",
            "rope=triton,sampling=triton",
            dict(rope=True, mhc=False, sampling=True, spec=False),
        ),
    ],
)
def test_overrides_bind_per_family(backend, overrides, want):
    e = _engine(kernel_backend=backend, kernel_backend_overrides=overrides, **DSPARK)
    try:
        assert _bound(e) == want
    finally:
        e.shutdown()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kernel_backend="cuda"), "--kernel-backend"),
        (dict(kernel_backend_overrides="attention=triton"), "unknown family 'attention'"),
        (dict(kernel_backend_overrides="rope=cuda"), "rope='cuda'"),
        (dict(kernel_backend_overrides="rope"), "family=impl"),
    ],
)
def test_bad_kernel_choices_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        _engine(**kw)
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path="tiny", **kw)


@pytest.mark.parametrize(
    "spec",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                DEVICE == "cpu",
                reason="the interpreted draft and verify forwards exceed a CPU test's budget",
            ),
        ),
    ],
)
def test_tiny_v41_triton_backend_equals_torch(spec):
    """DeepSeek-V4.1 (`tiny-v41`) with every family on Triton: the single-pass mHC boundary,
    the V4.1 router and experts, the ratio-2 compressor's pair pooling, the fused cache stores
    (FP8 window, FP4 latents and index keys) and their gathered reads, the FP4 index scoring with the candidate blocks, Engram's
    gather and gate; with and without its DSpark draft."""
    kw = {**DSPARK} if spec else {}
    params = {**GREEDY, "max_new_tokens": 4}

    def run(backend: str) -> list[list[int]]:
        e = Engine(
            model_path="tiny-v41",
            device=DEVICE,
            dtype="float32",
            context_length=128,
            kernel_backend=backend,
            **kw,
        )
        try:
            if backend == "triton":
                attn = e.runner.model.model.layers[3].self_attn  # kv source, candidate source
                assert attn.store_rows.__name__ == "store_triton"
                assert attn.load_rows.__name__ == "load_triton"
                assert attn.index_scores.__name__ == "v41_index_scores"
                pairs = e.runner.model.model.layers[1].self_attn.compressor  # ratio-2 kv source
                assert pairs.pair_pool.__name__ == "csa2_pair_pool"
                engram = e.runner.model.model.layers[0].engram
                assert engram.lookup.__name__ == "lookup_triton"
                assert engram.gate.__name__ == "engram_gate"
                assert e.runner.model.hc_boundary is not None
            return [o["output_ids"] for o in e.generate(prompt=PROMPTS, sampling_params=params)]
        finally:
            e.shutdown()

    assert run("triton") == run("torch")
