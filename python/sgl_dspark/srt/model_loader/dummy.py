"""Seeded random weights generated on the device (`--load-format dummy`), in the formats a
checkpoint of the config would declare: with a `quantization_config`, routed experts in the
expert dtype (MXFP4 or FP8), the released FP8 projections as FP8 with the config's block
size and V4.1's Engram tables as FP8 rows scaled per 32 channels; everything else dense. A model too large to be written and read back (a benchmark model of
a real size) then loads in seconds, with the bytes and kernels of the real one.

Values: quantised weights are uniform random codes (every E2M1 code; every E4M3 code but NaN)
with one power-of-two scale chosen for an RMS near 0.02; dense matrices N(0, 0.02); norm
weights and mHC scales 1; sinks, position biases, mHC biases and router biases 0; hash tables
uniform expert ids. A tensor's values depend only on `seed` and its name, so `dense()` and
`quantized()` of one tensor are the same numbers (dense = the codes dequantised).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
from torch import nn

from sgl_dspark.kernels.linear.reference import QuantizedWeight, dequantize_weight_ref
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.model_loader.sources import WeightFactory

# Parameters a released checkpoint stores in FP8 (V4 and V4.1 attention projections, the
# indexer's query projection, the shared expert, V4.1's Engram projection, DSpark's main
# projection).
_FP8_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_proj.weight",
    "self_attn.o_a_proj.weight",
    "self_attn.o_b_proj.weight",
    "indexer.q_b_proj.weight",
    "shared_experts.gate_proj.weight",
    "shared_experts.up_proj.weight",
    "shared_experts.down_proj.weight",
    "engram.wkv.weight",
    "main_proj.weight",
)
# Tables a released checkpoint stores as FP8 rows with one exponent byte per 32 channels
# (V4.1's Engram hash tables), whatever the projections' block size.
_FP8_TABLE_SUFFIXES = ("engram.embed.weight",)
_FP8_TABLE_GROUP = 32
_EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# E8M0 bytes giving an RMS near 0.02: uniform E2M1 codes have RMS 2.9 (x 2^-7), uniform E4M3
# codes about 120 (x 2^-13).
_MXFP4_SCALE_BYTE = 127 - 7
_FP8_SCALE_BYTE = 127 - 13
_STD = 0.02


class DummyTensor:
    """One random tensor (`model_executor/weights.py::LazyTensor`)."""

    def __init__(
        self, name: str, meta: torch.Tensor, fmt: str | None, group: int, seed: int, high: int
    ) -> None:
        self.name = name
        self.shape = tuple(meta.shape)
        self.fmt = fmt  # "fp8" / "fp4" (the checkpoint's names) or None
        self.group = group
        self.nbytes = meta.numel() * meta.element_size()
        self._dtype = meta.dtype
        self._seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        self._high = high  # integer tensors: values in [0, high)

    def _generator(self, device: torch.device | str) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self._seed)

    def quantized(self, device: torch.device | str) -> QuantizedWeight:
        assert self.fmt is not None, self.name
        g = self._generator(device)
        *lead, n, k = self.shape
        groups = -(-k // self.group)
        if self.fmt == "fp4":
            data = torch.randint(0, 256, (*lead, n, k // 2), generator=g, device=device)
            data = data.to(torch.uint8)
            scale_byte, fmt = _MXFP4_SCALE_BYTE, "mxfp4"
        else:
            codes = torch.randint(0, 256, (*lead, n, k), generator=g, device=device)
            codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN codes
            data = codes.to(torch.uint8).view(torch.float8_e4m3fn)
            scale_byte, fmt = _FP8_SCALE_BYTE, "fp8"
        scale = torch.full((*lead, n, groups), scale_byte, dtype=torch.uint8, device=device)
        return QuantizedWeight(data, scale, fmt, self.group)

    def dense(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt is not None:
            return dequantize_weight_ref(self.quantized(device), dtype)
        if not self._dtype.is_floating_point:
            if self._high <= 0:
                return torch.zeros(self.shape, dtype=self._dtype, device=device)
            g = self._generator(device)
            return torch.randint(0, self._high, self.shape, generator=g, device=device).to(
                self._dtype
            )
        name = self.name
        if name.endswith(("norm.weight", "scale", "hc_scale", "q_weight", "k_weight")) or (
            "layernorm" in name
        ):
            return torch.ones(self.shape, dtype=dtype, device=device)
        if name.endswith(("sinks", "position_bias", ".base", "hc_base", "correction_bias")):
            return torch.zeros(self.shape, dtype=dtype, device=device)
        out = torch.empty(self.shape, dtype=dtype, device=device)
        return out.normal_(0.0, _STD, generator=self._generator(device))


class DummyWeights(WeightFactory):
    """Random weights for the meta-built model of `cfg` (module doc)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, num_experts: int | None = None) -> None:
        self.cfg = cfg
        self.seed = seed
        self.num_experts = num_experts or cfg.n_routed_experts

    def _format(self, name: str) -> tuple[str | None, int]:
        quant = self.cfg.quantization
        if quant is None:
            return None, 1
        if name.endswith(_EXPERT_SUFFIXES):
            if quant.expert_dtype == "fp4":
                return "fp4", 32
            return "fp8", quant.weight_block_size[1]
        if name.endswith(_FP8_SUFFIXES):
            return "fp8", quant.weight_block_size[1]
        if name.endswith(_FP8_TABLE_SUFFIXES):
            return "fp8", _FP8_TABLE_GROUP
        return None, 1

    def for_model(self, model: nn.Module) -> Iterator[tuple[str, DummyTensor]]:
        state = model.state_dict(keep_vars=True)
        for name, meta in state.items():
            fmt, group = self._format(name)
            high = self.num_experts if name.endswith("tid2eid") else 0
            yield name, DummyTensor(name, meta, fmt, group, self.seed, high)


__all__ = ["DummyTensor", "DummyWeights"]
