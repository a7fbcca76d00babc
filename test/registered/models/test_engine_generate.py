"""Engine over checkpoints written by HF `save_pretrained` (and the released layout): greedy
generation equals HF `generate`; released names and quantised checkpoints load correctly."""

from __future__ import annotations

import pytest
import torch
from hf_reference import make_hf_model
from sgl_dspark import Engine
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.model_loader import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    load_state_dict,
    quantize_fp8_block,
    quantize_mxfp4,
    save_released_checkpoint,
)


@pytest.fixture(scope="module")
def hf_model():
    model = make_hf_model("main", seed=3)
    with torch.no_grad():
        # Wider logits: greedy margins far above the 1e-6 numeric differences.
        model.lm_head.weight.mul_(50.0)
    return model


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_ckpt")
    hf_model.save_pretrained(d)
    return str(d)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 23, 40)]


def test_greedy_generate_matches_hf(hf_model, hf_dir):
    engine = Engine(
        model_path=hf_dir, skip_tokenizer_init=True, context_length=256, chunked_prefill_size=16
    )
    params = {"max_new_tokens": 70, "temperature": 0.0, "ignore_eos": True}
    outs = engine.generate(input_ids=_prompts(), sampling_params=params)
    for ids, out in zip(_prompts(), outs):
        ref = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=70,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
        assert out["output_ids"] == ref[0, len(ids) :].tolist()
        assert out["meta_info"]["completion_tokens"] == 70
        assert out["meta_info"]["prompt_tokens"] == len(ids)
    engine.shutdown()


def _first_logits(model_dir: str) -> torch.Tensor:
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, context_length=256)
    outs = engine.generate(
        input_ids=_prompts(),
        return_logprob=True,
        sampling_params={"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
    )
    return torch.tensor(
        [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    ), [o["output_ids"] for o in outs]


def test_released_names_give_equal_outputs(hf_model, hf_dir, tmp_path):
    cfg = ModelConfig.from_pretrained(hf_dir)
    save_released_checkpoint(hf_model.state_dict(), cfg, str(tmp_path), quantize=False)
    a = load_state_dict(hf_dir, cfg, torch.float32)
    b = load_state_dict(str(tmp_path), cfg, torch.float32)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    lp_a, ids_a = _first_logits(hf_dir)
    lp_b, ids_b = _first_logits(str(tmp_path))
    assert ids_a == ids_b
    assert torch.equal(lp_a, lp_b)


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_quantized_checkpoint_equals_dequantized_twin(hf_model, hf_dir, tmp_path, expert_dtype):
    cfg = ModelConfig.from_pretrained(hf_dir)
    qdir = tmp_path / "quant"
    save_released_checkpoint(
        hf_model.state_dict(), cfg, str(qdir), quantize=True, expert_dtype=expert_dtype
    )
    # The twin: the same HF state dict with every quantised tensor replaced by its dequantised
    # value, computed here from the quantisers (independent of the loader).
    twin = {k: v.clone() for k, v in hf_model.state_dict().items()}
    dense = (
        "q_a_proj.weight",
        "q_b_proj.weight",
        "kv_proj.weight",
        "o_a_proj.weight",
        "o_b_proj.weight",
        "indexer.q_b_proj.weight",
        "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    )
    for k, v in twin.items():
        in_compressor = "compressor." in k and not k.endswith("indexer.q_b_proj.weight")
        if k.endswith(dense) and not in_compressor:
            q, s = quantize_fp8_block(v, (128, 128))
            twin[k] = dequantize_fp8_block(q, s, (128, 128))
        elif k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = []
            for w in v:
                if expert_dtype == "fp4":
                    rows.append(dequantize_mxfp4(*quantize_mxfp4(w)))
                else:
                    q, s = quantize_fp8_block(w, (128, 128))
                    rows.append(dequantize_fp8_block(q, s, (128, 128)))
            twin[k] = torch.stack(rows)
    loaded = load_state_dict(str(qdir), ModelConfig.from_pretrained(str(qdir)), torch.float32)
    changed = 0
    for k, v in twin.items():
        assert torch.equal(loaded[k], v), k
        changed += int(not torch.equal(v, hf_model.state_dict()[k]))
    assert changed > 20  # the quantisation really changed the weights
    lp_q, _ = _first_logits(str(qdir))
    lp_hf, _ = _first_logits(hf_dir)
    assert not torch.equal(lp_q, lp_hf)
