"""Programmatic dependent launch (`_triton_utils.programmatic_launch`): asked for only where it
exists (compiled, CUDA compute capability 9+), and on a GPU a chain of PDL kernels inside a CUDA graph gives the
bits of the same chain launched plainly and of the references, replay after replay with new
inputs (a kernel that started before its producer finished, or stored before its predecessor
read the buffer, would show here): the MoE chain (router, `silu_mul_clamp`, `moe_reduce`) and the
DSpark step's tail with an indexer head (`spec_accept`, `prepare_draft_inputs`, `rope_tail`,
`fp4_index_k_quant`). The PTX side (wait before the first load and store) is
checked ahead of time in `gpu_targets_check.check_programmatic_launch`."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels import _triton_utils
from sgl_dspark.kernels.indexer.fp4_k_quant import fp4_index_k_quant
from sgl_dspark.kernels.indexer.reference import fp4_index_k_quant_ref
from sgl_dspark.kernels.moe.activation import _silu_mul_clamp_kernel, silu_mul_clamp
from sgl_dspark.kernels.moe.reduce import moe_reduce
from sgl_dspark.kernels.moe.reference import (
    RouterConfig,
    moe_reduce_ref,
    router_topk_ref,
    silu_mul_clamp_ref,
)
from sgl_dspark.kernels.moe.router import make_router_workspace, router_topk
from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.kernels.rope.tail import rope_tail
from sgl_dspark.kernels.spec.accept import spec_accept
from sgl_dspark.kernels.spec.draft_inputs import prepare_draft_inputs
from sgl_dspark.kernels.spec.reference import prepare_draft_inputs_ref, spec_accept_ref

ON_GPU = torch.cuda.is_available()


def test_never_asked_for_on_cpu_or_when_forbidden() -> None:
    assert _triton_utils.programmatic_launch(_silu_mul_clamp_kernel, torch.device("cpu")) == {
        "PDL": False
    }
    try:
        _triton_utils.set_programmatic_launch(False)
        if ON_GPU:
            assert _triton_utils.programmatic_launch(
                _silu_mul_clamp_kernel, torch.device("cuda")
            ) == {"PDL": False}
    finally:
        _triton_utils.set_programmatic_launch(True)
    if ON_GPU and not _triton_utils.interpreted(_silu_mul_clamp_kernel):
        want = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
        got = _triton_utils.programmatic_launch(_silu_mul_clamp_kernel, torch.device("cuda"))
        assert got["PDL"] is want and got.get("launch_pdl", False) is want


def _allowed_now() -> bool:
    """What a launch would get on an sm90 GPU now (the switch; the device part is tested above)."""
    return _triton_utils._ProgrammaticLaunchSwitch.allowed


@pytest.mark.parametrize("limit", [None, 0, 1, 8])
def test_batch_scope_limits_graph_captures_and_restores(limit: int | None) -> None:
    try:
        _triton_utils.set_programmatic_launch(True, max_graph_batch=limit)
        for bs in (1, 2, 8, 9, 32):
            with _triton_utils.programmatic_launch_for_batch(bs):
                assert _allowed_now() is (limit is None or bs <= limit), (bs, limit)
                if ON_GPU and not _allowed_now():
                    assert _triton_utils.programmatic_launch(
                        _silu_mul_clamp_kernel, torch.device("cuda")
                    ) == {"PDL": False}
            assert _allowed_now() is True  # restored after each scope
        _triton_utils.set_programmatic_launch(False, max_graph_batch=limit)
        with _triton_utils.programmatic_launch_for_batch(1):
            assert _allowed_now() is False  # a scope never turns a forbidden launch on
        assert _allowed_now() is False
        with pytest.raises(RuntimeError), _triton_utils.programmatic_launch_for_batch(1):
            raise RuntimeError("capture failed")  # restored on the error path too
        assert _allowed_now() is False
    finally:
        _triton_utils.set_programmatic_launch(True)
    with pytest.raises(ValueError, match="max_graph_batch"):
        _triton_utils.set_programmatic_launch(True, max_graph_batch=-1)
    assert _triton_utils._ProgrammaticLaunchSwitch.max_graph_batch is None


def _chain(
    x: torch.Tensor,
    gate: torch.Tensor,
    gate_up: torch.Tensor,
    shared: torch.Tensor,
    mask: torch.Tensor,
    workspace,
) -> tuple[torch.Tensor, ...]:
    """Each kernel reads what the one before it just wrote: a torch producer, the router (GEMV
    then routing launch), `silu_mul_clamp` twice (its output is the next call's input) and
    `moe_reduce` on the
    router's routes."""
    x = x * 1.0  # a plain torch kernel writes the router's input
    config = RouterConfig(topk=6, scoring="sqrtsoftplus", routed_scaling_factor=2.5)
    routes = router_topk(config, x=x, gate_weight=gate, workspace=workspace)
    act = silu_mul_clamp(gate_up, 7.0)
    act = silu_mul_clamp(act, 7.0)
    y = act[:, None, :].expand(-1, 6, -1).contiguous()
    out = moe_reduce(y, routes.weights, routes.ids, mask, 1.5, shared)
    return routes.ids, routes.weights, act, out


def _chain_ref(x, gate, gate_up, shared, mask) -> tuple[torch.Tensor, ...]:
    config = RouterConfig(topk=6, scoring="sqrtsoftplus", routed_scaling_factor=2.5)
    routes = router_topk_ref(config, x=x, gate_weight=gate)
    act = silu_mul_clamp_ref(silu_mul_clamp_ref(gate_up, 7.0), 7.0)
    y = act[:, None, :].expand(-1, 6, -1).contiguous()
    return (
        routes.ids,
        routes.weights,
        act,
        moe_reduce_ref(y, routes.weights, routes.ids, mask, 1.5, shared),
    )


@pytest.mark.skipif(not ON_GPU, reason="programmatic launch needs a GPU")
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_graph_chain_equals_plain_launches_and_reference(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    hidden, experts = 1024, 64
    gate = torch.randn(experts, hidden, generator=gen).to(torch.bfloat16).cuda()
    mask = (torch.rand(experts, generator=gen) < 0.5).to(torch.int32).cuda()
    static = [
        torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device="cuda"),
        torch.full((rows, 4 * hidden), float("nan"), dtype=torch.bfloat16, device="cuda"),
        torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device="cuda"),
    ]
    workspace = make_router_workspace(rows, experts, hidden, "cuda")

    def fresh_inputs() -> list[torch.Tensor]:
        return [
            torch.randn(rows, hidden, generator=gen).to(torch.bfloat16),
            (torch.randn(rows, 4 * hidden, generator=gen) * 4).to(torch.bfloat16),
            torch.randn(rows, hidden, generator=gen).to(torch.bfloat16),
        ]

    graphs = {}
    for pdl in (True, False):
        _triton_utils.set_programmatic_launch(pdl)
        try:
            for src, dst in zip(fresh_inputs(), static):
                dst.copy_(src)
            _chain(static[0], gate, static[1], static[2], mask, workspace)  # compile first
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                # Four chains back to back: each one's first kernel follows the last one's.
                outs = [
                    _chain(static[0], gate, static[1], static[2], mask, workspace) for _ in range(4)
                ]
            graphs[pdl] = (graph, outs)
        finally:
            _triton_utils.set_programmatic_launch(True)
    for _ in range(3):
        inputs = fresh_inputs()
        want = _chain_ref(inputs[0].cuda(), gate, inputs[1].cuda(), inputs[2].cuda(), mask)
        for pdl, (graph, outs) in graphs.items():
            for out in outs:
                for tensor in out:
                    tensor.fill_(-7)  # poison: every output must be rewritten by the replay
            for src, dst in zip(inputs, static):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            for out in outs:
                ids, weights, act, reduced = out
                assert torch.equal(ids, want[0]), pdl
                # Router weights and the activation (exp2/log2 lowerings): small tolerances;
                # with PDL off and on the bits must agree exactly (checked below).
                torch.testing.assert_close(weights, want[1], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(act.float(), want[2].float(), rtol=2**-7, atol=0)
                torch.testing.assert_close(reduced.float(), want[3].float(), rtol=2**-6, atol=1e-2)
        for a, b in zip(graphs[True][1][0], graphs[False][1][0]):
            assert torch.equal(a, b)
        for out in graphs[True][1][1:]:
            for a, b in zip(out, graphs[True][1][0]):
                assert torch.equal(a, b)


def _spec_chain(
    verify_ids,
    verify_lens,
    seq_lens,
    target_src,
    pool_idx,
    req_to_token,
    n_valid,
    q,
    cos,
    sin,
    accept,
    inputs,
    rope,
    fp4,
):
    """The DSpark step's tail and an indexer's head, each kernel on the last one's output: a
    torch producer writes the target ids, `spec_accept` accepts, `prepare_draft_inputs` plans the
    next draft from its anchors and lengths; a torch producer writes q, `rope_tail` rotates it,
    `fp4_index_k_quant` quantises the result."""
    target_ids = target_src + 0
    out = accept(verify_ids, verify_lens, seq_lens, target_ids=target_ids)
    plan = inputs(
        out.next_anchors,
        out.new_seq_lens,
        pool_idx,
        req_to_token,
        n_valid,
        draft_len=4,
        verify_width=verify_ids.shape[1],
        mask_token_id=7,
    )
    rotated = rope(q * 1.0, cos, sin)
    codes, scales = fp4(rotated.reshape(-1, rotated.shape[-1]))
    return (*out, *plan, rotated, codes, scales)


@pytest.mark.skipif(not ON_GPU, reason="programmatic launch needs a GPU")
@pytest.mark.parametrize("rows", [1, 6, 32])
def test_spec_and_indexer_chain_in_a_graph(rows: int) -> None:
    gen = torch.Generator().manual_seed(100 + rows)
    width, heads, head_dim, table = 4, 8, 128, 64
    pool_idx = torch.randperm(rows, generator=gen).cuda()
    req_to_token = torch.randperm(rows * table, generator=gen).reshape(rows, table).cuda()
    n_valid = torch.tensor([max(rows - 1, 1)], dtype=torch.int32, device="cuda")
    static = {
        "verify_ids": torch.zeros(rows, width, dtype=torch.int64, device="cuda"),
        "verify_lens": torch.zeros(rows, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.zeros(rows, dtype=torch.int32, device="cuda"),
        "target_src": torch.zeros(rows, width, dtype=torch.int64, device="cuda"),
        "q": torch.zeros(rows, heads, head_dim, dtype=torch.bfloat16, device="cuda"),
        "cos": torch.zeros(rows, 32, device="cuda"),
        "sin": torch.zeros(rows, 32, device="cuda"),
    }

    def fresh() -> dict[str, torch.Tensor]:
        verify = torch.randint(0, 4, (rows, width), generator=gen)  # small ids: partial accepts
        angles = torch.rand(rows, 32, generator=gen) * 6.28
        return {
            "verify_ids": verify,
            "verify_lens": torch.randint(0, width + 1, (rows,), generator=gen).int(),
            "seq_lens": torch.randint(0, table - width - 4, (rows,), generator=gen).int(),
            "target_src": torch.randint(0, 4, (rows, width), generator=gen),
            "q": (torch.randn(rows, heads, head_dim, generator=gen) * 3).to(torch.bfloat16),
            "cos": angles.cos(),
            "sin": angles.sin(),
        }

    kernels = dict(
        accept=spec_accept, inputs=prepare_draft_inputs, rope=rope_tail, fp4=fp4_index_k_quant
    )
    refs = dict(
        accept=spec_accept_ref,
        inputs=prepare_draft_inputs_ref,
        rope=rope_tail_ref,
        fp4=fp4_index_k_quant_ref,
    )
    fixed = (pool_idx, req_to_token, n_valid)

    def run(fns: dict, tensors: dict) -> tuple[torch.Tensor, ...]:
        t = tensors
        return _spec_chain(
            t["verify_ids"],
            t["verify_lens"],
            t["seq_lens"],
            t["target_src"],
            *fixed,
            t["q"],
            t["cos"],
            t["sin"],
            **fns,
        )

    graphs = {}
    for pdl in (True, False):
        _triton_utils.set_programmatic_launch(pdl)
        try:
            for name, value in fresh().items():
                static[name].copy_(value)
            run(kernels, static)  # compile first
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [run(kernels, static) for _ in range(3)]
            graphs[pdl] = (graph, outs)
        finally:
            _triton_utils.set_programmatic_launch(True)
    for _ in range(3):
        inputs = fresh()
        want = run(refs, {k: v.cuda() for k, v in inputs.items()})
        for graph, outs in graphs.values():
            for out in outs:
                for tensor in out:
                    tensor.fill_(-3)  # poison: every output must be rewritten by the replay
            for name, value in inputs.items():
                static[name].copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            for out in outs:
                assert len(out) == len(want)
                for got, ref in zip(out, want):  # integer, copied and exactly rounded outputs
                    assert torch.equal(got, ref.to(got.dtype))
