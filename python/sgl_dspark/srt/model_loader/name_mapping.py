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

DeepSeek-V4.1 (`V41_NAMES`): HF's V4.1 modules carry the released names (its `save_pretrained`
writes them, with the four top-level renames reverted), so the released scheme covers both; the
model's parameters keep V4's module layout, with the indexer beside the compressor
(`self_attn.indexer`, keys `k_proj`/`k_norm` on kv sources), `engram.*` on Engram layers, no
hyper head, and the vision-only router bias `ffn.gate.bias_vl` dropped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
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

_HF_LAYER_SUFFIX_TO_RELEASED = {
    v: k
    for k, v in {
        **_LAYER_PLAIN,
        **{f"{k}.weight": f"{v}.weight" for k, v in _LAYER_LINEARS.items()},
    }.items()
}
_HF_GLOBAL_TO_RELEASED = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_EXPERT_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_HF_LINEAR_TO_RELEASED = {v: k for k, v in _LAYER_LINEARS.items()}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_RELEASED_EXPERT_RE = re.compile(
    r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale|weight_scale_inv)$"
)
# FP8 scale suffixes after a linear's module name: released `.scale`, HF `.weight_scale_inv`.
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class NameTable:
    """One architecture's checkpoint names: released -> model names of the top-level tensors,
    the per-layer linears (which may carry a scale) and the plain per-layer tensors; released
    aliases read on load only; stored names dropped on purpose; linears whose scale is read
    only when the weight is stored FP8 (an unquantised weight's scale is dropped); FP8 blocks
    that differ from the config's."""

    global_names: dict[str, str]
    layer_linears: dict[str, str]
    layer_plain: dict[str, str]
    load_only_aliases: dict[str, str] = field(default_factory=dict)
    dropped_layer_suffixes: frozenset[str] = frozenset()
    dropped_prefixes: tuple[str, ...] = ()
    scale_only_if_fp8: frozenset[str] = frozenset()
    fp8_block_overrides: dict[str, tuple[int, int]] = field(default_factory=dict)

    @cached_property
    def released_layer_suffix(self) -> dict[str, str]:
        linears = {f"{k}.weight": f"{v}.weight" for k, v in self.layer_linears.items()}
        return {**self.layer_plain, **linears, **self.load_only_aliases}

    @cached_property
    def hf_layer_suffixes(self) -> frozenset[str]:
        return frozenset(
            [*self.layer_plain.values(), *(f"{v}.weight" for v in self.layer_linears.values())]
        )

    @cached_property
    def hf_linear_modules(self) -> frozenset[str]:
        return frozenset(self.layer_linears.values())

    @cached_property
    def hf_global_bare(self) -> dict[str, str]:
        """HF global names without the `model.` prefix (`lm_head.weight` never has one)."""
        return {hf.removeprefix("model."): hf for hf in self.global_names.values()}

    def block_of(self, hf_name: str, default: tuple[int, int]) -> tuple[int, int]:
        """The FP8 block of a weight (per-layer overrides by module suffix)."""
        match = _HF_LAYER_RE.match(hf_name)
        if match is not None:
            module = match.group(2).removesuffix(".weight")
            for released, hf in self.layer_linears.items():
                if hf == module and released in self.fp8_block_overrides:
                    return self.fp8_block_overrides[released]
        return default

    def reads_scale_only_if_fp8(self, hf_name: str) -> bool:
        match = _HF_LAYER_RE.match(hf_name)
        if match is None:
            return False
        module = match.group(2).removesuffix(".weight")
        return any(self.layer_linears.get(r) == module for r in self.scale_only_if_fp8)


V4_NAMES = NameTable(
    global_names=_GLOBAL_NAMES,
    layer_linears=_LAYER_LINEARS,
    layer_plain=_LAYER_PLAIN,
    # transformers' `save_pretrained` reverses its `.norm.` -> `.kv_norm.` rename, so the
    # attention's own kv_norm comes back as `attn.norm.weight`; HF reads that name, so we do too.
    load_only_aliases={"attn.norm.weight": "self_attn.kv_norm.weight"},
)

V41_NAMES = NameTable(
    global_names={k: v for k, v in _GLOBAL_NAMES.items() if not k.startswith("hc_head")},
    layer_linears={
        **{k: v for k, v in _LAYER_LINEARS.items() if not k.startswith("attn.indexer")},
        "attn.indexer.wq_b": "self_attn.indexer.q_b_proj",
        "attn.indexer.weights_proj": "self_attn.indexer.weights_proj",
        "attn.indexer.wk": "self_attn.indexer.k_proj",
        "engram.wkv": "engram.wkv",
        "engram.embed": "engram.embed",
    },
    layer_plain={
        **{
            k: v
            for k, v in _LAYER_PLAIN.items()
            if not (k.startswith("attn.indexer") or k.endswith(("ape", "tid2eid")))
        },
        "attn.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
        "engram.q_weight": "engram.q_weight",
        "engram.k_weight": "engram.k_weight",
    },
    # The router bias of image tokens: text-only serving never routes an image token.
    dropped_layer_suffixes=frozenset({"ffn.gate.bias_vl"}),
    # The vision tower, its aligner and the image marker embeddings of the multimodal release.
    dropped_prefixes=("vision.", "aligner.", "image_start", "image_end", "image_newline"),
    # The Engram table's per-row scales (per 32 channels) apply to an FP8 table only.
    scale_only_if_fp8=frozenset({"engram.embed"}),
    fp8_block_overrides={"engram.embed": (1, 32)},
)

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
        "k_norm",
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


def _parse_layer_suffix(
    name: str, prefix: str, suffix: str, num_experts: int, table: NameTable
) -> MappedName:
    if suffix in table.hf_layer_suffixes or suffix in _HF_EXPERT_STACKS:
        return MappedName(prefix + suffix, "weight", None, "hf")
    if suffix in table.released_layer_suffix:
        hf_suffix = table.released_layer_suffix[suffix]
        return MappedName(prefix + hf_suffix, "weight", None, "released")
    expert = _parse_expert(name, prefix, suffix, num_experts)
    if expert is not None:
        return expert
    for scale_suffix in _SCALE_SUFFIXES:
        if not suffix.endswith(scale_suffix):
            continue
        module = suffix.removesuffix(scale_suffix)
        if module in table.hf_linear_modules:
            return MappedName(f"{prefix}{module}.weight", "scale", None, "hf")
        if module in table.layer_linears:
            hf_module = table.layer_linears[module]
            return MappedName(f"{prefix}{hf_module}.weight", "scale", None, "released")
    stack = suffix.removesuffix("_scale_inv")
    if stack != suffix and stack in _HF_EXPERT_STACKS:
        return MappedName(prefix + stack, "scale", None, "hf")
    raise ValueError(f"unexpected tensor {name!r}: unknown layer tensor {suffix!r}")


def parse_checkpoint_name(
    name: str, num_layers: int, num_experts: int, table: NameTable = V4_NAMES
) -> MappedName | None:
    """Map one stored tensor name (released, HF, or released under a `model.` prefix) with the
    names of one architecture (`table`).

    Returns None for MTP tensors and the table's dropped tensors (logged at DEBUG); raises
    ValueError for names that map to nothing, layers >= num_layers and experts >= num_experts.
    """
    bare = name.removeprefix("model.")
    if bare.startswith("mtp."):
        logger.debug("dropping MTP tensor %s (the MTP layer is not loaded)", name)
        return None
    if bare.startswith(table.dropped_prefixes):
        logger.debug("dropping %s (not used by the text model)", name)
        return None
    hf_bare = table.hf_global_bare
    if bare in hf_bare and (name != bare or bare not in table.global_names):
        return MappedName(hf_bare[bare], "weight", None, "hf")
    if bare in table.global_names:
        return MappedName(table.global_names[bare], "weight", None, "released")
    match = _LAYER_RE.match(bare)
    if match is None:
        raise ValueError(f"unexpected tensor {name!r}: not a DeepSeek-V4 tensor name")
    layer = int(match.group(1))
    _check_layer(name, layer, num_layers)
    if match.group(2) in table.dropped_layer_suffixes:
        logger.debug("dropping %s (not used by the text model)", name)
        return None
    return _parse_layer_suffix(name, f"model.layers.{layer}.", match.group(2), num_experts, table)


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
    "V4_NAMES",
    "V41_NAMES",
    "ExpertSlot",
    "NameTable",
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
