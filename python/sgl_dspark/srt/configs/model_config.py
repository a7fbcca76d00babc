"""DeepSeek-V4 / V4.1 model configuration: one frozen, typed record built from HF `config.json`.

`ModelConfig.from_hf_dict` applies the same derivations as transformers' `DeepseekV4Config`
(legacy keys, default layer schedule, nested rope parameters). A V4.1 config (model type
`deepseek_v41` and its variants; the composite form nests the text model in `text_config`) adds
the fields of `configs/deepseek_v41.py`, kept in `ModelConfig.v41`. Unsupported features are
rejected naming the offending field. Model code reads only this record.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from sgl_dspark.srt.configs.deepseek_v41 import (
    V41_DEFAULTS,
    V41Config,
    parse_v41_fields,
    refuse_hash_layers,
    refuse_v41_fields,
    resolve_aliases,
    v41_architectures,
)
from sgl_dspark.srt.configs.errors import UnsupportedConfigError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
# V4.1 layers with compress ratio 1 or 2 (shared latents; roles in `ModelConfig.v41`).
CSA2 = "csa2_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)

_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text", "deepseek_v4.1", "deepseek_v4.1_text")
_SUPPORTED_MODEL_TYPES = ("deepseek_v4", *V41_MODEL_TYPES)
_SUPPORTED_SCORING = ("sqrtsoftplus", "sigmoid")
V4_ARCHITECTURE = "DeepseekV4ForCausalLM"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One rope type ("main" or "compress")."""

    theta: float
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """Checkpoint quantisation (see `model_loader/quantization.py`); `None` means unquantised."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp8"  # "fp8" | "fp4" (MXFP4)
    # Activation scales of the FP8 GEMMs: "ue8m0" = powers of two; None = amax / 448 as is.
    scale_fmt: str | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Resolved DeepSeek-V4 architecture. Field names follow HF's `DeepseekV4Config`."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_main: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10000.0))
    rope_compress: RopeConfig = field(default_factory=lambda: RopeConfig(theta=160000.0))
    layer_types: tuple[str, ...] = ()
    compress_rates: tuple[tuple[str, int], ...] = ((CSA, 4), (HCA, 128))
    mlp_layer_types: tuple[str, ...] = ()
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    q_head_norm: bool = True
    hc_pre_from_prev_sublayer: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    quantization: QuantConfig | None = None
    model_type: str = "deepseek_v4"
    architectures: tuple[str, ...] = (V4_ARCHITECTURE,)
    # DSpark keys bundled in a target config (read by the DSpark draft config, kept verbatim here).
    extra: tuple[tuple[str, Any], ...] = ()
    # DeepSeek-V4.1 schedule, roles, Engram and router temperature; None for V4.
    v41: V41Config | None = None

    # ---- derived views -------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        """The model class name the model registry builds (`models/registry.py`)."""
        return self.architectures[0]

    def compress_ratio(self, layer_id: int) -> int:
        """0 for sliding-only layers, else the compress rate m of the layer's type (V4.1: the
        layer's own ratio, 1 or 2)."""
        lt = self.layer_types[layer_id]
        if lt == CSA2:
            assert self.v41 is not None, "csa2 layers need the V4.1 fields"
            return self.v41.compress_ratios[layer_id]
        return 0 if lt == SLIDING else dict(self.compress_rates)[lt]

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        return tuple(self.compress_ratio(i) for i in range(self.num_hidden_layers))

    def rope_for_layer(self, layer_id: int) -> RopeConfig:
        return self.rope_main if self.layer_types[layer_id] == SLIDING else self.rope_compress

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def extra_dict(self) -> dict[str, Any]:
        return dict(self.extra)

    # ---- builders ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in model directory {path!r}")
        with open(cfg_path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: malformed JSON ({e})") from e
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _from_hf_dict(cls, raw)


def _rope_from_dict(d: dict[str, Any], theta_default: float) -> RopeConfig:
    rope_type = d.get("rope_type", d.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise UnsupportedConfigError(
            f"config field 'rope_parameters.rope_type'={rope_type!r}: only 'default' and 'yarn'"
        )
    theta = float(d.get("rope_theta", theta_default))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in d or "original_max_position_embeddings" not in d:
        raise ValueError(
            "config field 'rope_parameters' (yarn) needs 'factor' and "
            "'original_max_position_embeddings'"
        )
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=float(d["factor"]),
        original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        attention_factor=float(d.get("attention_factor", 1.0) or 1.0),
    )


def _quant_from_dict(raw: dict[str, Any]) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(
            f"config field 'quantization_config' must be a dict, got {type(q).__name__}"
        )
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedConfigError(
            f"config field 'quantization_config.quant_method'={method!r}: only 'fp8' "
            "(128x128 block, e8m0 scales, optional MXFP4 experts) is supported"
        )
    block = tuple(int(b) for b in q.get("weight_block_size", (128, 128)))
    if len(block) != 2:
        raise ValueError(f"config field 'quantization_config.weight_block_size'={block!r}")
    expert_dtype = str(q.get("expert_dtype", raw.get("expert_dtype", "fp8")) or "fp8").lower()
    if expert_dtype in ("mxfp4", "fp4"):
        expert_dtype = "fp4"
    elif expert_dtype not in ("fp8",):
        raise UnsupportedConfigError(
            f"config field 'quantization_config.expert_dtype'={expert_dtype!r}: fp8 or fp4"
        )
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise UnsupportedConfigError(
            f"config field 'quantization_config.scale_fmt'={scale_fmt!r}: ue8m0 or absent"
        )
    return QuantConfig(
        quant_method="fp8",
        weight_block_size=block,  # type: ignore[arg-type]
        expert_dtype=expert_dtype,
        scale_fmt=scale_fmt,
    )


def _from_hf_dict(cls: type[ModelConfig], raw_in: dict[str, Any]) -> ModelConfig:
    raw = dict(raw_in)
    # V4.1 may nest the language model's fields in `text_config`.
    text = raw.pop("text_config", None)
    if isinstance(text, dict):
        raw = {**raw, **text}
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"config field 'model_type'={model_type!r}: expected one of {_SUPPORTED_MODEL_TYPES}"
        )
    is_v41 = model_type in V41_MODEL_TYPES
    if is_v41:
        raw = resolve_aliases(raw)
        raw.update({k: v for k, v in V41_DEFAULTS.items() if raw.get(k) is None})
    else:
        refuse_v41_fields(raw)

    def get(key: str, default: Any) -> Any:
        v = raw.get(key, default)
        return default if v is None else v

    base = cls()
    n = int(get("num_hidden_layers", base.num_hidden_layers))
    head_dim = int(get("head_dim", base.head_dim))
    if int(get("num_key_value_heads", 1)) != 1:
        raise UnsupportedConfigError(
            "config field 'num_key_value_heads' must be 1 (DeepSeek-V4 attention shares one KV head)"
        )

    # compress rates: dict, then legacy scalar overrides.
    rates = dict(_DEFAULT_COMPRESS_RATES)
    if isinstance(raw.get("compress_rates"), dict):
        rates.update({k: int(v) for k, v in raw["compress_rates"].items()})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = int(raw["compress_rate_hca"])
    for k, v in rates.items():
        if k not in (CSA, HCA):
            raise ValueError(f"config field 'compress_rates' has unknown layer type {k!r}")
        if v <= 0:
            raise ValueError(f"config field 'compress_rates[{k!r}]'={v}: must be positive")

    v41 = None
    if is_v41:
        v41 = parse_v41_fields(raw, n, int(get("num_nextn_predict_layers", 3)))
    # layer types: V4.1 from its ratios; V4 explicit > legacy compress_ratios > HF default.
    layer_types = raw.get("layer_types")
    if v41 is not None:
        # (a V4.1 config's own `layer_types` is HF's cache-dispatch label, not this enum)
        layer_types = [SLIDING if r == 0 else CSA2 for r in v41.compress_ratios]
    if layer_types is None and raw.get("compress_ratios") is not None:
        layer_types = []
        for r in raw["compress_ratios"]:
            if int(r) not in _RATIO_TO_LAYER_TYPE:
                raise UnsupportedConfigError(
                    f"config field 'compress_ratios' contains ratio {r}: only 0, 4 and 128 are "
                    "supported (V4.1 ratio-1/2 layers are not implemented)"
                )
            layer_types.append(_RATIO_TO_LAYER_TYPE[int(r)])
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    layer_types = tuple(layer_types[:n])
    if len(layer_types) != n:
        raise ValueError(f"config field 'layer_types' has {len(layer_types)} entries, need {n}")
    allowed = (SLIDING, CSA2) if is_v41 else LAYER_TYPES
    bad = [t for t in layer_types if t not in allowed]
    if bad:
        raise ValueError(f"config field 'layer_types': unknown entries {bad}; allowed {allowed}")

    mlp_types = raw.get("mlp_layer_types")
    if is_v41:
        refuse_hash_layers(raw, mlp_types)
        mlp_types = [MOE] * n
    if mlp_types is None:
        n_hash = int(get("num_hash_layers", _DEFAULT_NUM_HASH_LAYERS))
        mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    mlp_types = tuple(mlp_types[:n])
    if len(mlp_types) != n or any(t not in MLP_LAYER_TYPES for t in mlp_types):
        raise ValueError(f"config field 'mlp_layer_types'={list(mlp_types)} invalid for {n} layers")

    # rope: partial rotary factor from the field or the legacy qk_rope_head_dim.
    prf = raw.get("partial_rotary_factor")
    if prf is None:
        if raw.get("qk_rope_head_dim") is not None:
            prf = int(raw["qk_rope_head_dim"]) / head_dim
        else:
            prf = _DEFAULT_PARTIAL_ROTARY_FACTOR
    rd = int(head_dim * float(prf))
    if rd <= 0 or rd % 2 or rd > head_dim:
        raise ValueError(f"config field 'partial_rotary_factor'={prf}: rope dim {rd} invalid")
    rope_theta = float(get("rope_theta", 10000.0))
    compress_theta = float(get("compress_rope_theta", 160000.0))
    rp = raw.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        rope_main = _rope_from_dict(rp["main"], rope_theta)
        rope_compress = _rope_from_dict(rp["compress"], compress_theta)
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if not flat and isinstance(raw.get("rope_scaling"), dict):
            flat = dict(raw["rope_scaling"])  # released configs: legacy top-level rope_scaling
        flat.pop("rope_theta", None)
        rope_main = RopeConfig(theta=rope_theta)
        rope_compress = _rope_from_dict({**flat, "rope_theta": compress_theta}, compress_theta)
    if rope_main.rope_type != "default":
        raise UnsupportedConfigError("config field 'rope_parameters.main': must be plain rope")

    scoring = str(get("scoring_func", "sqrtsoftplus"))
    if scoring not in _SUPPORTED_SCORING:
        raise UnsupportedConfigError(
            f"config field 'scoring_func'={scoring!r}: supported {_SUPPORTED_SCORING}"
        )
    hidden_act = str(get("hidden_act", "silu"))
    if hidden_act != "silu":
        raise UnsupportedConfigError(f"config field 'hidden_act'={hidden_act!r}: only 'silu'")

    eos = raw.get("eos_token_id", 1)
    eos_ids = (
        tuple(int(e) for e in eos)
        if isinstance(eos, list)
        else (() if eos is None else (int(eos),))
    )
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")

    cfg = cls(
        vocab_size=int(get("vocab_size", base.vocab_size)),
        hidden_size=int(get("hidden_size", base.hidden_size)),
        moe_intermediate_size=int(
            get("moe_intermediate_size", get("intermediate_size", base.moe_intermediate_size))
        ),
        num_hidden_layers=n,
        num_attention_heads=int(get("num_attention_heads", base.num_attention_heads)),
        num_key_value_heads=1,
        head_dim=head_dim,
        q_lora_rank=int(get("q_lora_rank", base.q_lora_rank)),
        qk_rope_head_dim=rd,
        num_experts_per_tok=int(get("num_experts_per_tok", base.num_experts_per_tok)),
        n_routed_experts=int(
            get("n_routed_experts", get("num_local_experts", base.n_routed_experts))
        ),
        n_shared_experts=int(get("n_shared_experts", 1)),
        scoring_func=scoring,
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.5)),
        max_position_embeddings=int(get("max_position_embeddings", base.max_position_embeddings)),
        rope_main=rope_main,
        rope_compress=rope_compress,
        layer_types=layer_types,
        compress_rates=tuple(sorted(rates.items())),
        mlp_layer_types=mlp_types,
        hc_mult=int(get("hc_mult", 4)),
        hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", 20)),
        hc_eps=float(get("hc_eps", 1e-6)),
        swiglu_limit=float(get("swiglu_limit", 10.0)),
        sliding_window=int(get("sliding_window", 128)),
        o_groups=int(get("o_groups", 8)),
        o_lora_rank=int(get("o_lora_rank", 1024)),
        index_n_heads=int(get("index_n_heads", 64)),
        index_head_dim=int(get("index_head_dim", 128)),
        index_topk=int(get("index_topk", 512)),
        num_nextn_predict_layers=int(get("num_nextn_predict_layers", 1)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        hidden_act=hidden_act,
        q_head_norm=bool(get("q_head_norm", not is_v41)),
        hc_pre_from_prev_sublayer=bool(get("hc_pre_from_prev_sublayer", is_v41)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        torch_dtype=dtype,
        quantization=_quant_from_dict(raw),
        model_type=model_type,
        architectures=(
            v41_architectures(raw, V4_ARCHITECTURE)
            if is_v41
            else tuple(raw.get("architectures") or (V4_ARCHITECTURE,))
        ),
        extra=tuple(sorted((k, v) for k, v in raw.items() if k.startswith("dspark_"))),
        v41=v41,
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(msg)

    need(
        cfg.num_attention_heads % cfg.o_groups == 0,
        f"config fields 'num_attention_heads'={cfg.num_attention_heads} must be divisible by "
        f"'o_groups'={cfg.o_groups}",
    )
    need(
        cfg.index_head_dim >= cfg.qk_rope_head_dim,
        f"config field 'index_head_dim'={cfg.index_head_dim} must be >= rope dim "
        f"{cfg.qk_rope_head_dim}",
    )
    need(
        0 < cfg.num_experts_per_tok <= cfg.n_routed_experts,
        f"config field 'num_experts_per_tok'={cfg.num_experts_per_tok} must be in "
        f"[1, n_routed_experts={cfg.n_routed_experts}]",
    )
    need(cfg.hc_mult >= 1, f"config field 'hc_mult'={cfg.hc_mult} must be >= 1")
    need(cfg.hc_sinkhorn_iters >= 1, "config field 'hc_sinkhorn_iters' must be >= 1")
    need(cfg.sliding_window >= 1, "config field 'sliding_window' must be >= 1")
    if cfg.hc_pre_from_prev_sublayer != (cfg.v41 is not None):
        raise UnsupportedConfigError(
            f"config field 'hc_pre_from_prev_sublayer'={cfg.hc_pre_from_prev_sublayer}: "
            "supported for DeepSeek-V4.1 configs only, where it must be true (single-pass mHC)"
        )
    if cfg.n_shared_experts != 1:
        raise UnsupportedConfigError(
            f"config field 'n_shared_experts'={cfg.n_shared_experts}: only 1 is supported"
        )


__all__ = [
    "CSA",
    "CSA2",
    "V41_MODEL_TYPES",
    "HCA",
    "SLIDING",
    "HASH_MOE",
    "MOE",
    "LAYER_TYPES",
    "ModelConfig",
    "QuantConfig",
    "RopeConfig",
    "UnsupportedConfigError",
]
