"""Collect STS calibration data while serving: raw confidence logits and the
prefix labels (1 for positions before the first draft that differs from the target's argmax
chain), written as `<stem>.<i>.pt` shards for `python -m sgl_dspark.tools.dspark_sts_fit`.

Labels use greedy matching for every request, as the reference collector does; collect with the
`full` verify policy so that no position is censored by a narrow verify width.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

SHARD_STEPS = 256


class StsRecorder:
    def __init__(self, stem: str, gamma: int) -> None:
        self.stem = stem
        self.gamma = gamma
        self._raw: list[torch.Tensor] = []
        self._mask: list[torch.Tensor] = []
        self._steps = 0
        self._shards = 0

    def record(
        self,
        raw: torch.Tensor,
        verify_ids: torch.Tensor,
        logits: torch.Tensor,
        verify_lens: torch.Tensor,
    ) -> None:
        """raw `[B, gamma]`; verify_ids `[B, W]`; logits `[B, W, V]`; verify_lens `[B]`."""
        width = verify_ids.shape[1]
        match = verify_ids[:, 1:] == torch.argmax(logits, dim=-1)[:, : width - 1]
        match &= torch.arange(width - 1, device=match.device)[None, :] < (verify_lens - 1)[:, None]
        prefix = torch.cumprod(match.to(torch.int64), dim=1)
        mask = torch.zeros_like(raw, dtype=torch.float32)
        mask[:, : width - 1] = prefix.float()
        self._raw.append(raw.detach().float().cpu())
        self._mask.append(mask.cpu())
        self._steps += 1
        if self._steps % SHARD_STEPS == 0:
            self.flush()

    def flush(self) -> None:
        if not self._raw:
            return
        path = f"{self.stem}.{self._shards}.pt"
        torch.save({"raw": torch.cat(self._raw), "prefix_mask": torch.cat(self._mask)}, path)
        logger.info("wrote STS shard %s (%d rows)", path, sum(r.shape[0] for r in self._raw))
        self._shards += 1
        self._raw.clear()
        self._mask.clear()
