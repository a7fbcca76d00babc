"""Router gate / top-k / pad fill (`router_topk`) vs `router_topk_ref`.

The x source runs a split-K GEMV (16 experts per program); with `_route_meta(M).fused` (up to 8
rows by default) the last GEMV program routes (one launch), otherwise a second launch routes the
partials; both are covered below, with the workspace poisoned so every partial read must have been
written by this call. Every launch shape the router sweep may pick (`sweep_router.CANDIDATES`) must
give bit-identical results, and a row's logits must not depend on the batch it is routed in.

Ids are exact wherever the reference's selection values are separated by more than the score
transcendentals' error (exp2/log2 lowerings differ: numpy vs torch on CPU, approx ex2/lg2 on GPU);
exact ties are always compared exactly. Near-tie rows instead must pick experts whose selection
values match the reference's sorted values within that error. Weights: fp32 tolerance (see RTOL).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from sgl_dspark.kernels.moe import route_rows
from sgl_dspark.kernels.moe import router as moe_route
from sgl_dspark.kernels.moe.reference import RouterConfig, RouterTopkOutput, router_topk_ref
from sgl_dspark.kernels.moe.reference import _scores_ref as scores_ref
from sgl_dspark.kernels.moe.router import make_router_workspace, router_topk

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmark.kernels import sweep_router  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter converts scalar loop bounds through a numpy call that numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
ON_GPU = DEVICE == "cuda"
# Weights (relative): CPU: numpy vs torch exp2/log2 differ by an ulp or two. GPU: ex2.approx and
# lg2.approx reach ~1e-4 relative error on small softplus values (lg2's absolute error near 1 over
# a tiny log2(1 + e)).
RTOL = 1e-4 if ON_GPU else 2e-6
# Selection values (absolute below 1, relative above): the same lowering differences, but seen on
# sqrt(softplus) near the top of a row. lg2.approx's 2^-22 absolute error plus a 1-ulp flip of
# 1 + exp2 move softplus by <= 3e-7, i.e. a score s by <= 3e-7 / (2 s) + a few ulps: <= 1e-6 for
# every score these tests rank (>= 0.16). The GPU bound keeps a 20x margin over that. It must stay
# tight: a near-tie row is exempt from the exact id check, and the fraction of exempt random rows
# grows linearly with TIE_TOL (2e-4, the weights' relative error, exempted ~10% of rows).
TIE_TOL = 2e-5 if ON_GPU else 1e-5


def _selection_values(
    logits: torch.Tensor, scoring: str, bias: torch.Tensor | None
) -> torch.Tensor:
    choice = scores_ref(logits.float(), scoring)
    if bias is not None:
        choice = choice + bias
    return torch.where(torch.isnan(choice), torch.full_like(choice, -float("inf")), choice)


def _check(
    got: RouterTopkOutput,
    ref: RouterTopkOutput,
    choice: torch.Tensor | None,
    topk: int,
    n_valid: torch.Tensor | None = None,
) -> None:
    assert got.ids.shape == ref.ids.shape and got.weights.shape == ref.weights.shape
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    torch.testing.assert_close(got.weights, ref.weights, rtol=RTOL, atol=0)
    if choice is None:  # hash routing: ids are a table lookup
        assert torch.equal(got.ids, ref.ids)
        return
    n_rows = choice.shape[0]
    top = torch.sort(choice, dim=1, descending=True, stable=True).values[:, : topk + 1]
    gaps = (top[:, :-1] - top[:, 1:]).abs()
    scale = top.abs().clamp(min=1.0)[:, :-1]
    fragile = ((gaps > 0) & (gaps < TIE_TOL * scale)).any(dim=1)
    if n_valid is not None:  # padded rows hold the fill id: always exact
        fragile &= torch.arange(n_rows, device=choice.device) < n_valid.reshape(())
    exact = ~fragile
    assert torch.equal(got.ids[exact], ref.ids[exact])
    # Near ties: a valid top-k order up to the transcendentals' error, no expert twice.
    routed = got.ids[fragile, :topk].long()
    if routed.numel():
        picked = choice[fragile].gather(1, routed)
        ref_vals = top[fragile, :topk]
        assert (picked - ref_vals).abs().max() <= TIE_TOL * ref_vals.abs().clamp(min=1.0).max()
        assert all(len(set(row)) == topk for row in routed.tolist())
    assert int(fragile.sum()) <= max(2, n_rows // 20), "too many near-tie rows to be meaningful"


def _random_logits(rows: int, experts: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # few distinct values: exact ties everywhere
        logits = torch.randint(-3, 4, (rows, experts), generator=gen).float() / 2
    else:
        logits = torch.randn(rows, experts, generator=gen) * 2
    if kind == "nan" and rows:
        logits[torch.rand(rows, experts, generator=gen) < 0.05] = float("nan")
        logits[0] = float("nan")  # every score NaN: ids 0..k-1, weight 0
    return logits.to(DEVICE)


def _random_bias(experts: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":
        return (torch.randint(0, 2, (experts,), generator=gen).float() / 4).to(DEVICE)
    return (torch.randn(experts, generator=gen) * 0.1).to(DEVICE)


@pytest.mark.parametrize("kind", ["randn", "ties", "nan"])
@pytest.mark.parametrize("num_rows", [0, 1, 4, 24, 37, 128])
def test_logits_source_dsv4(num_rows: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(num_rows * 13 + len(kind))
    logits = _random_logits(num_rows, 384, kind, gen)
    bias = _random_bias(384, kind, gen)
    for scoring in ("sqrtsoftplus", "sigmoid"):
        n_valid = torch.tensor(max(num_rows - 3, 0), dtype=torch.int32, device=DEVICE)
        config = RouterConfig(6, scoring, routed_scaling_factor=1.5, num_shared=1)
        kwargs = dict(logits=logits, correction_bias=bias, n_valid=n_valid)
        got = router_topk(config, **kwargs)
        choice = _selection_values(logits, scoring, bias)
        _check(got, router_topk_ref(config, **kwargs), choice, 6, n_valid)


@pytest.mark.parametrize(
    "num_rows,experts,topk,num_shared",
    [(5, 10, 3, 0), (9, 256, 8, 2), (3, 7, 7, 0), (17, 33, 1, 1), (130, 64, 4, 0)],
)
def test_general_shapes_and_options(
    num_rows: int, experts: int, topk: int, num_shared: int
) -> None:
    gen = torch.Generator().manual_seed(num_rows + experts * 7 + topk)
    for kind in ("randn", "ties"):
        logits = _random_logits(num_rows, experts, kind, gen)
        for bias in (None, _random_bias(experts, kind, gen)):
            for renormalize in (True, False):
                config = RouterConfig(
                    topk,
                    renormalize=renormalize,
                    routed_scaling_factor=2.5,
                    num_shared=num_shared,
                    shared_weight=0.75,
                    shared_id_base=1000,
                    fill_id=-1,
                )
                n_valid = torch.tensor(num_rows // 2, dtype=torch.int32, device=DEVICE)
                kwargs = dict(logits=logits, correction_bias=bias, n_valid=n_valid)
                got = router_topk(config, **kwargs)
                choice = _selection_values(logits, "sqrtsoftplus", bias)
                _check(got, router_topk_ref(config, **kwargs), choice, topk, n_valid)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("num_rows", [1, 24, 37])
def test_partials_source_and_logits_out(num_rows: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(num_rows * 5 + splits)
    partials = (torch.randn(splits, num_rows, 384, generator=gen) * 0.7).to(DEVICE)
    bias = _random_bias(384, "randn", gen)
    n_valid = torch.tensor([num_rows - 1], dtype=torch.int32, device=DEVICE)
    logits_out = torch.full((num_rows, 384), float("nan"), device=DEVICE)
    got = router_topk(
        RouterConfig(6),
        partials=partials,
        correction_bias=bias,
        n_valid=n_valid,
        logits_out=logits_out,
    )
    ref_logits = torch.empty_like(logits_out)
    ref = router_topk_ref(
        RouterConfig(6),
        partials=partials,
        correction_bias=bias,
        n_valid=n_valid,
        logits_out=ref_logits,
    )
    assert torch.equal(logits_out, ref_logits)  # fixed-order fp32 sum: exact
    _check(got, ref, _selection_values(ref_logits, "sqrtsoftplus", bias), 6, n_valid)


def _grid_exact_inputs(
    rows: int, hidden: int, experts: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values on a coarse binary grid: every partial sum is exact in fp32, so the GEMV equals
    the reference whatever its summation order."""
    x = torch.randint(-4, 5, (rows, hidden), generator=gen).float() / 8
    w = torch.randint(-4, 5, (experts, hidden), generator=gen).float() / 256
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


@pytest.mark.parametrize(
    "num_rows,hidden,dtype",
    [
        (1, 64, torch.bfloat16),
        (1, 64, torch.float32),
        (16, 1000, torch.bfloat16),
        (17, 1100, torch.float32),
        (37, 96, torch.bfloat16),
    ],
)
def test_x_source_split_k(num_rows: int, hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_rows * 3 + hidden)
    x, gate = _grid_exact_inputs(num_rows, hidden, 384, dtype, gen)
    bias = _random_bias(384, "randn", gen)
    workspace = make_router_workspace(64, 384, hidden, DEVICE)
    n_valid = torch.tensor(num_rows, dtype=torch.int32, device=DEVICE)
    for scoring in ("sqrtsoftplus", "sigmoid"):
        logits_out = torch.full((num_rows, 384), float("nan"), device=DEVICE)
        config = RouterConfig(6, scoring, routed_scaling_factor=1.25)
        kwargs = dict(x=x, gate_weight=gate, correction_bias=bias, n_valid=n_valid)
        got = router_topk(config, logits_out=logits_out, workspace=workspace, **kwargs)
        ref_logits = torch.empty_like(logits_out)
        ref = router_topk_ref(config, logits_out=ref_logits, **kwargs)
        assert torch.equal(logits_out, ref_logits)
        _check(got, ref, _selection_values(ref_logits, scoring, bias), 6, n_valid)
        # The last program of each row block leaves its counter at zero for the next launch.
        assert int(workspace.counters.abs().sum()) == 0


@pytest.mark.parametrize("num_rows", [0, 1, 8, 9, 24])
def test_x_source_dsv4_hidden_fused_and_two_launch(num_rows: int) -> None:
    # H = 4096 -> S = 8 splits; by default rows <= 8 take the fused last-program path, 9 and 24
    # the second routing launch.
    gen = torch.Generator().manual_seed(4096 + num_rows)
    x, gate = _grid_exact_inputs(num_rows, 4096, 384, torch.bfloat16, gen)
    bias = _random_bias(384, "randn", gen)
    workspace = make_router_workspace(32, 384, 4096, DEVICE)
    workspace.partials.fill_(float("nan"))  # poison: every partial the kernel reads it wrote
    n_valid = torch.tensor(max(num_rows - 2, 0), dtype=torch.int32, device=DEVICE)
    logits_out = torch.full((num_rows, 384), float("nan"), device=DEVICE)
    config = RouterConfig(6, num_shared=1, routed_scaling_factor=2.5, fill_id=-1)
    kwargs = dict(x=x, gate_weight=gate, correction_bias=bias, n_valid=n_valid)
    got = router_topk(config, logits_out=logits_out, workspace=workspace, **kwargs)
    ref_logits = torch.empty_like(logits_out)
    ref = router_topk_ref(config, logits_out=ref_logits, **kwargs)
    assert torch.equal(logits_out, ref_logits)
    _check(got, ref, _selection_values(ref_logits, "sqrtsoftplus", bias), 6, n_valid)
    assert int(workspace.counters.abs().sum()) == 0


def _x_call(
    num_rows: int,
    experts: int,
    gen: torch.Generator,
    exact: bool = True,
    scoring: str = "sqrtsoftplus",
    bias: bool = True,
    num_shared: int = 1,
    pad: int = 2,
) -> tuple[RouterConfig, dict]:
    """One x-source call at H 600 (S = 2 splits, the second ragged): config and kwargs, the
    workspace poisoned (every partial read must be written by the call)."""
    if exact:
        x, gate = _grid_exact_inputs(num_rows, 600, experts, torch.bfloat16, gen)
    else:  # arbitrary bf16 values: the summation order shows in the logits' bits
        x = torch.randn(num_rows, 600, generator=gen).to(torch.bfloat16).to(DEVICE)
        gate = (torch.randn(experts, 600, generator=gen) * 0.05).to(torch.bfloat16).to(DEVICE)
    workspace = make_router_workspace(max(num_rows, 1), experts, 600, DEVICE)
    workspace.partials.fill_(float("nan"))
    config = RouterConfig(
        6, scoring, routed_scaling_factor=2.5, num_shared=num_shared, shared_id_base=500, fill_id=-1
    )
    kwargs = dict(
        x=x,
        gate_weight=gate,
        workspace=workspace,
        correction_bias=_random_bias(experts, "randn", gen) if bias else None,
        n_valid=torch.tensor(max(num_rows - pad, 0), dtype=torch.int32, device=DEVICE),
    )
    return config, kwargs


@pytest.mark.parametrize("num_rows", [1, 2, 5, 8, 9, 17, 33])
def test_x_source_row_counts(num_rows: int) -> None:
    # E = 200: a partial last expert tile and a half-masked routing chunk; the options rotate
    # with M (both scorings, with / without bias, 0-2 shared columns, padded rows).
    gen = torch.Generator().manual_seed(200 + num_rows)
    scoring = ("sqrtsoftplus", "sigmoid")[num_rows % 2]
    config, kwargs = _x_call(
        num_rows,
        200,
        gen,
        scoring=scoring,
        bias=num_rows % 3 != 0,
        num_shared=num_rows % 3,
        pad=num_rows // 3,
    )
    logits_out = torch.full((num_rows, 200), float("nan"), device=DEVICE)
    got = router_topk(config, logits_out=logits_out, **kwargs)
    ref_logits = torch.empty_like(logits_out)
    ref = router_topk_ref(config, logits_out=ref_logits, **kwargs)
    assert torch.equal(logits_out, ref_logits)
    choice = _selection_values(ref_logits, scoring, kwargs["correction_bias"])
    _check(got, ref, choice, 6, kwargs["n_valid"])
    assert int(kwargs["workspace"].counters.abs().sum()) == 0


@pytest.mark.parametrize(
    "num_rows,names",
    [
        (5, list(sweep_router.CANDIDATES)),  # every shape the sweep may pick
        (20, ["fused tail4", "fused tail8", "2-launch r1w1", "2-launch r4w4"]),  # two row blocks
    ],
)
def test_route_meta_candidates_bit_identical(num_rows: int, names: list[str]) -> None:
    # The launch shape changes no bit (ids, weights, logits) whatever it is: the sweep times
    # these candidates on a GPU with the same check.
    gen = torch.Generator().manual_seed(num_rows)
    config, kwargs = _x_call(num_rows, 130, gen, exact=False)  # 9 expert tiles, 2 chunks
    inputs = dict(config=config, **kwargs)
    assert sweep_router.verify_candidates(inputs, names) == []
    # The check itself sees a one-ulp difference.
    ids, weights, logits = sweep_router.run_with_logits(inputs)
    bumped = (weights.view(torch.int32) + 1).view(torch.float32)
    assert sweep_router.same_outputs((ids, weights, logits), (ids, weights, logits))
    assert not sweep_router.same_outputs((ids, weights, logits), (ids, bumped, logits))


def test_logits_independent_of_batch() -> None:
    # Arbitrary bf16 inputs (summation order matters): a row routed alone, or inside batches
    # taking the fused (5 rows) and two-launch (17, 33 rows) paths, in other row blocks, gets the
    # same logits, ids and weights bit for bit. Rows that move within their 16-row GEMV tile are
    # checked on a GPU only: the interpreter's dot is numpy's matmul, whose result for a row
    # depends on its place in the tile (an MMA's does not).
    gen = torch.Generator().manual_seed(33)
    config, kwargs = _x_call(33, 200, gen, exact=False, pad=0)
    whole = sweep_router.run_with_logits(dict(config=config, **kwargs))
    assert not torch.isnan(whole[2]).any()
    shifted = [(7, 24), (5, 6), (20, 22)] if ON_GPU else []
    for lo, hi in [(0, 1), (16, 17), (32, 33), (0, 5), (0, 17), *shifted]:
        sub = dict(kwargs, x=kwargs["x"][lo:hi].contiguous(), n_valid=None)
        part = sweep_router.run_with_logits(dict(config=config, **sub))
        assert sweep_router.same_outputs(tuple(t[lo:hi] for t in whole), part), (lo, hi)

    def make_inputs(num_rows: int, device: str) -> dict:
        config, kwargs = _x_call(num_rows, 130, torch.Generator().manual_seed(1), exact=False)
        return dict(config=config, **kwargs)

    # The sweep's own GPU check of the same property (prefixes of the largest batch).
    assert sweep_router.logits_invariant(make_inputs, (1, 5, 17), DEVICE)


@pytest.mark.parametrize("chains", [1, 2])
def test_gemv_chain_variants(chains: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The GEMV chain counts the sweep times (4 is the default, covered everywhere else).
    monkeypatch.setattr(moe_route, "_GEMV_CHAINS", chains)
    gen = torch.Generator().manual_seed(chains)
    config, kwargs = _x_call(6, 200, gen)
    logits_out = torch.full((6, 200), float("nan"), device=DEVICE)
    got = router_topk(config, logits_out=logits_out, **kwargs)
    ref_logits = torch.empty_like(logits_out)
    ref = router_topk_ref(config, logits_out=ref_logits, **kwargs)
    assert torch.equal(logits_out, ref_logits)
    _check(
        got,
        ref,
        _selection_values(ref_logits, "sqrtsoftplus", kwargs["correction_bias"]),
        6,
        kwargs["n_valid"],
    )


@triton.jit
def _sqrt_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, route_rows._sqrt_rn(x), mask=offs < n)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on 0, inf, NaN, negatives
def test_branchless_sqrt() -> None:
    # The GPU path's sqrt_rn (sqrt.rn's fast path, small inputs scaled into it): exact on a GPU;
    # the interpreter's rsqrt and fma round twice, so within 1 ulp there. Zeros, infinities and
    # NaNs (the values kept out of the fast path) exact everywhere.
    gen = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -1.0, -float("inf")])
    x = torch.cat(
        [
            special,
            torch.tensor([1e-45, 1e-38, 2.0**-100, 2.0**-101, 3.0e38, 20.0, 2.0]),
            torch.rand(3000, generator=gen) * 30,
            torch.exp(torch.randn(3000, generator=gen) * 25),
        ]
    ).to(DEVICE)
    out = torch.full_like(x, 7.0)
    _sqrt_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = torch.sqrt(x)
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    ok = ~torch.isnan(want)
    gap = (out[ok].view(torch.int32) - want[ok].view(torch.int32)).abs()
    assert int(gap.max()) <= (0 if ON_GPU else 1)
    assert torch.equal(
        out[: len(special)][ok[: len(special)]].view(torch.int32),
        want[: len(special)][ok[: len(special)]].view(torch.int32),
    )


@pytest.mark.parametrize("splits,num_rows", [(9, 13), (16, 5), (2, 33)])
def test_partials_source_split_counts(splits: int, num_rows: int) -> None:
    # S * rows-per-tile is bounded (8 rows up to S = 8, 4 rows for S = 9..16, ...).
    gen = torch.Generator().manual_seed(splits * 100 + num_rows)
    partials = (torch.randn(splits, num_rows, 384, generator=gen) * 0.5).to(DEVICE)
    n_valid = torch.tensor(num_rows - 1, dtype=torch.int32, device=DEVICE)
    logits_out = torch.full((num_rows, 384), float("nan"), device=DEVICE)
    got = router_topk(RouterConfig(6), partials=partials, n_valid=n_valid, logits_out=logits_out)
    ref_logits = torch.empty_like(logits_out)
    ref = router_topk_ref(
        RouterConfig(6), partials=partials, n_valid=n_valid, logits_out=ref_logits
    )
    assert torch.equal(logits_out, ref_logits)
    _check(got, ref, _selection_values(ref_logits, "sqrtsoftplus", None), 6, n_valid)


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_rows", [1, 6, 37])
def test_hash_routing(num_rows: int, table_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    vocab = 1000
    tid2eid = torch.randint(0, 384, (vocab, 6), generator=gen).to(table_dtype).to(DEVICE)
    input_ids = torch.randint(0, vocab, (num_rows,), generator=gen).to(DEVICE)
    logits = _random_logits(num_rows, 384, "randn", gen)
    n_valid = torch.tensor(num_rows - 1, dtype=torch.int32, device=DEVICE)
    for scoring in ("sqrtsoftplus", "sigmoid"):
        config = RouterConfig(6, scoring, routed_scaling_factor=1.5)
        kwargs = dict(logits=logits, tid2eid=tid2eid, input_ids=input_ids, n_valid=n_valid)
        got = router_topk(config, **kwargs)
        ref = router_topk_ref(config, **kwargs)
        _check(got, ref, None, 6)
        valid = got.ids[: num_rows - 1]
        assert torch.equal(valid.long(), tid2eid[input_ids[: num_rows - 1]].long())
    # The runtime's hash layers route from x: fused (<= 8 rows) or two launches.
    x, gate = _grid_exact_inputs(num_rows, 96, 384, torch.float32, gen)
    kwargs = dict(x=x, gate_weight=gate, tid2eid=tid2eid, input_ids=input_ids, n_valid=n_valid)
    config = RouterConfig(6, routed_scaling_factor=1.5, num_shared=1, fill_id=-1)
    _check(router_topk(config, **kwargs), router_topk_ref(config, **kwargs), None, 6)
    # From split-K partials: the gathered logits are summed in split order, as the full path.
    partials = torch.randn(3, num_rows, 384, generator=gen).to(DEVICE)
    kwargs = dict(partials=partials, tid2eid=tid2eid, input_ids=input_ids, n_valid=n_valid)
    _check(router_topk(config, **kwargs), router_topk_ref(config, **kwargs), None, 6)
    # A padding row's token id may be anything (a stale slot): it reads in bounds, gets filled.
    garbage = input_ids.clone()
    garbage[num_rows - 1] = -7 if num_rows % 2 else 10**6
    got = router_topk(config, **{**kwargs, "input_ids": garbage})
    _check(got, router_topk_ref(config, **kwargs), None, 6)
    assert got.ids[num_rows - 1].tolist() == [-1] * 7
    with pytest.raises(ValueError, match="logits_out"):
        router_topk(config, **kwargs, logits_out=torch.empty(num_rows, 384, device=DEVICE))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: exp2 overflow, inf / inf
@pytest.mark.parametrize("experts", [72, 384])  # BLOCK_E 128, 512: the row tile's tail masked
@pytest.mark.parametrize("num_rows", [0, 1, 5, 33])
def test_hash_routing_from_logits_row(
    num_rows: int, experts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hash routing from logits: bit for bit what the one-split partials path gives, whatever
    # the expert count (non-power-of-two E masks the routing tile's tail). Logits (k / 8)^2 > 20 score exactly k / 8 (torch's
    # CPU sqrt is not always correctly rounded): the reference is exact too. Row 0: NaN at a picked
    # expert, +inf at one not picked; row 1 the reverse (renormalised: a NaN weight, as the ref).
    empty = torch.empty  # poisoned outputs: the kernel must write every element
    monkeypatch.setattr(
        moe_route.torch,
        "empty",
        lambda *a, **k: empty(*a, **k).fill_(
            float("nan") if k.get("dtype") == torch.float32 else -7
        ),
    )
    gen, vocab, pad = torch.Generator().manual_seed(num_rows + experts), 300, min(2, num_rows // 2)
    tid2eid = torch.randint(0, experts, (vocab, 6), generator=gen, dtype=torch.int32)
    ids = torch.randint(0, vocab, (num_rows,), generator=gen)
    logits = (torch.randint(37, 97, (num_rows, experts), generator=gen).float() / 8) ** 2
    for row, (hit, miss) in list(enumerate([(torch.nan, torch.inf), (torch.inf, torch.nan)]))[
        :num_rows
    ]:
        logits[row, tid2eid[ids[row], 0]] = hit
        logits[row, next(e for e in range(experts) if e not in tid2eid[ids[row]])] = miss
    stale = torch.cat([ids[: num_rows - pad], torch.tensor([-5, vocab + 3])[:pad]])  # pad rows
    base = dict(
        tid2eid=tid2eid.to(DEVICE),
        n_valid=torch.tensor(num_rows - pad, dtype=torch.int32, device=DEVICE),
    )
    for renorm, lg in [
        (r, x) for r in (True, False) for x in (logits, torch.randn(logits.shape, generator=gen))
    ]:
        config = RouterConfig(
            6, renormalize=renorm, routed_scaling_factor=1.5, num_shared=1, fill_id=-1
        )
        got = router_topk(config, input_ids=stale.to(DEVICE), logits=lg.to(DEVICE), **base)
        old = router_topk(config, input_ids=stale.to(DEVICE), partials=lg[None].to(DEVICE), **base)
        want = router_topk_ref(config, input_ids=ids.to(DEVICE), logits=lg.to(DEVICE), **base)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.ids, old.ids)
        assert torch.equal(got.weights.view(torch.int32), old.weights.view(torch.int32))
        torch.testing.assert_close(
            got.weights, want.weights, rtol=0 if lg is logits else RTOL, atol=0, equal_nan=True
        )
        if lg is logits:
            assert bool(torch.isnan(got.weights).any()) == (renorm and num_rows > 1)
            assert got.weights[:1, 0].eq(0).all() and got.ids[num_rows - pad :].eq(-1).all()


def test_hand_derived_ties_and_padding() -> None:
    # Row 0: all logits equal, no bias -> experts 0..3, weights 1/4 each (times scale 2).
    # Row 1: experts 5 and 2 share the top value, 7 is next -> [2, 5, 7, 0] (ties: lower id first).
    # Rows 2, 3 are padding (n_valid = 2): fill id 9, weight 0.
    logits = torch.zeros(4, 8, device=DEVICE)
    logits[1] = torch.tensor([-9.0, -9.0, 3.0, -9.0, -9.0, 3.0, -9.0, 1.0])
    logits[2:] = 5.0
    n_valid = torch.tensor(2, dtype=torch.int32, device=DEVICE)
    config = RouterConfig(4, routed_scaling_factor=2.0, fill_id=9)
    got = router_topk(config, logits=logits, n_valid=n_valid)
    assert got.ids.tolist() == [[0, 1, 2, 3], [2, 5, 7, 0], [9] * 4, [9] * 4]
    torch.testing.assert_close(got.weights[0], torch.full((4,), 0.5, device=DEVICE))
    assert float(got.weights[2:].abs().sum()) == 0.0
    # A bias flips the order of the tied pair: selection uses scores + bias, weights do not.
    bias = torch.zeros(8, device=DEVICE)
    bias[5] = 0.5
    got = router_topk(RouterConfig(2, renormalize=False), logits=logits[1:2], correction_bias=bias)
    assert got.ids.tolist() == [[5, 2]]
    assert got.weights[0, 0].item() == got.weights[0, 1].item()  # unbiased scores, equal


def test_m0_and_bad_inputs() -> None:
    empty = router_topk(RouterConfig(6, num_shared=1), logits=torch.empty(0, 384, device=DEVICE))
    assert empty.ids.shape == (0, 7) and empty.weights.shape == (0, 7)
    logits = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="scoring"):
        RouterConfig(2, "softmax")
    with pytest.raises(ValueError, match="topk"):
        RouterConfig(0)
    with pytest.raises(ValueError, match="exactly one"):
        router_topk(RouterConfig(2), logits=logits, partials=logits[None])
    with pytest.raises(ValueError, match="n_valid"):
        router_topk(RouterConfig(2), logits=logits, n_valid=torch.tensor(1, device=DEVICE))
    with pytest.raises(ValueError, match="topk"):
        router_topk(RouterConfig(17), logits=logits)
    with pytest.raises(ValueError, match="tid2eid"):
        router_topk(
            RouterConfig(2),
            logits=logits,
            tid2eid=torch.zeros(9, 3, dtype=torch.int32, device=DEVICE),
            input_ids=torch.zeros(2, dtype=torch.int32, device=DEVICE),
        )


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_rows", [4, 24])  # fused last-program path, two-launch path
def test_cuda_graph_replay_matches_eager(num_rows: int) -> None:
    gen = torch.Generator().manual_seed(7)
    x, gate = _grid_exact_inputs(num_rows, 4096, 384, torch.bfloat16, gen)
    bias = _random_bias(384, "randn", gen)
    n_valid = torch.tensor(num_rows - 2, dtype=torch.int32, device=DEVICE)
    workspace = make_router_workspace(32, 384, 4096, DEVICE)
    config = RouterConfig(6, num_shared=1)
    kwargs = dict(x=x, gate_weight=gate, correction_bias=bias, n_valid=n_valid, workspace=workspace)
    eager = router_topk(config, **kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = router_topk(config, **kwargs)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.ids, eager.ids) and torch.equal(captured.weights, eager.weights)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("source,num_rows", [("logits", 5), ("x", 3), ("x", 20), ("hash", 6)])
def test_gate_temperature(source: str, num_rows: int, scoring: str) -> None:
    """DeepSeek-V4.1's router temperature: the fp32 logits divided by it before scoring (the
    selection and the weights follow the divided logits; `logits_out` keeps them undivided)."""
    gen = torch.Generator().manual_seed(num_rows * 3 + len(source))
    experts, hidden, temp = 24, 48, 1.7
    config = RouterConfig(3, scoring, routed_scaling_factor=1.5, num_shared=1, gate_temp=temp)
    kwargs: dict = {}
    if source == "logits":
        kwargs["logits"] = _random_logits(num_rows, experts, "randn", gen)
    else:
        kwargs["x"] = torch.randn(num_rows, hidden, generator=gen).to(DEVICE)
        kwargs["gate_weight"] = (torch.randn(experts, hidden, generator=gen) * 0.3).to(DEVICE)
    if source == "hash":
        kwargs["input_ids"] = torch.randint(0, 50, (num_rows,), generator=gen).to(DEVICE)
        kwargs["tid2eid"] = torch.randint(0, experts, (50, 3), generator=gen).to(DEVICE)
    else:
        kwargs["correction_bias"] = _random_bias(experts, "randn", gen)
    got = router_topk(config, **kwargs)
    ref = router_topk_ref(config, **kwargs)
    if source == "hash":
        _check(got, ref, None, 3)
        return
    logits = kwargs.get("logits")
    if logits is None:
        logits = kwargs["x"].float() @ kwargs["gate_weight"].float().t()
    choice = _selection_values(logits / temp, scoring, kwargs["correction_bias"])
    _check(got, ref, choice, 3)
    plain = router_topk_ref(
        RouterConfig(3, scoring, routed_scaling_factor=1.5, num_shared=1), **kwargs
    )
    assert not torch.equal(plain.weights, ref.weights)  # the temperature changes the weights
