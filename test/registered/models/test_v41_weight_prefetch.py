"""Where DeepSeek-V4.1 hints weights into L2 (`layers/weight_prefetch.py`): at the start of each
stretch of kernels that read little from HBM it names the weights of the GEMM that ends it.

A V4.1 fixture saved quantised as released (FP8 projections, MXFP4 experts) and loaded native;
the model's hint object is replaced by a recorder, and every forward (a prefill, then greedy
decode steps) must name, in order: layer 0's x projection before anything else, then per layer
the output projection o_a (issued inside the attention, after the query projection), the router
gate and the shared expert's gate-up rows (after the attention, before the FFN's boundary), then
the next layer's x projection; and join the side stream once, after the last hint. The weights
are checked against the modules that own them (each recorded weight is the storage the layer's
GEMM reads: the fused x projection starts at its first member's rows), and the logits against a
runner whose hints were left in place (a hint computes nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_utils import checkpoint_runner, greedy_logits
from sgl_dspark.kernels.linear.reference import QuantizedWeight
from sgl_dspark.srt.layers.quantized import module_weight
from test_v41_checkpoint import C2, QUANT, _model_dir, _quantised

pytestmark = [  # the Triton interpreter's numpy calls (see test_moe_grouped_gemm.py)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
PROMPT = [5, 77, 19, 300, 4, 61]
DECODE_STEPS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    stored, _ = _quantised(C2, 32)
    return _model_dir(C2, tmp_path_factory.mktemp("v41_prefetch"), stored, QUANT)


def _ptr(w) -> int:
    return (w.data if isinstance(w, QuantizedWeight) else w).data_ptr()


def _rows(w) -> int:
    return w.shape[-2]


def _expected_forward(layers) -> list[tuple[str, int]]:
    """(what, layer) of every hint of one forward, in order."""
    calls = [("x", 0)]
    for i in range(len(layers)):
        calls += [("o_a", i), ("ffn", i)]
        if i + 1 < len(layers):
            calls.append(("x", i + 1))
    return [*calls, ("join", -1)]


def _classify(layers, weights: list) -> tuple[str, int]:
    """Which layer's which GEMM `weights` are, judged from the modules that own them."""
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        members = attn.x_proj.linears
        if _ptr(weights[0]) == _ptr(module_weight(members[0])):
            assert sum(_rows(w) for w in weights) == sum(m.out_features for m in members)
            return "x", i
        o_a = module_weight(attn.o_a_proj)
        if len(weights) == 1 and _ptr(weights[0]) == _ptr(o_a):
            assert isinstance(weights[0], QuantizedWeight)  # packed as released
            assert weights[0].scale.data_ptr() == o_a.scale.data_ptr()
            return "o_a", i
        gate = [] if mlp.gate.is_hash else [mlp.gate.weight]
        if [_ptr(w) for w in weights[: len(gate)]] == [g.data_ptr() for g in gate]:
            shared = weights[len(gate) :]
            first = module_weight(mlp.shared_experts.gate_proj)
            if len(shared) == 1 and _ptr(shared[0]) == _ptr(first):
                assert _rows(shared[0]) == 2 * mlp.shared_experts.gate_proj.out_features
                return "ffn", i
    raise AssertionError(f"weights of no layer's GEMM: {[tuple(w.shape) for w in weights]}")


@pytest.mark.parametrize("overrides", [None, "moe=triton"])  # the shared expert apart / folded
def test_hints_name_each_stretch_s_gemm_weights_in_order(checkpoint: Path, overrides) -> None:
    runner = checkpoint_runner(checkpoint, "native", overrides)
    model = runner.model
    layers = list(model.model.layers)
    recorded: list[tuple[str, int]] = []

    def issue(device: torch.device, weights) -> None:
        assert device == runner.device
        recorded.append(_classify(layers, list(weights())))

    hints = model.weight_prefetch
    assert all(layer.self_attn.weight_prefetch is hints for layer in layers)
    hints.issue = issue
    hints.join = lambda: recorded.append(("join", -1))
    tokens, logits = greedy_logits(runner, PROMPT, DECODE_STEPS)
    assert recorded == _expected_forward(layers) * (1 + DECODE_STEPS)

    plain = checkpoint_runner(checkpoint, "native", overrides)
    tokens_plain, logits_plain = greedy_logits(plain, PROMPT, DECODE_STEPS)
    assert tokens == tokens_plain
    for a, b in zip(logits, logits_plain):
        assert torch.equal(a, b)


def test_hash_routed_layers_name_no_gate(checkpoint: Path) -> None:
    """A hash-routed layer reads only its tokens' experts' gate rows: the FFN's hint leaves the
    gate out and names the shared expert's gate-up rows alone."""
    mlp = checkpoint_runner(checkpoint, "native").model.model.layers[1].mlp
    shared_first = _ptr(module_weight(mlp.shared_experts.gate_proj))
    assert [_ptr(w) for w in mlp.input_weights()] == [mlp.gate.weight.data_ptr(), shared_first]
    mlp.gate.is_hash = True
    assert [_ptr(w) for w in mlp.input_weights()] == [shared_first]
