"""Fit DSpark STS temperatures from collected confidence shards.

    python -m sgl_dspark.tools.dspark_sts_fit --data-glob '<stem>.*.pt' --out sts.json \
        [--num-bins 15] [--gamma G] [--dataset NAME]

Each shard is a ``torch.save``d dict with ``raw`` [n, gamma] (raw confidence logits collected
with identity temperatures) and ``prefix_mask`` [n, gamma] (1 for positions inside the prefix of
drafts that matched the target). The output is the STS JSON of `srt/speculative/dspark/sts.py`.
"""

from __future__ import annotations

import argparse
import glob
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from sgl_dspark.srt.speculative.dspark.sts import NUM_ECE_BINS, StsCalibration, fit_sts

logger = logging.getLogger(__name__)


def load_shards(pattern: str, gamma: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate every shard matching ``pattern`` -> (raw [N, gamma] fp32, prefix_mask [N, gamma])."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise ValueError(f"--data-glob {pattern!r} matches no file")
    raws: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for path in paths:
        shard = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(shard, dict) or "raw" not in shard or "prefix_mask" not in shard:
            raise ValueError(f"{path}: shard must be a dict with 'raw' and 'prefix_mask' tensors")
        raw, mask = shard["raw"], shard["prefix_mask"]
        if raw.dim() != 2 or raw.shape != mask.shape:
            raise ValueError(
                f"{path}: 'raw' {tuple(raw.shape)} and 'prefix_mask' {tuple(mask.shape)} "
                "must both be [n, gamma]"
            )
        if gamma is not None and raw.shape[1] != gamma:
            raise ValueError(f"{path}: shard has gamma {raw.shape[1]}, --gamma is {gamma}")
        if raws and raw.shape[1] != raws[0].shape[1]:
            raise ValueError(
                f"{path}: gamma {raw.shape[1]} differs from earlier shards ({raws[0].shape[1]})"
            )
        raws.append(raw.float())
        masks.append(mask.float())
    logger.info("loaded %d shards (%d samples)", len(paths), sum(r.shape[0] for r in raws))
    return torch.cat(raws), torch.cat(masks)


def fit_from_glob(
    pattern: str, num_bins: int = NUM_ECE_BINS, gamma: int | None = None, dataset: str | None = None
) -> StsCalibration:
    raw, mask = load_shards(pattern, gamma)
    return fit_sts(
        raw, mask, num_bins=num_bins, dataset=dataset if dataset is not None else pattern
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data-glob", required=True, help="glob of .pt shards with raw/prefix_mask"
    )
    parser.add_argument("--out", required=True, help="output STS JSON path")
    parser.add_argument("--num-bins", type=int, default=NUM_ECE_BINS, help="ECE bins (default 15)")
    parser.add_argument("--gamma", type=int, default=None, help="expected draft block size")
    parser.add_argument("--dataset", default=None, help="dataset label stored in the JSON")
    args = parser.parse_args(argv)
    if args.num_bins < 1:
        parser.error("--num-bins must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    calib = fit_from_glob(args.data_glob, args.num_bins, args.gamma, args.dataset)
    calib.save(args.out)
    for k, (t, eb, ea) in enumerate(
        zip(calib.temperatures, calib.ece_before, calib.ece_after), start=1
    ):
        logger.info("position %d: T = %.4g  ECE %.4f -> %.4f", k, t, eb, ea)
    logger.info("wrote %s (%d samples)", Path(args.out), calib.num_samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
