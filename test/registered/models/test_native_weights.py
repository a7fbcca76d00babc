"""Weights kept as stored (`--weight-format native`) against the same checkpoint dequantised at
load (`--weight-format bf16`), on a tiny DeepSeek-V4 saved quantised as released: dense
projections FP8 with 32 x 32 block scales, routed experts MXFP4 (or FP8, which lets the shared
expert fold into the experts' stacks).

* torch kernels: the torch path dequantises per call to the very weights the bf16 format loads,
  so the logits are the same bits and so is every greedy token.
* Triton linear + MoE kernels (the interpreter on CPU): the same greedy tokens; logits within
  LOGITS_TOL, since the quantised kernels sum their fp32 partials per scale group.
* Parameter bytes: routed experts <= 0.27x and FP8 projections <= 0.51x their bf16 size.
* Loading reads one stored part at a time: the peak host memory of a load (a subprocess, its
  RSS) stays within the packed model plus a few shards, far below one dequantised copy.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from runner_utils import checkpoint_runner, greedy_logits
from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.layers.quantized import is_quantized, module_weight
from sgl_dspark.srt.model_executor.weights import build_on_meta, load_report
from sgl_dspark.srt.model_loader.export import save_released_checkpoint
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, tiny_weights

pytestmark = [  # the Triton interpreter's numpy calls (see test_moe_grouped_gemm.py)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

# fp32 activations: the quantised kernels' per-group fp32 sums against the BLAS / bf16 kernels.
LOGITS_TOL = dict(rtol=1e-4, atol=1e-4)
PROMPT = [5, 77, 19, 300, 4, 61]
DECODE_STEPS = 2
_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}


def _save(tmp: Path, expert_dtype: str, raw: dict, max_shard_bytes: int | None = None) -> Path:
    cfg = ModelConfig.from_hf_dict({**raw, "quantization_config": _QUANT})
    model = build_on_meta(lambda: DeepseekV4ForCausalLM(cfg))
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    state = dict(tiny_weights(cfg, shapes, seed=3))
    out = tmp / f"tiny_{expert_dtype}"
    save_released_checkpoint(state, cfg, str(out), True, expert_dtype, max_shard_bytes)
    return out


@pytest.fixture(scope="module", params=["fp4", "fp8"])
def checkpoint(request, tmp_path_factory) -> tuple[Path, str]:
    return _save(tmp_path_factory.mktemp("native"), request.param, TINY_HF_CONFIG), request.param


def test_torch_native_equals_bf16_bit_for_bit(checkpoint: tuple[Path, str]) -> None:
    path, _ = checkpoint
    native, dense = checkpoint_runner(path, "native"), checkpoint_runner(path, "bf16")
    assert is_quantized(native.model.model.layers[1].self_attn.q_a_proj)
    assert not is_quantized(dense.model.model.layers[1].self_attn.q_a_proj)
    tokens_n, logits_n = greedy_logits(native, PROMPT, DECODE_STEPS)
    tokens_d, logits_d = greedy_logits(dense, PROMPT, DECODE_STEPS)
    assert tokens_n == tokens_d
    for a, b in zip(logits_n, logits_d):
        assert torch.equal(a, b)


def test_triton_native_same_tokens(checkpoint: tuple[Path, str]) -> None:
    path, _ = checkpoint
    # The families that read the weights; the others stay torch (interpreter time).
    overrides = "linear=triton,moe=triton"
    native, dense = (
        checkpoint_runner(path, "native", overrides),
        checkpoint_runner(path, "bf16", overrides),
    )
    experts = native.model.model.layers[1].mlp.experts
    # The shared expert folds into the routed experts' stacks: FP8 experts share its format
    # and blocks (one stack); beside MXFP4 experts it stays FP8, their extra expert.
    assert experts.folded
    tokens_n, logits_n = greedy_logits(native, PROMPT, DECODE_STEPS)
    tokens_d, logits_d = greedy_logits(dense, PROMPT, DECODE_STEPS)
    assert tokens_n == tokens_d
    for a, b in zip(logits_n, logits_d):
        torch.testing.assert_close(a, b, **LOGITS_TOL)


def test_parameter_bytes(checkpoint: tuple[Path, str], caplog: pytest.LogCaptureFixture) -> None:
    path, expert_dtype = checkpoint
    with caplog.at_level(logging.INFO, logger="sgl_dspark.srt.model_executor"):
        runner = checkpoint_runner(path, "native")
    model = runner.model
    packed = {"experts": [0, 0], "dense": [0, 0]}  # [stored bytes, bf16 bytes]
    for module in model.modules():
        for name in ("weight", "gate_up_proj", "down_proj"):
            if is_quantized(module, name):
                w = module_weight(module, name)
                assert isinstance(w, QuantizedWeight)
                kind = "experts" if name != "weight" else "dense"
                packed[kind][0] += w.nbytes
                packed[kind][1] += 2 * torch.Size(w.shape).numel()
    experts, dense = (s / b for s, b in packed.values())
    assert dense <= 0.51, dense
    assert experts <= (0.27 if expert_dtype == "fp4" else 0.51), experts
    report = load_report(model)
    assert report["experts"] > 0 and report["dense"] > 0 and report["embeddings"] > 0
    # The routed experts as stored: their packed bytes and scales, nothing dequantised beside.
    assert report["experts"] == packed["experts"][0], (report, packed)
    # The runner logs what the device holds by kind, the KV pool included.
    assert runner.memory_report == {**report, "kv": runner.memory_report["kv"]}
    assert runner.memory_report["kv"] > 0
    line = next(r.getMessage() for r in caplog.records if "device memory" in r.getMessage())
    for kind in ("dense", "experts", "embeddings", "kv"):
        assert f"{kind} " in line, line


def test_load_peak_host_memory(tmp_path: Path) -> None:
    """A model whose routed experts are ~100 MB in fp32 (the old host copy), stored as MXFP4 in
    4 MB shards: loading it natively on the host raises the peak RSS by about the packed model
    (~15 MB) plus a shard, far below one dequantised copy."""
    raw = {
        **TINY_HF_CONFIG,
        "hidden_size": 256,
        "moe_intermediate_size": 256,
        "n_routed_experts": 64,
        "num_hidden_layers": 2,
        "layer_types": TINY_HF_CONFIG["layer_types"][:2],
        "mlp_layer_types": ["moe", "moe"],
    }
    path = _save(tmp_path, "fp4", raw, max_shard_bytes=4 * 2**20)
    packed_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
    script = textwrap.dedent(
        f"""
        import json, resource, torch
        from sgl_dspark.srt.configs.model_config import ModelConfig
        from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
        from sgl_dspark.srt.model_loader.loader import CheckpointWeights
        cfg = ModelConfig.from_pretrained({str(path)!r})
        weights = CheckpointWeights({str(path)!r}, cfg)
        rc = RunnerConfig(max_total_tokens=64, max_running_requests=1, context_length=32,
                          weight_format="native")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        runner = ModelRunner(cfg, rc, weights=weights)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"peak_mb": (after - before) / 1024}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "python")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]
    dequantised_mb = 2 * 64 * 3 * 256 * 256 * 4 / 2**20  # the experts in fp32: 96 MB
    assert peak < packed_mb + 30, (peak, packed_mb)
    assert peak < dequantised_mb / 2, (peak, dequantised_mb)
