"""DSpark greedy output equals target-only greedy output, token for token, for DeepSeek-V4 and
DeepSeek-V4.1 targets: the built-in pairs (`tiny`, `tiny-v41`) with every verify policy and
block sizes 1/3/5/7, and a random on-disk target with a draft written by the init tool; batch
sizes mixed (the bs-1 runtime included), requests ending mid-block on max_new_tokens or a stop
token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from spec_utils import (
    POLICIES,
    TOOL_DRAFT_POLICY_BATCHES,
    expected_outputs,
    lossless_requests,
    policy_kwargs,
    run_greedy,
    with_stop_tokens,
    write_policy_tables,
    write_random_draft,
    write_random_target,
    write_random_v41_target,
)

GAMMAS = (1, 3, 5, 7)


@dataclass(frozen=True)
class Target:
    """A target family: its built-in pair and request set, and a random on-disk target."""

    builtin: str
    vocab: int
    n_prompts: int
    batch_sizes: tuple[int, ...]
    write_disk_target: Callable[[str], str]
    disk_vocab: int
    tool_gammas: tuple[int, ...]


# V4.1 runs fewer prompts, batch sizes and tool-draft blocks: its forward costs more on a CPU.
TARGETS = {
    "v4": Target(
        "tiny",
        263,
        32,
        (1, 3, 8),
        lambda d: write_random_target(d, vocab_size=300, seed=4),
        300,
        GAMMAS,
    ),
    "v41": Target(
        "tiny-v41", 263, 16, (1, 4), lambda d: write_random_v41_target(d, seed=4), 263, (2, 6)
    ),
}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request) -> Target:
    return TARGETS[request.param]


@pytest.fixture(scope="module")
def tiny_case(target: Target):
    prompts, params = lossless_requests(target.n_prompts, 0, target.vocab)
    ref = run_greedy(prompts, params, model_path=target.builtin)
    params = with_stop_tokens(ref, params)
    return prompts, params, expected_outputs(ref, params)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("policy", POLICIES)
def test_builtin_pair_greedy_lossless(target, tiny_case, tmp_path, gamma, policy):
    prompts, params, expected = tiny_case
    tables = write_policy_tables(str(tmp_path), gamma)
    for bs in target.batch_sizes:
        got = run_greedy(
            prompts,
            params,
            model_path=target.builtin,
            max_running_requests=bs,
            speculative_algorithm="DSpark",
            speculative_dspark_block_size=gamma,
            **policy_kwargs(policy, tables),
        )
        assert got == expected, f"bs={bs}"


@pytest.fixture(scope="module")
def disk_target(target: Target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_disk")
    path = target.write_disk_target(str(root / "target"))
    prompts, params = lossless_requests(target.n_prompts, 1, target.disk_vocab)
    ref = run_greedy(prompts, params, model_path=path)
    params = with_stop_tokens(ref, params)
    return root, path, prompts, params, expected_outputs(ref, params)


@pytest.mark.parametrize(
    "target,gamma",
    [(name, g) for name, t in sorted(TARGETS.items()) for g in t.tool_gammas],
    indirect=["target"],
)
def test_tool_draft_greedy_lossless(target, disk_target, gamma):
    root, path, prompts, params, expected = disk_target
    draft = write_random_draft(path, str(root / f"draft_{gamma}"), block_size=gamma)
    tables = write_policy_tables(str(root), gamma)
    for policy, bs in TOOL_DRAFT_POLICY_BATCHES:
        got = run_greedy(
            prompts,
            params,
            model_path=path,
            max_running_requests=bs,
            speculative_algorithm="dspark",
            speculative_draft_model_path=draft,
            **policy_kwargs(policy, tables),
        )
        assert got == expected, f"policy={policy} bs={bs}"
