"""DSpark draft checkpoints in SGLang's `mtp.<stage>.` layout: the init tool's output loads back
exactly; FP8 (`.scale`) linears and MXFP4 experts load as their dequantised twins; a draft bundled
in the target directory (dspark_* keys in the target config) is found; bad drafts fail clearly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.configs.model_config import ModelConfig, UnsupportedConfigError
from sgl_dspark.srt.model_loader import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    quantize_fp8_block,
    quantize_mxfp4,
)
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG
from sgl_dspark.srt.speculative.dspark.draft_checkpoint import load_draft_weights
from sgl_dspark.tools.init_dspark_draft import init_dspark_draft
from sgl_dspark.tools.init_dspark_draft import main as init_main


@pytest.fixture()
def target_dir(tmp_path):
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    return str(d)


def _model_state(dcfg: DSparkConfig, path: str) -> dict[str, torch.Tensor]:
    return dict(load_draft_weights(path, dcfg))


def test_init_tool_round_trip_and_names(target_dir, tmp_path):
    out = str(tmp_path / "draft")
    init_main(
        [
            "--target-path",
            target_dir,
            "--output",
            out,
            "--num-layers",
            "2",
            "--block-size",
            "4",
            "--markov-rank",
            "8",
            "--seed",
            "3",
        ]
    )
    raw = json.loads(open(os.path.join(out, "config.json")).read())
    assert raw["dspark_block_size"] == 4 and raw["dspark_target_layer_ids"] == [3, 4]
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert "mtp.0.main_proj.weight" in names and "mtp.1.markov_head.embed.weight" in names
    assert "mtp.1.confidence_head.proj.weight" in names and "mtp.1.hc_head_fn" in names
    assert "mtp.0.ffn.experts.7.w3.weight" in names and "mtp.1.attn.wq_a.weight" in names
    target = ModelConfig.from_hf_dict(TINY_HF_CONFIG)
    dcfg = DSparkConfig.from_pretrained(out, target)
    loaded = _model_state(dcfg, out)
    expected = DSparkDraftModel(dcfg).state_dict()
    assert set(loaded) == set(expected)
    assert all(loaded[k].shape == expected[k].shape for k in expected)
    # deterministic: the same seed writes the same tensors
    out2 = str(tmp_path / "draft2")
    init_dspark_draft(target_dir, out2, num_layers=2, block_size=4, markov_rank=8, seed=3)
    again = _model_state(dcfg, out2)
    assert all(torch.equal(loaded[k], again[k]) for k in loaded)


def test_quantized_draft_equals_dequantized_twin(target_dir, tmp_path):
    out = str(tmp_path / "draft")
    init_dspark_draft(target_dir, out, num_layers=2, block_size=3, markov_rank=8)
    target = ModelConfig.from_hf_dict(TINY_HF_CONFIG)
    dcfg = DSparkConfig.from_pretrained(out, target)
    plain = _model_state(dcfg, out)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    q, s = quantize_fp8_block(t["mtp.0.main_proj.weight"], (128, 128))
    t["mtp.0.main_proj.weight"], t["mtp.0.main_proj.scale"] = q, s
    twin_main = dequantize_fp8_block(q, s, (128, 128))
    w = t["mtp.1.ffn.experts.2.w1.weight"]
    pk, sc = quantize_mxfp4(w)
    t["mtp.1.ffn.experts.2.w1.weight"], t["mtp.1.ffn.experts.2.w1.scale"] = pk, sc
    twin_w1 = dequantize_mxfp4(pk, sc)
    save_file(t, path)
    loaded = _model_state(dcfg, out)
    assert torch.equal(loaded["main_proj.weight"], twin_main)
    assert not torch.equal(twin_main, plain["main_proj.weight"])
    inter = twin_w1.shape[0]
    assert torch.equal(loaded["model.layers.1.mlp.experts.gate_up_proj"][2, :inter], twin_w1)
    for k in plain:
        if k not in ("main_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"):
            assert torch.equal(loaded[k], plain[k]), k


def test_bundled_draft_is_found_in_target_dir(tmp_path):
    """A target directory whose config carries dspark_* keys and whose safetensors hold the
    draft's mtp.* tensors next to the target's: both load, without --speculative-draft-model-path."""
    from sgl_dspark import Engine
    from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sgl_dspark.srt.models.tiny import tiny_weights

    d = tmp_path / "bundled"
    d.mkdir()
    cfg = ModelConfig.from_hf_dict(TINY_HF_CONFIG)
    shapes = [(k, tuple(v.shape)) for k, v in DeepseekV4ForCausalLM(cfg).state_dict().items()]
    target_tensors = {k: v.contiguous() for k, v in tiny_weights(cfg, shapes, seed=0)}
    (d / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    draft_dir = tmp_path / "draft"
    init_dspark_draft(str(d), str(draft_dir), num_layers=3, block_size=4, markov_rank=8)
    draft_tensors = load_file(str(draft_dir / "model.safetensors"))
    save_file({**target_tensors, **draft_tensors}, str(d / "model.safetensors"))
    (d / "config.json").write_text((draft_dir / "config.json").read_text())
    engine = Engine(
        model_path=str(d),
        skip_tokenizer_init=True,
        context_length=128,
        speculative_algorithm="DSpark",
    )
    assert engine.spec.worker.gamma == 4
    plain = Engine(model_path=str(d), skip_tokenizer_init=True, context_length=128)
    sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    assert (
        engine.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]
        == plain.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]
    )


def test_bad_drafts_fail_with_clear_errors(target_dir, tmp_path):
    target = ModelConfig.from_hf_dict(TINY_HF_CONFIG)
    base = {
        "dspark_block_size": 3,
        "dspark_markov_rank": 8,
        "dspark_noise_token_id": 3,
        "dspark_target_layer_ids": [3, 4],
    }
    with pytest.raises(ValueError, match="markov_rank"):
        DSparkConfig.from_dict({**base, "dspark_markov_rank": 0}, target)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DSparkConfig.from_dict({**base, "dspark_target_layer_ids": [9]}, target)
    with pytest.raises(ValueError, match="noise_token_id"):
        DSparkConfig.from_dict({**base, "dspark_noise_token_id": 10**6}, target)
    with pytest.raises(UnsupportedConfigError, match="markov_head_type"):
        DSparkConfig.from_dict({**base, "dspark_markov_head_type": "rnn"}, target)
    with pytest.raises(UnsupportedConfigError, match="sample_from_anchor"):
        DSparkConfig.from_dict({**base, "sample_from_anchor": False}, target)
    out = str(tmp_path / "draft")
    init_dspark_draft(target_dir, out, num_layers=2, block_size=3, markov_rank=8)
    dcfg = DSparkConfig.from_pretrained(out, target)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    del t["mtp.0.ffn.experts.5.w2.weight"]
    save_file(t, path)
    with pytest.raises(ValueError, match="missing expert 5"):
        _model_state(dcfg, out)
    t["mtp.0.ffn.experts.5.w2.weight"] = torch.zeros(128, 64)
    t["mtp.7.attn.wq_a.weight"] = torch.zeros(4, 4)
    save_file(t, path)
    with pytest.raises(ValueError, match="stage 7"):
        _model_state(dcfg, out)
