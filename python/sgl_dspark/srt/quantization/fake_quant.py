"""DeepSeek-V4.1's activation quantisers as the model uses them: FP8 window KV, FP4 latents with
E4M3 scales, FP4 indexer queries and keys with exponent scales. The definitions (and the packed
forms the caches store) are the kernels' reference, `kernels/quant/reference.py`; this module
gives the runtime their names.
"""

from __future__ import annotations

from sgl_dspark.kernels.quant.reference import (
    FP4_MAX,
    FP8_MAX,
    INDEX_BLOCK,
    LATENT_BLOCK,
    WINDOW_BLOCK,
    Fp4Rows,
    Fp8Rows,
    quantizes,
)
from sgl_dspark.kernels.quant.reference import dequantize_fp4_index_ref as dequantize_fp4_index
from sgl_dspark.kernels.quant.reference import dequantize_fp4_latent_ref as dequantize_fp4_latent
from sgl_dspark.kernels.quant.reference import dequantize_fp8_window_ref as dequantize_fp8_window
from sgl_dspark.kernels.quant.reference import fake_quant_fp4_index_ref as fake_quant_fp4_index
from sgl_dspark.kernels.quant.reference import fake_quant_fp4_latent_ref as fake_quant_fp4_latent
from sgl_dspark.kernels.quant.reference import fake_quant_fp8_window_ref as fake_quant_fp8_window
from sgl_dspark.kernels.quant.reference import quant_load_ref as quant_load
from sgl_dspark.kernels.quant.reference import quantize_fp4_index_ref as quantize_fp4_index
from sgl_dspark.kernels.quant.reference import quantize_fp4_latent_ref as quantize_fp4_latent
from sgl_dspark.kernels.quant.reference import quantize_fp8_window_ref as quantize_fp8_window

__all__ = [
    "FP4_MAX",
    "FP8_MAX",
    "INDEX_BLOCK",
    "LATENT_BLOCK",
    "WINDOW_BLOCK",
    "Fp4Rows",
    "Fp8Rows",
    "dequantize_fp4_index",
    "dequantize_fp4_latent",
    "dequantize_fp8_window",
    "fake_quant_fp4_index",
    "fake_quant_fp4_latent",
    "fake_quant_fp8_window",
    "quant_load",
    "quantize_fp4_index",
    "quantize_fp4_latent",
    "quantize_fp8_window",
    "quantizes",
]
