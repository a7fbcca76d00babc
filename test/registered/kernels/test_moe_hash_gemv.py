"""Hash routing from x (`router_topk`: `moe_route_hash.py`'s split-K GEMV of the token's own
experts only, then the routing launch), against `router_topk_ref`. Ids are a table lookup
(exact); weights are within a tolerance (the dot's summation order), and where the inputs make every fp32 sum
exact, bit for bit those of routing from the exact logits."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.moe import router as moe_route
from sgl_dspark.kernels.moe.reference import RouterConfig, router_topk_ref
from sgl_dspark.kernels.moe.router import router_topk
from test_moe_router import DEVICE, _check, _grid_exact_inputs

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """router_topk allocates its outputs with torch.empty: fill them with NaN / -7 so the kernel
    must write every element."""
    empty = torch.empty
    monkeypatch.setattr(
        moe_route.torch,
        "empty",
        lambda *a, **k: empty(*a, **k).fill_(
            float("nan") if k.get("dtype") == torch.float32 else -7
        ),
    )


def _inputs(
    rows: int, hidden: int, experts: int, topk: int, dtype: torch.dtype, seed: int, exact: bool
):
    gen = torch.Generator().manual_seed(seed)
    vocab = 500
    if exact:
        x, gate = _grid_exact_inputs(rows, hidden, experts, dtype, gen)
    else:
        x = torch.randn(rows, hidden, generator=gen).to(dtype).to(DEVICE)
        gate = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype).to(DEVICE)
    tid2eid = torch.randint(0, experts, (vocab, topk), generator=gen, dtype=torch.int32)
    input_ids = torch.randint(0, vocab, (rows,), generator=gen)
    return x, gate, tid2eid.to(DEVICE), input_ids.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(
    "rows,hidden,experts,topk,shared",
    [
        (1, 4096, 384, 6, 0),  # DSV4-Flash shapes
        (5, 1024, 64, 6, 1),  # the 910M benchmark model's hash layers
        (37, 600, 72, 2, 1),  # H not a multiple of the K chunk, E not a power of two
        (3, 96, 8, 3, 0),
    ],
)
def test_matches_reference(
    rows, hidden, experts, topk, shared, exact, dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison_outputs(monkeypatch)
    x, gate, tid2eid, input_ids = _inputs(
        rows, hidden, experts, topk, dtype, seed=rows + hidden, exact=exact
    )
    n_valid = torch.tensor(max(rows - 1, 1), dtype=torch.int32, device=DEVICE)
    for scoring, renorm in (("sqrtsoftplus", True), ("sigmoid", False)):
        config = RouterConfig(
            topk,
            scoring,
            renormalize=renorm,
            routed_scaling_factor=1.5,
            num_shared=shared,
            fill_id=-1,
        )
        kwargs = dict(x=x, gate_weight=gate, tid2eid=tid2eid, input_ids=input_ids, n_valid=n_valid)
        got, want = router_topk(config, **kwargs), router_topk_ref(config, **kwargs)
        _check(got, want, None, topk)  # ids exact, weights within RTOL
        if exact:  # every fp32 sum exact: the from-logits launch, given the exact logits,
            # gives the same bits (the same scoring and renormalisation code)
            logits = (x.float() @ gate.float().T).contiguous()
            from_logits = router_topk(
                config, logits=logits, tid2eid=tid2eid, input_ids=input_ids, n_valid=n_valid
            )
            assert torch.equal(got.ids, from_logits.ids)
            assert torch.equal(got.weights.view(torch.int32), from_logits.weights.view(torch.int32))
        if rows > 1:
            assert got.ids[-1].tolist() == [-1] * (topk + shared)
            assert got.weights[-1].eq(0).all()


def test_reads_only_the_tokens_experts() -> None:
    """Gate rows of experts no token routes to are NaN: the outputs stay finite (a full GEMV
    would carry the NaNs into nothing here, but reading them is what the launch avoids; a
    wrong expert index would surface as NaN weights)."""
    x, gate, tid2eid, input_ids = _inputs(6, 256, 64, 6, torch.float32, seed=2, exact=False)
    used = torch.zeros(64, dtype=torch.bool, device=DEVICE)
    used[tid2eid[input_ids].long().flatten()] = True
    gate = torch.where(used[:, None], gate, float("nan"))
    config = RouterConfig(6, routed_scaling_factor=2.5)
    kwargs = dict(x=x, gate_weight=gate, tid2eid=tid2eid, input_ids=input_ids)
    got = router_topk(config, **kwargs)
    assert torch.isfinite(got.weights).all()
    _check(got, router_topk_ref(config, **kwargs), None, 6)


def test_rows_do_not_depend_on_batch_and_stale_pad_ids() -> None:
    """A row's bits are the same alone and among 8 rows (verify rows reproduce decode rows); a
    padding row's stale token id (negative, past the table) reads in bounds and is filled."""
    x, gate, tid2eid, input_ids = _inputs(8, 1024, 64, 6, torch.bfloat16, seed=4, exact=False)
    config = RouterConfig(6, routed_scaling_factor=1.5, num_shared=1, fill_id=-1)
    batch = router_topk(config, x=x, gate_weight=gate, tid2eid=tid2eid, input_ids=input_ids)
    for m in range(8):
        one = router_topk(
            config,
            x=x[m : m + 1],
            gate_weight=gate,
            tid2eid=tid2eid,
            input_ids=input_ids[m : m + 1],
        )
        assert torch.equal(one.ids, batch.ids[m : m + 1])
        assert torch.equal(
            one.weights.view(torch.int32), batch.weights[m : m + 1].view(torch.int32)
        )
    stale = input_ids.clone()
    stale[6:] = torch.tensor([-3, 10**6], device=DEVICE)
    n_valid = torch.tensor(6, dtype=torch.int32, device=DEVICE)
    got = router_topk(
        config, x=x, gate_weight=gate, tid2eid=tid2eid, input_ids=stale, n_valid=n_valid
    )
    assert torch.equal(got.weights[:6].view(torch.int32), batch.weights[:6].view(torch.int32))
    assert got.ids[6:].eq(-1).all() and got.weights[6:].eq(0).all()


def test_empty_batch() -> None:
    x, gate, tid2eid, input_ids = _inputs(0, 64, 16, 6, torch.float32, seed=1, exact=False)
    got = router_topk(RouterConfig(6), x=x, gate_weight=gate, tid2eid=tid2eid, input_ids=input_ids)
    assert got.ids.shape == (0, 6) and got.weights.shape == (0, 6)
