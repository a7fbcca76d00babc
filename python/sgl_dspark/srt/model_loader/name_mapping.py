"""Tensor names of DeepSeek-V4 checkpoints: released names <-> HF transformers names.

Our model's parameters use exactly the HF names. A checkpoint uses one of three schemes:
* "released": DeepSeek's own names (`embed.weight`, `layers.3.attn.wq_a.weight`, per-expert
  `layers.3.ffn.experts.7.w1.weight`, FP8 block scales as `<linear>.scale`, MTP under `mtp.`);
* "hf": HF names (`model.layers.3.self_attn.q_a_proj.weight`, stacked experts, scales as
  `<linear>.weight_scale_inv` / `experts.gate_up_proj_scale_inv`);
* "mixed": what transformers' `save_pretrained` writes for this model: released layer names under
  a `model.` prefix, next to HF global names.

`parse_checkpoint_name` maps one stored name (any scheme, any `model.` prefix) to a
`MappedName`; `hf_to_released` is the inverse used by the exporter. The tables are exact (no
substring rules), so every name either maps or is reported as unexpected.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Literal, NamedTuple

logger = logging.getLogger(__name__)

NamingScheme = Literal["hf", "released"]
CheckpointScheme = Literal["hf", "released", "mixed"]
Role = Literal["weight", "scale"]
ExpertProj = Literal["w1", "w2", "w3"]

# Top-level tensors (no layer prefix): released name -> HF name.
_GLOBAL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Per-layer linear modules, which may carry an FP8 scale: released module -> HF module.
_LAYER_LINEARS = {
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}

# Per-layer tensors that are never quantised: released suffix -> HF suffix.
_LAYER_PLAIN = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}
for _hc in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        _LAYER_PLAIN[f"hc_{_hc}_{_part}"] = f"{_hc}_hc.{_part}"

_RELEASED_LAYER_SUFFIX = {
    **_LAYER_PLAIN,
    **{f"{k}.weight": f"{v}.weight" for k, v in _LAYER_LINEARS.items()},
}
_HF_LAYER_SUFFIX_TO_RELEASED = {v: k for k, v in _RELEASED_LAYER_SUFFIX.items()}
# transformers' `save_pretrained` reverses its `.norm.` -> `.kv_norm.` rename, so the attention's
# own kv_norm comes back as `attn.norm.weight`; HF reads that name, so we do too (load only).
_RELEASED_LAYER_SUFFIX["attn.norm.weight"] = "self_attn.kv_norm.weight"
_HF_GLOBAL_TO_RELEASED = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_EXPERT_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_HF_LINEAR_TO_RELEASED = {v: k for k, v in _LAYER_LINEARS.items()}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_RELEASED_EXPERT_RE = re.compile(
    r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale|weight_scale_inv)$"
)
# FP8 scale suffixes after a linear's module name: released `.scale`, HF `.weight_scale_inv`.
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
# HF global names without the `model.` prefix (`lm_head.weight` never has one).
_HF_GLOBAL_BARE = {hf.removeprefix("model."): hf for hf in _GLOBAL_NAMES.values()}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Parameters that HF keeps in float32 whatever the model dtype (`_keep_in_fp32_modules_strict`,
# matched against whole dotted components of the HF name).
FP32_NAME_COMPONENTS = frozenset(
    {
        "attn_hc",
        "ffn_hc",
        "hc_head",
        "sinks",
        "position_bias",
        "e_score_correction_bias",
        "q_a_norm",
        "kv_norm",
        "input_layernorm",
        "post_attention_layernorm",
        "norm",
    }
)
INTEGER_BUFFER_SUFFIXES = ("mlp.gate.tid2eid",)


class ExpertSlot(NamedTuple):
    """One routed expert's projection inside a stacked HF tensor."""

    expert: int
    proj: ExpertProj  # w1 -> gate half of gate_up_proj, w3 -> up half, w2 -> down_proj


class MappedName(NamedTuple):
    """Where a stored tensor goes: `hf_name` is the weight it belongs to (for a scale, too).
    `naming` says which table matched the stored name."""

    hf_name: str
    role: Role
    expert: ExpertSlot | None = None
    naming: NamingScheme = "hf"


def is_fp32_param(hf_name: str) -> bool:
    """True for tensors HF keeps in float32 (mHC, sinks, position biases, norms, router bias)."""
    return not FP32_NAME_COMPONENTS.isdisjoint(hf_name.split("."))


def is_integer_buffer(hf_name: str) -> bool:
    return hf_name.endswith(INTEGER_BUFFER_SUFFIXES)


def detect_naming_scheme(mapped: Iterable[MappedName]) -> CheckpointScheme:
    """'released', 'hf', or 'mixed' (e.g. transformers' `save_pretrained`, which writes released
    layer names under a `model.` prefix next to HF global names)."""
    found = {m.naming for m in mapped}
    if not found:
        raise ValueError("checkpoint contains no model tensors")
    return found.pop() if len(found) == 1 else "mixed"


def _check_layer(name: str, layer: int, num_layers: int) -> None:
    if layer >= num_layers:
        raise ValueError(
            f"unexpected tensor {name!r}: layer {layer} but config has num_hidden_layers={num_layers}"
        )


def _parse_expert(name: str, prefix: str, suffix: str, num_experts: int) -> MappedName | None:
    match = _RELEASED_EXPERT_RE.match(suffix)
    if match is None:
        return None
    index, proj, kind = int(match.group(1)), match.group(2), match.group(3)
    if index >= num_experts:
        raise ValueError(
            f"unexpected tensor {name!r}: expert {index} but config has n_routed_experts={num_experts}"
        )
    stack = "mlp.experts.down_proj" if proj == "w2" else "mlp.experts.gate_up_proj"
    role: Role = "weight" if kind == "weight" else "scale"
    return MappedName(prefix + stack, role, ExpertSlot(index, proj), "released")  # type: ignore[arg-type]


def _parse_layer_suffix(name: str, prefix: str, suffix: str, num_experts: int) -> MappedName:
    if suffix in _HF_LAYER_SUFFIX_TO_RELEASED or suffix in _HF_EXPERT_STACKS:
        return MappedName(prefix + suffix, "weight", None, "hf")
    if suffix in _RELEASED_LAYER_SUFFIX:
        return MappedName(prefix + _RELEASED_LAYER_SUFFIX[suffix], "weight", None, "released")
    expert = _parse_expert(name, prefix, suffix, num_experts)
    if expert is not None:
        return expert
    for scale_suffix in _SCALE_SUFFIXES:
        if not suffix.endswith(scale_suffix):
            continue
        module = suffix.removesuffix(scale_suffix)
        if module in _HF_LINEAR_TO_RELEASED:
            return MappedName(f"{prefix}{module}.weight", "scale", None, "hf")
        if module in _LAYER_LINEARS:
            return MappedName(f"{prefix}{_LAYER_LINEARS[module]}.weight", "scale", None, "released")
    stack = suffix.removesuffix("_scale_inv")
    if stack != suffix and stack in _HF_EXPERT_STACKS:
        return MappedName(prefix + stack, "scale", None, "hf")
    raise ValueError(f"unexpected tensor {name!r}: unknown layer tensor {suffix!r}")


def parse_checkpoint_name(name: str, num_layers: int, num_experts: int) -> MappedName | None:
    """Map one stored tensor name (released, HF, or released under a `model.` prefix).

    Returns None for MTP tensors (dropped, logged at DEBUG); raises ValueError for names that
    map to nothing, layers >= num_layers and experts >= num_experts.
    """
    bare = name.removeprefix("model.")
    if bare.startswith("mtp."):
        logger.debug("dropping MTP tensor %s (the MTP layer is not loaded)", name)
        return None
    if bare in _HF_GLOBAL_BARE and (name != bare or bare not in _GLOBAL_NAMES):
        return MappedName(_HF_GLOBAL_BARE[bare], "weight", None, "hf")
    if bare in _GLOBAL_NAMES:
        return MappedName(_GLOBAL_NAMES[bare], "weight", None, "released")
    match = _LAYER_RE.match(bare)
    if match is None:
        raise ValueError(f"unexpected tensor {name!r}: not a DeepSeek-V4 tensor name")
    layer = int(match.group(1))
    _check_layer(name, layer, num_layers)
    return _parse_layer_suffix(name, f"model.layers.{layer}.", match.group(2), num_experts)


def released_module_of_hf_linear(hf_name: str) -> str | None:
    """`model.layers.3.self_attn.q_a_proj.weight` -> `layers.3.attn.wq_a` (None if not a linear)."""
    match = _HF_LAYER_RE.match(hf_name)
    if match is None or not match.group(2).endswith(".weight"):
        return None
    released = _HF_LINEAR_TO_RELEASED.get(match.group(2).removesuffix(".weight"))
    return None if released is None else f"layers.{match.group(1)}.{released}"


def hf_to_released(hf_name: str) -> str:
    """Released name of one non-expert HF tensor; stacked experts use `released_expert_name`."""
    if hf_name in _HF_GLOBAL_TO_RELEASED:
        return _HF_GLOBAL_TO_RELEASED[hf_name]
    match = _HF_LAYER_RE.match(hf_name)
    if match is not None and match.group(2) in _HF_LAYER_SUFFIX_TO_RELEASED:
        return f"layers.{match.group(1)}.{_HF_LAYER_SUFFIX_TO_RELEASED[match.group(2)]}"
    raise ValueError(f"HF tensor {hf_name!r} has no released-checkpoint name")


def expert_stack_of(hf_name: str) -> tuple[int, str] | None:
    """`model.layers.3.mlp.experts.gate_up_proj` -> (3, 'gate_up_proj'); None otherwise."""
    match = _HF_LAYER_RE.match(hf_name)
    if match is None or match.group(2) not in _HF_EXPERT_STACKS:
        return None
    return int(match.group(1)), match.group(2).rsplit(".", 1)[1]


def released_expert_name(layer: int, expert: int, proj: ExpertProj, role: Role = "weight") -> str:
    suffix = "weight" if role == "weight" else "scale"
    return f"layers.{layer}.ffn.experts.{expert}.{proj}.{suffix}"


def released_scale_name(released_weight_name: str) -> str:
    """`layers.3.attn.wq_a.weight` -> `layers.3.attn.wq_a.scale`."""
    return released_weight_name.removesuffix(".weight") + ".scale"


__all__ = [
    "ExpertSlot",
    "MappedName",
    "NamingScheme",
    "detect_naming_scheme",
    "expert_stack_of",
    "hf_to_released",
    "is_fp32_param",
    "is_integer_buffer",
    "parse_checkpoint_name",
    "released_expert_name",
    "released_module_of_hf_linear",
    "released_scale_name",
]
