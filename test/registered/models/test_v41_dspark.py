"""DSpark with DeepSeek-V4.1 targets (fp32, CPU):

* the draft's features are V4.1's taps: for every tapped layer, the mean over the mHC streams of
  what enters the layer's attention (after the layer's Engram), checked against the independent
  test reference (`v41_reference.py`) on a fixture with Engram on tapped layers;
* the draft stages are V4.1 window-only layers with the draft's own expert count and top-k
  (single-pass mHC without a hyper head, no per-head q norm, the V4.1 router and experts, FP8
  window KV rows), and a config that declares compressed draft layers is refused by name;
* DSpark greedy output on the fixture targets equals Hugging Face's greedy continuations stored
  in the fixtures, for several verify policies and the bs-1 runtime.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from sgl_dspark import Engine
from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.configs.errors import UnsupportedConfigError
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.models.tiny_v41 import TINY_V41_DSPARK_CONFIG, tiny_v41_hf_config
from sgl_dspark.tools.init_dspark_draft import init_dspark_draft
from v41_reference import V41Reference

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "deepseek_v41"
CASES = ["c1_hc2_sqrtsoftplus", "c2_hc4_sigmoid_engram"]
PROMPTS = ["p0", "p1", "p2"]


def _draft(target: pathlib.Path, out: pathlib.Path, block: int, layers=None) -> str:
    init_dspark_draft(
        str(target), str(out), num_layers=3, block_size=block, markov_rank=16, noise_token_id=3
    )
    if layers is not None:  # the stages' shapes do not depend on which layers feed them
        cfg = json.loads((out / "config.json").read_text())
        cfg["dspark_target_layer_ids"] = layers
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_draft_features_are_the_attention_inputs_after_engram(tmp_path):
    """c2 has Engram on layers 1 and 2; the draft taps 1, 2 and 4."""
    d = FIXTURES / "c2_hc4_sigmoid_engram"
    taps = [1, 2, 4]
    draft = _draft(d, tmp_path / "draft", 3, taps)
    engine = Engine(
        model_path=str(d),
        skip_tokenizer_init=True,
        context_length=256,
        speculative_algorithm="DSpark",
        speculative_draft_model_path=draft,
    )
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model = engine.spec.worker.draft
    write = model.write_context_kv

    def record(features, positions, pools, slots):
        seen.append((features.clone(), positions.clone()))
        write(features, positions, pools, slots)

    model.write_context_kv = record  # type: ignore[method-assign]
    ids = load_file(str(d / "vectors.safetensors"))["p2.input_ids"].tolist()
    engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 1})
    features, positions = seen[0]  # the prompt's forward
    assert positions.tolist() == list(range(len(ids)))
    _, debug = V41Reference(d).forward(ids)
    inputs, outputs = debug["layer_input_streams"], debug["layer_output_streams"]
    expected = torch.cat([inputs[layer].mean(dim=1) for layer in taps], dim=-1)
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=0)
    # not V4's convention (the streams after the layer)
    after = torch.cat([outputs[layer].mean(dim=1) for layer in taps], dim=-1)
    assert (features - after).abs().max() > 1e-2
    engine.shutdown()


def test_draft_stages_are_v41_window_layers():
    target = ModelConfig.from_hf_dict(tiny_v41_hf_config())
    dcfg = DSparkConfig.from_dict(TINY_V41_DSPARK_CONFIG, target)
    stage = dcfg.stage_config
    assert stage.v41 is not None and stage.v41.compress_ratios == (0, 0, 0)
    assert stage.v41.engram is None and not stage.v41.kv_source_layer_ids
    assert (stage.n_routed_experts, stage.num_experts_per_tok) == (6, 3)
    assert (target.n_routed_experts, target.num_experts_per_tok) == (8, 2)
    assert stage.hc_pre_from_prev_sublayer and not stage.q_head_norm
    model = DSparkDraftModel(dcfg)
    names = set(model.state_dict())
    assert not any("hc_head" in n for n in names)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6
    layer = model.model.layers[0]
    assert layer.mlp.gate.gate_temp == target.v41.gate_temp
    assert layer.mlp.experts.weight_before_down
    assert layer.self_attn.window_fp8 and not layer.self_attn.q_head_norm


def test_compressed_draft_layers_are_refused():
    raw = tiny_v41_hf_config()
    raw["text_config"]["compress_ratios"] = [0, 2, 2, 1, 1, 1, 0, 1, 0]
    target = ModelConfig.from_hf_dict(raw)
    with pytest.raises(UnsupportedConfigError, match="compress_ratios"):
        DSparkConfig.from_dict(TINY_V41_DSPARK_CONFIG, target)


def test_dspark_keys_inside_text_config_are_read():
    raw = tiny_v41_hf_config()
    raw["text_config"].update(TINY_V41_DSPARK_CONFIG)
    raw["dspark_block_size"] = 3  # a top-level key wins
    dcfg = DSparkConfig.from_dict(raw, ModelConfig.from_hf_dict(tiny_v41_hf_config()))
    assert dcfg.target_layer_ids == (2, 4, 5) and dcfg.block_size == 3
    assert dcfg.stage_config.num_experts_per_tok == 3


@pytest.mark.parametrize("case", CASES)
def test_dspark_greedy_equals_the_fixture_continuations(case, tmp_path):
    d = FIXTURES / case
    vec = load_file(str(d / "vectors.safetensors"))
    prompts = [vec[f"{p}.input_ids"].tolist() for p in PROMPTS]
    expected = [vec[f"{p}.greedy_tokens"].tolist() for p in PROMPTS]
    greedy = {"max_new_tokens": len(expected[0]), "temperature": 0.0, "ignore_eos": True}
    draft = _draft(d, tmp_path / "draft", 4)
    sps = tmp_path / "sps.json"  # a step time linear in the verified tokens
    tokens = [1, 2, 4, 8, 16, 32, 64]
    sps.write_text(
        json.dumps(
            {
                "sample_batch_tokens": tokens,
                "sample_steps_per_sec": [1000.0 / (10.0 + 0.4 * t) for t in tokens],
                "max_batch_tokens": 64,
            }
        )
    )
    for kw in (
        {"speculative_dspark_verify_policy": "full", "max_running_requests": 3},
        {
            "speculative_dspark_verify_policy": "confidence",
            "speculative_dspark_confidence_mode": "sync",
            "speculative_dspark_sps_table_path": str(sps),
            "max_running_requests": 2,
        },
        # the bs-1 runtime with its own block size
        {"speculative_dspark_bs1_block_size": 6, "max_running_requests": 1},
    ):
        engine = Engine(
            model_path=str(d),
            skip_tokenizer_init=True,
            context_length=256,
            speculative_algorithm="DSpark",
            speculative_draft_model_path=draft,
            **kw,
        )
        outs = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert [o["output_ids"] for o in outs] == expected, kw
        engine.shutdown()
