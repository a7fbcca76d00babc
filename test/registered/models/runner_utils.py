"""Drive a ModelRunner request by request for model tests (no scheduler involved)."""

from __future__ import annotations

import torch
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.model_executor.model_runner import ModelRunner


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
