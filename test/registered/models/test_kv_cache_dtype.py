"""`--kv-cache-dtype` for DeepSeek-V4's window KV, on the tiny model (fp32 runtime on CPU).

* fp8_e4m3: the pool holds E4M3 codes (1 byte a channel); every stored row is the row the
  runtime-dtype cache stores, saturated and rounded once (checked on the first layer, whose rows
  do not depend on attention); the torch and Triton attention read it back exactly, so they
  give the same greedy tokens, logits within the tolerance of their unquantised comparison.
* bfloat16: the pool holds bf16 rows read back in the runtime dtype.
* A model that defines its window storage (DeepSeek-V4.1: FP8) refuses another choice, and a
  bad choice is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from runner_utils import Driver
from sgl_dspark.srt.core.forward_batch import ForwardMode
from sgl_dspark.srt.mem_cache.kv_pool import DeepseekV4KVPool
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig
from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sgl_dspark.srt.models.tiny import tiny_config, tiny_weights
from sgl_dspark.srt.server_args import ServerArgs

pytestmark = [  # the Triton interpreter's numpy calls (see test_moe_grouped_gemm.py)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]

PROMPT = [5, 77, 19, 300, 4, 61, 8, 8, 140]
DECODE_STEPS = 3


def _runner(kv_cache_dtype: str, attention_backend: str = "torch") -> ModelRunner:
    cfg = tiny_config()
    shapes = [(k, tuple(v.shape)) for k, v in DeepseekV4ForCausalLM(cfg).state_dict().items()]
    rc = RunnerConfig(
        max_total_tokens=256,
        max_running_requests=2,
        context_length=64,
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention_backend,
    )
    return ModelRunner(cfg, rc, weights=tiny_weights(cfg, shapes, seed=5))


def _greedy(runner: ModelRunner) -> tuple[list[int], list[torch.Tensor], list[int]]:
    """(tokens, logits per step, the prompt's token slots)."""
    driver = Driver(runner)
    slot = driver.new_request()
    logits = driver.step(ForwardMode.EXTEND, [(slot, PROMPT)])[0][-1:]
    slots = runner.req_pool.req_to_token[slot, : len(PROMPT)].tolist()
    tokens, seen = [int(logits.argmax())], [logits]
    for _ in range(DECODE_STEPS):
        logits = driver.step(ForwardMode.DECODE, [(slot, tokens[-1:])])[0]
        tokens.append(int(logits.argmax()))
        seen.append(logits)
    return tokens, seen, slots


def test_fp8_window_stores_the_rows_quantised() -> None:
    auto, fp8 = _runner("auto"), _runner("fp8_e4m3")
    window = fp8.kv_pool.layers[0].window
    assert window.dtype == torch.float8_e4m3fn and fp8.window_kv_dtype == torch.float8_e4m3fn
    assert auto.kv_pool.layers[0].window.dtype == torch.float32
    cfg = fp8.model_cfg
    saved = DeepseekV4KVPool.bytes_per_token(cfg, torch.float32)
    assert saved - fp8._kv_bytes_per_token() == len(cfg.layer_types) * cfg.head_dim * 3
    _, logits_auto, slots = _greedy(auto)
    _, logits_fp8, slots_fp8 = _greedy(fp8)
    assert slots == slots_fp8
    rows = auto.kv_pool.layers[0].window[slots]
    assert rows.abs().max() > 0
    want = rows.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(window[slots].view(torch.uint8), want.view(torch.uint8))
    # FP8 keys change the attention a little, never into non-finite values.
    for a, b in zip(logits_auto, logits_fp8):
        assert torch.isfinite(b).all()
        assert not torch.equal(a, b)


def test_fp8_window_torch_and_triton_attention_agree() -> None:
    tokens_t, logits_t, _ = _greedy(_runner("fp8_e4m3", "torch"))
    tokens_k, logits_k, _ = _greedy(_runner("fp8_e4m3", "triton"))
    assert tokens_t == tokens_k
    for a, b in zip(logits_t, logits_k):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bf16_window_cache() -> None:
    runner = _runner("bfloat16")
    assert runner.kv_pool.layers[0].window.dtype == torch.bfloat16
    tokens, logits, slots = _greedy(runner)
    assert all(torch.isfinite(x).all() for x in logits)
    auto = _runner("auto")
    _greedy(auto)
    rows = auto.kv_pool.layers[0].window[slots]
    assert torch.equal(runner.kv_pool.layers[0].window[slots], rows.to(torch.bfloat16))


def test_bad_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        ServerArgs(model_path="tiny", kv_cache_dtype="fp8_e5m2")
    from sgl_dspark.srt.model_executor.model_runner import _window_kv_dtype

    with pytest.raises(ValueError, match="by definition"):
        _window_kv_dtype("bfloat16", "fp8_e4m3")
    assert _window_kv_dtype("fp8_e4m3", "fp8_e4m3") is None
    assert _window_kv_dtype("auto", None) is None
