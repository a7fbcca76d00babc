"""Checkpoint loading: released <-> HF names on a full tiny HF `DeepseekV4ForCausalLM`, quantised
exports against their dequantised twin, HF's own loader as the independent reader of our exports,
and every loader error."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.model_loader import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    load_checkpoint,
    load_state_dict,
    quantize_fp8_block,
    quantize_mxfp4,
    save_released_checkpoint,
)
from sgl_dspark.srt.model_loader.export import released_config_dict, released_state_dict
from sgl_dspark.srt.model_loader.loader import plan_checkpoint
from sgl_dspark.srt.model_loader.weight_utils import SafetensorsReader
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
E, INTER, D = 8, 64, 128


def tiny_hf_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=512,
        hidden_size=D,
        moe_intermediate_size=INTER,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=64,
        partial_rotary_factor=0.25,
        num_experts_per_tok=2,
        n_routed_experts=E,
        hc_mult=4,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=4,
        max_position_embeddings=256,
        layer_types=[SLIDING, CSA, HCA, CSA, HCA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        swiglu_limit=0.3,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )


def randomise_constants(model: torch.nn.Module, seed: int) -> None:
    """Overwrite what HF initialises to 0/1 so every tensor is distinctive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                t.copy_(
                    torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(t.shape[0])])
                )
            elif "norm" in name:
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith((".scale", "hc_scale")):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))


@pytest.fixture(scope="module")
def hf_model() -> DeepseekV4ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(tiny_hf_config()).eval()
    randomise_constants(model, seed=1)
    return model


@pytest.fixture(scope="module")
def hf_state(hf_model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def config(hf_model: DeepseekV4ForCausalLM) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_model.config.to_dict())


def logits(model: DeepseekV4ForCausalLM) -> torch.Tensor:
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def hf_load(path: str, dtype: torch.dtype = torch.float32) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=dtype).eval()


def stored_dtypes(path: str) -> dict[str, str]:
    out = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), "pt") as f:
                out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    return out


def test_released_names_follow_the_release_layout(hf_state, config) -> None:
    released = released_state_dict(hf_state)
    n_expert_tensors = sum(1 for k in hf_state if ".mlp.experts." in k)
    assert len(released) == len(hf_state) - n_expert_tensors + 6 * E * 3
    gate_up = hf_state["model.layers.3.mlp.experts.gate_up_proj"]
    # Hand-picked rows of the released <-> HF name table (`name_mapping.py`).
    pairs = {
        "embed.weight": hf_state["model.embed_tokens.weight"],
        "head.weight": hf_state["lm_head.weight"],
        "hc_head_fn": hf_state["model.hc_head.hc_fn"],
        "layers.0.attn.attn_sink": hf_state["model.layers.0.self_attn.sinks"],
        "layers.1.hc_ffn_scale": hf_state["model.layers.1.ffn_hc.scale"],
        "layers.1.attn.indexer.compressor.ape": hf_state[
            "model.layers.1.self_attn.compressor.indexer.position_bias"
        ],
        "layers.1.attn.indexer.weights_proj.weight": hf_state[
            "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"
        ],
        "layers.2.attn.compressor.norm.weight": hf_state[
            "model.layers.2.self_attn.compressor.kv_norm.weight"
        ],
        "layers.2.ffn.gate.bias": hf_state["model.layers.2.mlp.gate.e_score_correction_bias"],
        "layers.0.ffn.gate.tid2eid": hf_state["model.layers.0.mlp.gate.tid2eid"],
        "layers.4.ffn.shared_experts.w3.weight": hf_state[
            "model.layers.4.mlp.shared_experts.up_proj.weight"
        ],
        "layers.3.ffn.experts.7.w1.weight": gate_up[7, :INTER],
        "layers.3.ffn.experts.7.w3.weight": gate_up[7, INTER:],
        "layers.3.ffn.experts.2.w2.weight": hf_state["model.layers.3.mlp.experts.down_proj"][2],
    }
    for name, expected in pairs.items():
        assert torch.equal(released[name], expected), name


@pytest.mark.parametrize("shard_bytes", [None, 300_000])
def test_hf_released_hf_round_trip_is_identity(hf_state, config, tmp_path, shard_bytes) -> None:
    save_released_checkpoint(hf_state, config, str(tmp_path), max_shard_bytes=shard_bytes)
    if shard_bytes is not None:
        assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    loaded_config = ModelConfig.from_pretrained(str(tmp_path))
    assert loaded_config == config
    loaded = load_state_dict(str(tmp_path), loaded_config, torch.float32)
    assert set(loaded) == set(hf_state)
    for name, tensor in hf_state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_released_config_uses_legacy_keys(config) -> None:
    d = released_config_dict(config, quantize=True, expert_dtype="fp4")
    assert d["compress_ratios"] == [0, 4, 16, 4, 16, 0]
    assert d["num_hash_layers"] == 2 and d["qk_rope_head_dim"] == 16
    assert (
        d["quantization_config"]["weight_block_size"] == [128, 128] and d["expert_dtype"] == "fp4"
    )
    assert "partial_rotary_factor" not in d and "mlp_layer_types" not in d
    assert ModelConfig.from_hf_dict(d).quantization.expert_dtype == "fp4"


def test_hf_reads_released_export_with_identical_logits(
    hf_model, hf_state, config, tmp_path
) -> None:
    save_released_checkpoint(hf_state, config, str(tmp_path))
    reloaded = hf_load(str(tmp_path))
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, hf_state[name]), name
    assert torch.equal(logits(reloaded), logits(hf_model))


def test_loads_hf_named_checkpoint_with_hf_dtypes(hf_model, config, tmp_path) -> None:
    hf_model.save_pretrained(str(tmp_path))
    ours = load_state_dict(str(tmp_path), config, torch.bfloat16)
    theirs = hf_load(str(tmp_path), torch.bfloat16).state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():  # HF decides which tensors stay fp32 / int64
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("writer", ["released", "hf_save_pretrained", "hf_state_dict"])
def test_naming_scheme_detection(hf_model, hf_state, config, tmp_path, writer) -> None:
    if writer == "released":
        save_released_checkpoint(hf_state, config, str(tmp_path))
    elif writer == "hf_save_pretrained":  # released layer names under `model.`, HF global names
        hf_model.save_pretrained(str(tmp_path))
    else:
        save_file(hf_state, str(tmp_path / "model.safetensors"))
    with SafetensorsReader(str(tmp_path)) as reader:
        plan = plan_checkpoint(reader, config)
    assert (
        plan.scheme
        == {"released": "released", "hf_save_pretrained": "mixed", "hf_state_dict": "hf"}[writer]
    )
    loaded = load_state_dict(str(tmp_path), config, torch.float32)
    assert all(torch.equal(loaded[k], v) for k, v in hf_state.items()) and set(loaded) == set(
        hf_state
    )


def dequantised_twin(
    hf_state: dict[str, torch.Tensor], expert_dtype: str
) -> dict[str, torch.Tensor]:
    """What a quantised export must load as, built from this file's list of FP8 modules.

    Released experts are quantised one `[out, in]` matrix at a time, so `gate_up_proj` is split
    into its w1 and w3 halves first (their FP8 blocks must not straddle the two)."""
    fp8_modules = (
        "q_a_proj",
        "q_b_proj",
        "self_attn.kv_proj",
        "o_a_proj",
        "o_b_proj",
        "shared_experts",
    )

    def fp8(w: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_block(*quantize_fp8_block(w, (128, 128)), (128, 128))

    twin = {}
    for name, w in hf_state.items():
        if ".mlp.experts." in name:
            quant = (
                (lambda x: dequantize_mxfp4(*quantize_mxfp4(x))) if expert_dtype == "fp4" else fp8
            )
            halves = w.split(w.shape[1] // 2, dim=1) if name.endswith("gate_up_proj") else (w,)
            twin[name] = torch.cat([quant(h) for h in halves], dim=1)
        elif any(m in name for m in fp8_modules):
            twin[name] = fp8(w)
        else:
            twin[name] = w
    return twin


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_quantised_export_loads_as_dequantised_twin(
    hf_model, hf_state, config, tmp_path, expert_dtype, monkeypatch
) -> None:
    save_released_checkpoint(
        hf_state, config, str(tmp_path), quantize=True, expert_dtype=expert_dtype
    )
    dtypes = stored_dtypes(str(tmp_path))
    assert (
        dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3"
        and dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    )
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "F32"
    assert dtypes["layers.1.attn.indexer.weights_proj.weight"] == "F32"
    assert dtypes["layers.2.ffn.gate.weight"] == "F32" and dtypes["embed.weight"] == "F32"
    assert dtypes["layers.2.ffn.experts.5.w2.weight"] == (
        "I8" if expert_dtype == "fp4" else "F8_E4M3"
    )
    qconfig = ModelConfig.from_pretrained(str(tmp_path))
    assert qconfig.quantization is not None and qconfig.quantization.expert_dtype == expert_dtype

    loaded = load_state_dict(str(tmp_path), qconfig, torch.float32)
    twin = dequantised_twin(hf_state, expert_dtype)
    assert set(loaded) == set(twin)
    for name, tensor in twin.items():
        assert torch.equal(loaded[name], tensor), name
    changed = [n for n in twin if not torch.equal(twin[n], hf_state[n])]
    assert len(changed) > 50  # quantisation did happen

    # HF's own FP8/FP4 dequantising loader reads the same export to the same tensors and logits.
    # HF asks for `accelerate` before loading FP8 checkpoints; its CPU dequantise path does not use it.
    import transformers.quantizers.quantizer_finegrained_fp8 as hf_fp8

    monkeypatch.setattr(hf_fp8, "is_accelerate_available", lambda: True)
    reloaded = hf_load(str(tmp_path))
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, loaded[name]), name
    twin_model = DeepseekV4ForCausalLM(hf_model.config).eval()
    twin_model.load_state_dict(loaded)
    assert torch.equal(logits(reloaded), logits(twin_model))


def test_scale_forms_and_hf_named_fp8(hf_state, config, tmp_path) -> None:
    """E8M0 bytes as uint8, fp32 multipliers, and HF names with `weight_scale_inv` all agree."""
    name = "model.layers.0.self_attn.q_b_proj.weight"
    q, scale = quantize_fp8_block(hf_state[name])
    expected = dequantize_fp8_block(q, scale, (128, 128))
    for i, form in enumerate(
        (scale.view(torch.uint8), torch.exp2(scale.view(torch.uint8).float() - 127))
    ):
        state = {k: v for k, v in hf_state.items() if k != name}
        state[name], state[name.replace(".weight", ".weight_scale_inv")] = q, form
        path = tmp_path / str(i)
        path.mkdir()
        save_file(state, str(path / "model.safetensors"))
        loaded = dict(load_checkpoint(str(path), config, torch.float32))
        assert torch.equal(loaded[name], expected)


def test_mtp_tensors_are_dropped_with_debug_log(hf_state, config, tmp_path, caplog) -> None:
    tensors = released_state_dict(hf_state)
    tensors["mtp.0.e_proj.weight"] = torch.randn(4, 4)
    tensors["mtp.0.enorm.weight"] = torch.randn(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.DEBUG, logger="sgl_dspark.srt.model_loader"):
        loaded = load_state_dict(str(tmp_path), config, torch.float32)
    assert set(loaded) == set(hf_state)
    assert "mtp.0.e_proj.weight" in caplog.text


# ---- errors --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantised_released(hf_state) -> dict[str, torch.Tensor]:
    return released_state_dict(hf_state, quantize=True, expert_dtype="fp4")


def write(tensors: dict[str, torch.Tensor], path) -> str:
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def edited(base: dict[str, torch.Tensor], drop: tuple[str, ...] = (), **add: torch.Tensor) -> dict:
    out = {k: v for k, v in base.items() if k not in drop}
    out.update({k.replace("__", "."): v for k, v in add.items()})
    return out


ERROR_CASES = {
    "unexpected_name": (
        lambda t: edited(t, **{"layers__0__attn__foo__weight": torch.ones(2)}),
        "layers.0.attn.foo.weight",
    ),
    "layer_out_of_range": (
        lambda t: edited(t, **{"layers__6__attn_norm__weight": torch.ones(2)}),
        "layers.6.attn_norm.weight",
    ),
    "expert_out_of_range": (
        lambda t: edited(t, **{"layers__2__ffn__experts__8__w2__weight": torch.ones(2)}),
        "layers.2.ffn.experts.8.w2.weight",
    ),
    "missing_scale": (
        lambda t: edited(t, drop=("layers.3.attn.wo_b.scale",)),
        "layers.3.attn.wo_b.weight",
    ),
    "missing_expert_scale": (
        lambda t: edited(t, drop=("layers.2.ffn.experts.4.w3.scale",)),
        "layers.2.ffn.experts.4.w3.weight",
    ),
    "missing_expert": (
        lambda t: edited(
            t, drop=("layers.2.ffn.experts.4.w3.weight", "layers.2.ffn.experts.4.w3.scale")
        ),
        "layers.2.ffn.experts.4.w3.weight",
    ),
    "wrong_scale_shape": (
        lambda t: edited(t, **{"layers__1__attn__wq_b__scale": t["layers.1.attn.wq_b.scale"][:1]}),
        "layers.1.attn.wq_b.scale",
    ),
    "wrong_fp4_scale_shape": (
        lambda t: edited(
            t,
            **{
                "layers__2__ffn__experts__0__w1__scale": t["layers.2.ffn.experts.0.w1.scale"][
                    :, :1
                ].clone()
            },
        ),
        "layers.2.ffn.experts.0.w1.scale",
    ),
    "fp8_e5m2": (
        lambda t: edited(
            t,
            **{"layers__0__attn__wkv__weight": t["layers.0.attn.wkv.weight"].to(torch.float8_e5m2)},
        ),
        "layers.0.attn.wkv.weight",
    ),
    "scale_on_plain": (
        lambda t: edited(t, **{"layers__1__attn__compressor__wkv__scale": torch.ones(1, 1)}),
        "layers.1.attn.compressor.wkv.scale",
    ),
    "orphan_scale": (
        lambda t: edited(t, drop=("layers.0.attn.wo_a.weight",)),
        "layers.0.attn.wo_a.scale",
    ),
    "duplicate_names": (
        lambda t: edited(t, **{"model__norm__weight": t["norm.weight"].clone()}),
        "model.norm.weight",
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_loader_errors_name_the_tensor(quantised_released, config, tmp_path, case) -> None:
    make, tensor_name = ERROR_CASES[case]
    path = write(make(quantised_released), tmp_path)
    with pytest.raises(ValueError, match=tensor_name.replace(".", r"\.")):
        load_checkpoint(path, config, torch.float32)  # raised before any tensor is yielded


def test_directory_errors(config, tmp_path) -> None:
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_checkpoint(str(tmp_path), config, torch.float32)
    with pytest.raises(ValueError, match="not a directory"):
        load_checkpoint(str(tmp_path / "absent"), config, torch.float32)
    index = {"metadata": {}, "weight_map": {"embed.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        load_checkpoint(str(tmp_path), config, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(str(tmp_path), config, torch.int32)


def test_served_model_with_fused_projections_exports(hf_state, config, tmp_path) -> None:
    """A served model's fused projections are views of one weight (LinearGroup); its state dict
    still exports and round-trips exactly."""
    from sgl_dspark.srt.layers.fused_linear import fuse_linear_groups
    from sgl_dspark.srt.model_executor.model_runner import load_weights
    from sgl_dspark.srt.models.deepseek_v4 import DeepseekV4ForCausalLM as Ours

    ours = Ours(config)
    load_weights(ours, hf_state.items())
    assert fuse_linear_groups(ours) > 0
    state = ours.state_dict()
    save_released_checkpoint(state, config, str(tmp_path))
    loaded = load_state_dict(str(tmp_path), config, torch.float32)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
