"""Drive a ModelRunner request by request for model tests (no scheduler involved)."""

from __future__ import annotations

from pathlib import Path

import torch
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
from sgl_dspark.srt.models.source import resolve_model


class Driver:
    """Tracks committed lengths per request slot; `step` runs one flat batch."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.committed: dict[int, int] = {}

    def new_request(self) -> int:
        slot = self.runner.req_pool.alloc_slot()
        self.committed[slot] = 0
        return slot

    def step(
        self, mode: ForwardMode, work: list[tuple[int, list[int]]], commit: bool = True
    ) -> list[torch.Tensor]:
        """Run `work` = [(slot, new token ids)]; return per-request logits `[n_i, V]` for every
        new token. With commit=False the tokens are verified but not committed (rolled back)."""
        pool = self.runner.req_pool
        for slot, ids in work:
            pool.reserve(slot, self.committed[slot] + len(ids))
        batch = ForwardBatch.build(
            mode,
            [ids for _, ids in work],
            [self.committed[s] for s, _ in work],
            [s for s, _ in work],
            pool.req_to_token,
            logits_rows="all",
        )
        out = self.runner.forward(batch).logits
        res, start = [], 0
        for slot, ids in work:
            res.append(out[start : start + len(ids)])
            start += len(ids)
            if commit:
                self.committed[slot] += len(ids)
        return res

    def commit(self, slot: int, n: int) -> None:
        """Accept n more tokens of the last (uncommitted) verify of `slot`."""
        self.committed[slot] += n


def checkpoint_runner(path: Path, weight_format: str, overrides: str | None = None) -> ModelRunner:
    """A small runner over the checkpoint directory `path` loaded `--weight-format
    weight_format` (kernel families as `overrides` says, else torch)."""
    cfg, weights = resolve_model(str(path), torch.float32)
    rc = RunnerConfig(
        max_total_tokens=512,
        max_running_requests=2,
        context_length=64,
        kernel_backend_overrides=overrides,
        weight_format=weight_format,
    )
    return ModelRunner(cfg, rc, weights=weights)


def greedy_logits(
    runner: ModelRunner, prompt: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """One request: the prompt's last logits row, then `steps` greedy decode steps; the greedy
    tokens and every step's logits."""
    driver = Driver(runner)
    slot = driver.new_request()
    logits = driver.step(ForwardMode.EXTEND, [(slot, prompt)])[0][-1:]
    tokens, seen = [int(logits.argmax())], [logits]
    for _ in range(steps):
        logits = driver.step(ForwardMode.DECODE, [(slot, tokens[-1:])])[0]
        tokens.append(int(logits.argmax()))
        seen.append(logits)
    return tokens, seen
