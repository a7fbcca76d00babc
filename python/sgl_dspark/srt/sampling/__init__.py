"""Per-request sampling parameters (the batched sampler lives in `srt/layers/sampler.py`)."""

from __future__ import annotations

from sgl_dspark.srt.sampling.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    TOP_K_OFF,
    SamplingParams,
)

__all__ = ["GREEDY_TEMPERATURE_EPS", "TOP_K_OFF", "SamplingParams"]
