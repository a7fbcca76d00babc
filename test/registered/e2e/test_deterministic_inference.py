"""`--enable-deterministic-inference` (batch-invariant kernels) and the triton attention of
DeepSeek-V4.1 (`attend_gathered`).

What CPU CI can show: the dispatch (the linear layers never reach the BLAS, whatever M; the
attention runs one pass over the key range), the kernels' row blocks and masked key tiles
leave a row's bits alone, the flag's requirements are enforced by name, and engines in the mode
keep DSpark lossless and a request's output independent of the batch. The matrix units' own
summation order is a GPU property: `benchmark/gpu/greedy_identity_probe.py` checks it on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sgl_dspark import Engine
from sgl_dspark.kernels.attention.reference import sink_attention_ref
from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.attention import create_attention_backend
from sgl_dspark.srt.layers.fused_linear import grouped_linear_impl, linear_impl
from sgl_dspark.srt.server_args import ServerArgs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INVARIANT = KernelChoice.parse("triton", batch_invariant=True)


def test_batch_invariant_linear_never_reaches_the_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    """M = 40 (past the decode-size kernels' 16 rows) runs the kernels; each row has the bits
    of a one-row call (bf16: exact products in the interpreter too)."""

    def no_blas(*_a, **_k):
        raise AssertionError("F.linear reached in batch-invariant mode")

    monkeypatch.setattr(F, "linear", no_blas)
    g = torch.Generator().manual_seed(3)
    linear = linear_impl(INVARIANT)
    x = torch.randn(40, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(72, 96, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    got = linear(x, w)
    want = x.float() @ w.float().t()
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2e-2)
    for r in (0, 17, 39):
        assert torch.equal(linear(x[r : r + 1], w), got[r : r + 1])
    x3 = x.view(4, 10, 96)  # leading dims kept
    assert torch.equal(linear(x3, w), got.view(4, 10, 72))
    grouped = grouped_linear_impl(INVARIANT)
    xg = torch.randn(33, 2, 48, generator=g).to(torch.bfloat16).to(DEVICE)
    wg = (torch.randn(2, 40, 48, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    out = grouped(xg, wg)
    torch.testing.assert_close(
        out.float(), torch.einsum("mgk,gnk->mgn", xg.float(), wg.float()), rtol=2**-7, atol=2e-2
    )
    for r in (0, 32):
        assert torch.equal(grouped(xg[r : r + 1], wg), out[r : r + 1])
    with pytest.raises(ValueError, match="dtype"):
        linear(x, w.float())


def _gathered(tokens: int, keys: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    heads, head_dim = 4, 32
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(tokens, keys, head_dim, generator=g).to(dtype).to(DEVICE)
    valid = (torch.rand(tokens, keys, generator=g) < 0.7).to(DEVICE)
    valid[:, 0] = True
    if tokens > 1:
        valid[1] = False  # a token that sees no key: the sink alone, a zero output
    sinks = torch.randn(heads, generator=g).to(dtype).to(DEVICE)
    return q, k, valid, sinks, head_dim**-0.5


@pytest.mark.parametrize("tokens,keys", [(1, 5), (3, 70), (6, 129)])
@pytest.mark.parametrize("invariant", [False, True])
def test_attend_gathered_matches_the_reference(tokens: int, keys: int, invariant: bool) -> None:
    q, k, valid, sinks, scale = _gathered(tokens, keys, seed=tokens * 100 + keys)
    got = create_attention_backend("triton", invariant).attend_gathered(q, k, valid, sinks, scale)
    want = create_attention_backend("torch").attend_gathered(q, k, valid, sinks, scale)
    torch.testing.assert_close(want, sink_attention_ref(q, k, valid, sinks, scale))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32, reordered sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_gathered_undoes_the_v_rope_in_its_epilogue(dtype: torch.dtype) -> None:
    """`inverse_rope`: each backend's output is its plain output rotated back by `rope_tail_ref`
    bit for bit (the Triton kernel rotates its own rounded output in the epilogue), at
    positions of either sign of angle."""
    q, k, valid, sinks, scale = _gathered(4, 37, seed=21, dtype=dtype)
    g = torch.Generator().manual_seed(22)
    angles = torch.randn(4, 8, generator=g) * 40.0  # rope dim 16 of head dim 32
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    for backend in (create_attention_backend("triton"), create_attention_backend("torch")):
        plain = backend.attend_gathered(q, k, valid, sinks, scale)
        rotated = backend.attend_gathered(q, k, valid, sinks, scale, inverse_rope=(cos, sin))
        want = rope_tail_ref(plain, cos, sin, inverse=True)
        assert rotated.dtype == dtype and torch.equal(rotated, want)
        assert not torch.equal(rotated, plain)


def test_batch_invariant_attention_ignores_the_batch_and_trailing_masked_keys() -> None:
    """One pass over the key tiles: a token alone, among others, or with more masked keys
    after its own (a verify's wider gather) gets the same bits."""
    backend = create_attention_backend("triton", batch_invariant=True)
    q, k, valid, sinks, scale = _gathered(5, 100, seed=11)
    full = backend.attend_gathered(q, k, valid, sinks, scale)
    for t in (0, 3):
        alone = backend.attend_gathered(q[t : t + 1], k[t : t + 1], valid[t : t + 1], sinks, scale)
        assert torch.equal(alone, full[t : t + 1])
    g = torch.Generator().manual_seed(12)
    wider = torch.cat((k, torch.randn(5, 90, k.shape[2], generator=g).to(DEVICE)), dim=1)
    masked = torch.cat((valid, torch.zeros(5, 90, dtype=torch.bool, device=DEVICE)), dim=1)
    assert torch.equal(backend.attend_gathered(q, wider, masked, sinks, scale), full)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(kernel_backend="torch"), "triton kernels for every family"),
        (dict(kernel_backend="triton", kernel_backend_overrides="moe=torch"), "torch here: moe"),
        (dict(kernel_backend="triton", attention_backend="torch"), "--attention-backend triton"),
    ],
)
def test_requirements_are_named(kw: dict, needle: str) -> None:
    args = ServerArgs(model_path="tiny", device="cpu", enable_deterministic_inference=True, **kw)
    with pytest.raises(ValueError, match=needle):
        args.resolved()


def test_attention_backend_auto_resolves_by_device() -> None:
    assert ServerArgs(model_path="tiny", device="cpu").resolved().attention_backend == "torch"


PROMPTS = ["Hi", "1+1="]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _run(prompts: list[str], spec: bool, max_running: int) -> list[list[int]]:
    kw = {"speculative_algorithm": "DSpark", "speculative_dspark_block_size": 2} if spec else {}
    e = Engine(
        model_path="tiny",
        device=DEVICE,
        dtype="bfloat16",
        context_length=128,
        kernel_backend="triton",
        attention_backend="triton",
        enable_deterministic_inference=True,
        max_running_requests=max_running,
        **kw,
    )
    try:
        assert e.runner.kernels.batch_invariant
        assert e.runner.attn_backend._num_splits == 1
        return [o["output_ids"] for o in e.generate(prompt=prompts, sampling_params=GREEDY)]
    finally:
        e.shutdown()


def test_deterministic_engine_is_batch_invariant_and_dspark_lossless() -> None:
    """bf16 on purpose (where rounding order shows): two requests together give the second
    the tokens it gets alone, and greedy DSpark gives the tokens of greedy decoding."""
    together = _run(PROMPTS, spec=False, max_running=2)
    assert _run(PROMPTS[1:], spec=False, max_running=1) == together[1:]
    assert _run(PROMPTS, spec=True, max_running=2) == together
