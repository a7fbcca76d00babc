"""The triton "moe" backend (`router_topk` -> `moe_sort` -> grouped GEMMs with the SwiGLU
epilogue -> `moe_reduce` with the shared expert) equals the torch MoE block, and the tiny model
generates the same greedy tokens.

Tolerance of the block check (fp32): both sides compute the same fp32 maths with other summation
orders (slot sum, GEMM K order) and other score transcendentals (exp2/log2 vs softplus), so
outputs of magnitude ~0.1 agree to 1e-5 absolute / 1e-4 relative; the routing itself (ids) must
agree exactly as a set per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.fused_linear import fuse_after_placement
from sgl_dspark.srt.layers.moe import RoutedExperts, Router, SharedExpert, SparseMoE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
HIDDEN, EXPERTS, TOPK, INTER, VOCAB, LIMIT, SCALE = 64, 8, 2, 32, 96, 1.5, 1.5


def _block(kernels: KernelChoice, is_hash: bool, scoring: str) -> SparseMoE:
    router = Router(HIDDEN, EXPERTS, TOPK, VOCAB, is_hash, scoring, SCALE, True, kernels)
    experts = RoutedExperts(EXPERTS, HIDDEN, INTER, LIMIT, kernels)
    shared = SharedExpert(HIDDEN, INTER, LIMIT, kernels)
    return SparseMoE(router, experts, shared, kernels)


def _random_state(block: SparseMoE, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in block.state_dict().items():
        if name.endswith("tid2eid"):
            rows = [torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(VOCAB)]
            state[name] = torch.stack(rows)
        elif name.endswith("e_score_correction_bias"):
            state[name] = 0.1 * torch.randn(tensor.shape, generator=gen)
        else:  # |gate/up| reach past LIMIT on some rows, so both clamps matter
            state[name] = torch.randn(tensor.shape, generator=gen) * 2.0 / tensor.shape[-1] ** 0.5
    return state


@contextlib.contextmanager
def _no_host_sync() -> Iterator[None]:
    """Fail on any device->host read: CUDA's sync debug mode on a GPU; on CPU, the tensor
    methods that read values on the host raise (the interpreter reads through numpy, not these)."""
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in the triton MoE path")

    with pytest.MonkeyPatch.context() as patch:
        for method in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__"):
            patch.setattr(torch.Tensor, method, refuse)
        patch.setattr(torch, "nonzero", refuse)
        yield


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize(
    "is_hash,scoring", [(False, "sqrtsoftplus"), (True, "sqrtsoftplus"), (False, "sigmoid")]
)
def test_triton_block_equals_torch_block(is_hash: bool, scoring: str, fold: bool) -> None:
    """Also with the shared expert folded into the routed stacks (as placed models run)."""
    torch_block = _block(KernelChoice("torch"), is_hash, scoring)
    triton_block = _block(KernelChoice("torch", (("moe", "triton"),)), is_hash, scoring)
    state = _random_state(torch_block, seed=3 + int(is_hash))
    torch_block.load_state_dict(state)
    triton_block.load_state_dict(state)  # strict: the triton buffers stay out of checkpoints
    torch_block.to(DEVICE)
    triton_block.to(DEVICE)
    if fold:
        fuse_after_placement(triton_block)
        assert triton_block.experts.folded
        # The checkpoint parameters are views of the stacks and keep their values and names.
        assert triton_block.state_dict().keys() == state.keys()
        for name, value in triton_block.state_dict().items():
            assert torch.equal(value.cpu(), state[name].to(value.dtype)), name
    gen = torch.Generator().manual_seed(11)
    for num_tokens in (0, 1, 5, 37):
        x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE)
        input_ids = torch.randint(0, VOCAB, (num_tokens,), generator=gen).to(DEVICE)
        with torch.no_grad():
            want = torch_block(x, input_ids)
            weights_t, ids_t = torch_block.gate(x, input_ids)
            with _no_host_sync():
                got = triton_block(x, input_ids)
                weights_k, ids_k = triton_block.gate(x, input_ids)
                weights_s, ids_s = triton_block.gate(x, input_ids, with_shared=True)
        # with_shared: the same routes, then the shared expert as expert E with weight 1.
        assert torch.equal(ids_s[:, :TOPK], ids_k) and torch.equal(weights_s[:, :TOPK], weights_k)
        assert (ids_s[:, TOPK] == EXPERTS).all() and (weights_s[:, TOPK] == 1).all()
        assert ids_k.dtype == torch.int32 and weights_k.dtype == torch.float32
        ids_t, order_t = ids_t.sort(dim=1)
        ids_k, order_k = ids_k.long().sort(dim=1)
        assert torch.equal(ids_k, ids_t), "routing differs"
        torch.testing.assert_close(
            weights_k.gather(1, order_k), weights_t.gather(1, order_t), rtol=1e-5, atol=1e-6
        )
        assert got.shape == want.shape == (num_tokens, HIDDEN)
        if num_tokens:
            assert want.abs().max() > 0.05  # a real signal, not an all-zero output
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_folded_shared_expert_bits_do_not_depend_on_the_batch() -> None:
    """Folded, a token's output comes from the per-token kernels (up to 4 tokens) or the sorted
    ones (more): the same bits on a GPU, as unfolded (the interpreter's fp32 dots may sum in
    another order per tile shape: a tolerance there). Untied by a later `Module.to()`, the block
    runs the shared expert separately again and stays correct."""
    block = _block(KernelChoice("triton"), False, "sqrtsoftplus")
    block.load_state_dict(_random_state(block, seed=5))
    block.to(DEVICE)
    fuse_after_placement(block)
    assert block.experts.folded
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(21, HIDDEN, generator=gen).to(DEVICE)
    with torch.no_grad():
        few, many = block(x[:3], None), block(x, None)[:3]
        untied = block.double().float()
        assert not untied.experts.folded
        unfolded = untied(x, None)[:3]
    if DEVICE == "cuda":
        assert torch.equal(few, many)
    else:
        torch.testing.assert_close(few, many, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unfolded, many, rtol=1e-4, atol=1e-5)


def test_triton_block_without_shared_add() -> None:
    """RoutedExperts alone: the torch router's int64 ids / fp32 weights feed the triton path."""
    torch_block = _block(KernelChoice("torch"), False, "sqrtsoftplus")
    experts = RoutedExperts(EXPERTS, HIDDEN, INTER, LIMIT, KernelChoice("triton"))
    state = _random_state(torch_block, seed=9)
    torch_block.load_state_dict(state)
    experts.load_state_dict(
        {k[len("experts.") :]: v for k, v in state.items() if k.startswith("experts.")}
    )
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        weights, ids = torch_block.gate(x, None)
        want = torch_block.experts(x, ids, weights)
        got = experts.to(DEVICE)(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_tiny_model_greedy_tokens_match_torch_backend() -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outputs = []
    for overrides in (None, "moe=triton"):
        # fp32 on both backends (the CPU default), so greedy choices compare like for like.
        engine = Engine(
            model_path="tiny",
            device=DEVICE,
            dtype="float32",
            kernel_backend="torch",
            kernel_backend_overrides=overrides,
            context_length=256,
        )
        buffers = dict(engine.runner.model.named_buffers())
        # The sort's table exists only when the triton path was built for every layer's experts, and
        # the runner folded each layer's shared expert into its routed stacks.
        assert ("model.layers.0.mlp.experts.sort_table" in buffers) == (overrides is not None)
        assert all(
            layer.mlp.experts.folded == (overrides is not None)
            for layer in engine.runner.model.model.layers
        )
        outputs.append(
            [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=params)]
        )
        engine.shutdown()
    assert [len(ids) for ids in outputs[0]] == [8, 8]
    assert outputs[1] == outputs[0]
