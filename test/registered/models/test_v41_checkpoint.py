"""DeepSeek-V4.1 checkpoints: HF's in-memory module names and the released names (what HF's
`save_pretrained` writes) load alike; FP8 32x32 blocks, MXFP4 experts with 32- or 16-channel
scales and an FP8 Engram table load to their exact values (expected values dequantised by hand
here); what the text model does not use is dropped; malformed scales are refused by name. Also
the KV pool's stored forms: after a prefill they equal the quantised tensors HF recorded."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from runner_utils import Driver
from safetensors.torch import load_file, save_file
from sgl_dspark import Engine
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardMode
from sgl_dspark.srt.model_loader import load_state_dict, quantize_fp8_block, quantize_mxfp4
from sgl_dspark.srt.model_loader.name_mapping import V41_NAMES, parse_checkpoint_name

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "deepseek_v41"
C1, C2 = FIXTURES / "c1_hc2_sqrtsoftplus", FIXTURES / "c2_hc4_sigmoid_engram"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
FP8_LINEARS = (
    "attn.wq_a.",
    "attn.wq_b.",
    "attn.wkv.",
    "attn.wo_a.",
    "attn.wo_b.",
    "attn.indexer.wq_b.",
    "ffn.shared_experts.",
    "engram.wkv.",
)


def _model_dir(src: pathlib.Path, dst: pathlib.Path, tensors: dict, extra_config=None):
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(extra_config or {})
    (dst / "config.json").write_text(json.dumps(config))
    if (src / "tokenizer.json").exists():
        shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scale.view(torch.uint8).float() - 127)


def _by_hand_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    s = _e8m0(scale).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * s[: q.shape[0], : q.shape[1]]


def _by_hand_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    raw = packed.view(torch.uint8).long()
    table = torch.tensor(E2M1)
    values = torch.stack((table[raw & 15], table[raw >> 4]), -1).flatten(-2)
    s = _e8m0(scale).repeat_interleave(group, -1)[..., : values.shape[-1]]
    return values * s


def _quantised(src: pathlib.Path, group: int) -> tuple[dict, dict]:
    """(stored tensors, expected fp32 value of every quantised tensor, by released name)."""
    stored, expected = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        base = name.removesuffix(".weight")
        if ".ffn.experts." in name:
            packed, scale = quantize_mxfp4(w, group)
            stored[name], stored[base + ".scale"] = packed, scale
            expected[name] = _by_hand_fp4(packed, scale, group)
        elif name.endswith("engram.embed.weight"):
            q, scale = quantize_fp8_block(w, (1, 32))
            stored[name], stored[base + ".scale"] = q, scale.view(torch.uint8)
            expected[name] = _by_hand_fp8(q, scale, (1, 32))
        elif name.endswith(".weight") and any(f".{p}" in name for p in FP8_LINEARS):
            q, scale = quantize_fp8_block(w, (32, 32))
            stored[name], stored[base + ".scale"] = q, scale
            expected[name] = _by_hand_fp8(q, scale, (32, 32))
        elif not name.endswith("engram.embed.scale"):
            stored[name] = w
    return stored, expected


QUANT = {
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [32, 32],
        "expert_dtype": "fp4",
    }
}


@pytest.mark.parametrize("src,group", [(C1, 32), (C2, 16)])
def test_quantised_checkpoint_loads_exact_values(src, group, tmp_path):
    stored, expected = _quantised(src, group)
    d = _model_dir(src, tmp_path / "q", stored, QUANT)
    cfg = ModelConfig.from_pretrained(str(d))
    assert cfg.quantization is not None and cfg.quantization.weight_block_size == (32, 32)
    plain = load_state_dict(str(src), cfg, torch.float32, V41_NAMES)
    loaded = load_state_dict(str(d), cfg, torch.float32, V41_NAMES)
    assert set(loaded) == set(plain)
    n_experts, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    checked = 0
    for released, want in expected.items():
        layer = int(released.split(".")[1])
        if ".ffn.experts." in released:
            e, proj = int(released.split(".")[4]), released.split(".")[5]
            stack = "down_proj" if proj == "w2" else "gate_up_proj"
            got = loaded[f"model.layers.{layer}.mlp.experts.{stack}"][e]
            got = got if proj == "w2" else (got[:inter] if proj == "w1" else got[inter:])
        else:
            mapped = parse_checkpoint_name(released, cfg.num_hidden_layers, n_experts, V41_NAMES)
            assert mapped is not None
            got = loaded[mapped.hf_name]
        assert torch.equal(got, want), released
        checked += 1
    assert checked > 3 * cfg.num_hidden_layers and n_experts > 1
    engine = Engine(model_path=str(d), skip_tokenizer_init=True, context_length=64)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_hf_module_names_load_like_the_released_names(tmp_path):
    tensors = load_file(str(C2 / "model.safetensors"))
    renamed = {
        ("lm_head.weight" if k == "head.weight" else "model." + k): v for k, v in tensors.items()
    }
    # what the multimodal release adds: vision tower, aligner, image markers, DSpark stages
    extra = ["vision.blocks.0.attn.qkv.weight", "aligner.proj.weight", "image_newline"]
    renamed.update({k: torch.ones(2, 2) for k in [*extra, "mtp.0.main_norm.weight"]})
    d = _model_dir(C2, tmp_path / "hf", renamed)
    cfg = ModelConfig.from_pretrained(str(C2))
    a = load_state_dict(str(C2), cfg, torch.float32, V41_NAMES)
    b = load_state_dict(str(d), cfg, torch.float32, V41_NAMES)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # dropped: the vision-only router bias, the scale of the fp32 Engram table, the vision and
    # DSpark tensors
    assert not any("bias_vl" in k or k.endswith("embed.scale") for k in a)
    assert not any(k.startswith(("model.vision", "model.aligner", "model.image")) for k in b)


def test_malformed_fp4_scale_is_refused_by_name(tmp_path):
    stored, _ = _quantised(C1, 32)
    name = "layers.2.ffn.experts.1.w3.scale"
    stored[name] = stored[name].view(torch.uint8).repeat(1, 4)  # 8 channels per scale
    d = _model_dir(C1, tmp_path / "bad", stored, QUANT)
    cfg = ModelConfig.from_pretrained(str(d))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_state_dict(str(d), cfg, torch.float32, V41_NAMES)


@pytest.mark.parametrize("src", [C1, C2])
def test_cached_forms_equal_the_quantised_tensors_hf_recorded(src):
    """After a prefill the pool holds the FP8 window KV of every layer and the packed FP4
    latents and index keys of every kv source; read back, they equal HF's (post-quantisation)
    tensors, or differ by one quantisation step where HF's noise crossed a boundary."""
    vec = load_file(str(src / "vectors.safetensors"))
    engine = Engine(model_path=str(src), skip_tokenizer_init=True, context_length=128)
    runner, drv = engine.runner, Driver(engine.runner)
    ids = vec["p2.input_ids"].tolist()
    slot = drv.new_request()
    drv.step(ForwardMode.EXTEND, [(slot, ids)])
    pool, table = runner.kv_pool, runner.req_pool.req_to_token[slot]
    cfg = runner.model_cfg
    checked = 0
    for name, want in vec.items():
        if not name.startswith("p2.debug.") or want.dtype == torch.bool or "." not in name[9:]:
            continue
        kind, layer = name[9:].rsplit(".L", 1)
        layer = int(layer)
        if kind == "window_kv":
            store = pool.window[layer]
            assert store.packed and store.data.shape[1] == want.shape[1]  # one byte each
            got = store.load(table[: want.shape[0]])
        elif kind in ("compressed_kv", "index_k"):
            src_state = pool.sources[layer]
            store = src_state.latents if kind == "compressed_kv" else src_state.index_keys
            assert store.packed and store.data.shape[1] == want.shape[1] // 2  # E2M1 pairs
            m = src_state.ratio
            got = store.load(table[: want.shape[0] * m : m] // m)
        else:
            continue
        diff = (got - want).abs()
        step = want.abs().amax(-1, keepdim=True) / 8
        assert ((diff == 0) | (diff <= step)).all() and (diff != 0).float().mean() < 0.01, name
        checked += 1
    assert checked == cfg.num_hidden_layers + 2 * len(cfg.v41.kv_source_layer_ids)
    engine.shutdown()
