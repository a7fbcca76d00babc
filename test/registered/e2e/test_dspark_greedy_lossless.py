"""DSpark greedy output equals target-only greedy output, token for token: built-in
tiny pair and a random draft written by the init tool for an on-disk target; every verify policy,
block sizes 1/3/5/7, batch sizes 1/3/8, requests ending mid-block on max_new_tokens or a stop
token."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark import Engine
from spec_utils import (
    POLICIES,
    policy_kwargs,
    write_policy_tables,
    write_random_draft,
    write_random_target,
)

GAMMAS = (1, 3, 5, 7)
N_PROMPTS = 32


def _requests(seed: int, vocab: int) -> tuple[list[list[int]], list[dict]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            7, vocab, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(N_PROMPTS)
    ]
    params = [
        {
            "temperature": 0.0,
            "ignore_eos": True,
            "max_new_tokens": int(torch.randint(1, 14, (1,), generator=g)),
        }
        for _ in range(N_PROMPTS)
    ]
    return prompts, params


def _run(engine_kwargs: dict, prompts, params) -> list[list[int]]:
    engine = Engine(device="cpu", skip_tokenizer_init=True, context_length=256, **engine_kwargs)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    pages = engine.runner.allocator
    assert pages.num_free_pages == pages.num_usable_pages  # every page came back
    return [o["output_ids"] for o in outs]


def _with_stop_tokens(reference: list[list[int]], params: list[dict]) -> list[dict]:
    """Every third request also stops on a token of its reference output (mid-block stop)."""
    out = []
    for i, (ref, p) in enumerate(zip(reference, params)):
        p = dict(p)
        if i % 3 == 0 and len(ref) > 2:
            p["stop_token_ids"] = [ref[len(ref) // 2]]
        out.append(p)
    return out


def _expected(reference: list[list[int]], params: list[dict]) -> list[list[int]]:
    exp = []
    for ref, p in zip(reference, params):
        stops = p.get("stop_token_ids", [])
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        exp.append(ref[:cut])
    return exp


@pytest.fixture(scope="module")
def tiny_case():
    prompts, params = _requests(0, 263)
    ref = _run({"model_path": "tiny"}, prompts, params)
    params = _with_stop_tokens(ref, params)
    return prompts, params, _expected(ref, params)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("policy", POLICIES)
def test_tiny_pair_greedy_lossless(tiny_case, tmp_path, gamma, policy):
    prompts, params, expected = tiny_case
    tables = write_policy_tables(str(tmp_path), gamma)
    for bs in (1, 3, 8):
        got = _run(
            {
                "model_path": "tiny",
                "max_running_requests": bs,
                "speculative_algorithm": "DSpark",
                "speculative_dspark_block_size": gamma,
                **policy_kwargs(policy, tables),
            },
            prompts,
            params,
        )
        assert got == expected, f"bs={bs}"


@pytest.fixture(scope="module")
def disk_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_disk")
    target = write_random_target(str(root / "target"), vocab_size=300, seed=4)
    prompts, params = _requests(1, 300)
    ref = _run({"model_path": target}, prompts, params)
    params = _with_stop_tokens(ref, params)
    return root, target, prompts, params, _expected(ref, params)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_tool_draft_greedy_lossless(disk_target, gamma):
    root, target, prompts, params, expected = disk_target
    draft = write_random_draft(target, str(root / f"draft_{gamma}"), block_size=gamma)
    tables = write_policy_tables(str(root), gamma)
    for policy, bs in (
        ("full", 3),
        ("static_table", 8),
        ("confidence_sync", 1),
        ("confidence_async", 8),
        ("static_online", 3),
    ):
        got = _run(
            {
                "model_path": target,
                "max_running_requests": bs,
                "speculative_algorithm": "dspark",
                "speculative_draft_model_path": draft,
                **policy_kwargs(policy, tables),
            },
            prompts,
            params,
        )
        assert got == expected, f"policy={policy} bs={bs}"
