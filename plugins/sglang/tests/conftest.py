"""Contract tests of the SGLang plugin: run in the plugin's own virtualenv (sglang 0.5.23, its
torch, the plugin and sglang-dspark installed; see ../run_contract_tests.sh), without a GPU.

Our Triton kernels run under the Triton interpreter on CPU tensors; it must be on before any
kernel module is imported."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
