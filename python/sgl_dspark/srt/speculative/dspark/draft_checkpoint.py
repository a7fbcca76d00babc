"""DSpark draft checkpoints in SGLang's layout: tensors under `mtp.<stage>.`,
FP8 block scales as `.scale`, per-expert `ffn.experts.<e>.w{1,2,3}` (FP8 or MXFP4).

Stage tensors reuse the target's released-name table (`layers.<k>.<suffix>`), so a draft stage
loads exactly like a target layer.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.model_loader.name_mapping import (
    ExpertSlot,
    expert_stack_of,
    hf_to_released,
    parse_checkpoint_name,
    released_expert_name,
)
from sgl_dspark.srt.model_loader.quantization import dequantize_fp8_block, dequantize_mxfp4
from sgl_dspark.srt.model_loader.weight_utils import find_safetensors_files

logger = logging.getLogger(__name__)

_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")
# DSpark-only tensors: checkpoint suffix (after `mtp.<k>.`) -> internal name.
_OWN = {
    "main_proj.weight": "main_proj.weight",
    "main_norm.weight": "main_norm.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "markov_head.embed.weight": "markov_head.embed.weight",
    "markov_head.head.weight": "markov_head.head.weight",
    "confidence_head.proj.weight": "confidence_head.proj.weight",
}
_OWN_INV = {v: k for k, v in _OWN.items()}
_IGNORED = (
    "ffn.gate.bias_vl",
    "emb.tok_emb.weight",
    "head.weight",
    "e_proj",
    "h_proj",
    "enorm.weight",
    "hnorm.weight",
)


def _internal_name(
    stored: str, num_stages: int, num_experts: int
) -> tuple[str, str, ExpertSlot | None] | None:
    m = _MTP_RE.match(stored)
    if m is None:
        return None
    stage, suffix = int(m.group(1)), m.group(2)
    if suffix.startswith(_IGNORED):
        return None
    if suffix in _OWN:
        return (_OWN[suffix], "weight", None)
    base = suffix.removesuffix(".scale")
    if base + ".weight" in _OWN and suffix.endswith(".scale"):
        return (_OWN[base + ".weight"], "scale", None)
    if stage >= num_stages:
        raise ValueError(
            f"draft tensor {stored!r}: stage {stage} but the draft has "
            f"{num_stages} stages (len(target_layer_ids))"
        )
    mapped = parse_checkpoint_name(f"layers.{stage}.{suffix}", num_stages, num_experts)
    assert mapped is not None
    return (mapped.hf_name, mapped.role, mapped.expert)


def load_draft_weights(path: str, dcfg: DSparkConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield internal-named, dequantised fp32 tensors of the draft (every `mtp.*` tensor)."""
    n_exp = dcfg.stage_config.n_routed_experts
    block = (128, 128)
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]]] = (
        defaultdict(dict)
    )
    expert_scales: dict[tuple[str, int, str], torch.Tensor] = {}
    for file in find_safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                mapped = _internal_name(stored, dcfg.num_stages, n_exp)
                if mapped is None:
                    continue
                name, role, expert = mapped
                t = f.get_tensor(stored)
                if expert is not None:
                    key = (expert.expert, expert.proj)
                    if role == "scale":
                        expert_scales[(name, *key)] = t
                    else:
                        experts[name][key] = (t, None)
                elif role == "scale":
                    scales[name] = t
                else:
                    weights[name] = t
    if not weights:
        raise ValueError(f"{path!r} holds no DSpark draft tensors (expected names 'mtp.<k>.*')")
    for name, w in weights.items():
        if name in scales:
            yield name, dequantize_fp8_block(w, scales.pop(name), block)
        elif w.dtype in (torch.float8_e4m3fn,):
            raise ValueError(f"draft tensor {name!r} is FP8 but has no '.scale'")
        else:
            yield name, w.float() if w.is_floating_point() else w
    if scales:
        raise ValueError(f"draft scales without weights: {sorted(scales)[:3]}")
    for name, parts in experts.items():
        rows = []
        for e in range(n_exp):
            mats = []
            projs = ("w2",) if name.endswith("down_proj") else ("w1", "w3")
            for proj in projs:
                if (e, proj) not in parts:
                    raise ValueError(f"draft checkpoint is missing expert {e} {proj} of {name!r}")
                w = parts[(e, proj)][0]
                s = expert_scales.get((name, e, proj))
                if w.dtype in (torch.uint8, torch.int8):
                    if s is None:
                        raise ValueError(f"MXFP4 expert {e} {proj} of {name!r} has no scale")
                    w = dequantize_mxfp4(w, s)
                elif s is not None:
                    w = dequantize_fp8_block(w, s, block)
                mats.append(w.float())
            rows.append(torch.cat(mats, dim=0))
        yield name, torch.stack(rows)


def save_draft_checkpoint(
    state_dict: dict[str, torch.Tensor], dcfg: DSparkConfig, config_dict: dict, out_dir: str
) -> None:
    """Write a draft in the `mtp.<k>.` layout (unquantised) plus its config.json."""
    last = dcfg.num_stages - 1
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        t = t.detach().contiguous().cpu()
        if name in _OWN_INV:
            stage = 0 if name.startswith("main_") else last
            out[f"mtp.{stage}.{_OWN_INV[name]}"] = t
            continue
        stack = expert_stack_of(name)
        if stack is not None:
            layer, kind = stack
            for e in range(t.shape[0]):
                if kind == "down_proj":
                    out["mtp." + released_expert_name(layer, e, "w2")[len("layers.") :]] = t[e]
                else:
                    inter = t.shape[1] // 2
                    for proj, part in (("w1", t[e, :inter]), ("w3", t[e, inter:])):
                        name_e = released_expert_name(layer, e, proj)  # type: ignore[arg-type]
                        out["mtp." + name_e[len("layers.") :]] = part.contiguous()
            continue
        out["mtp." + hf_to_released(name)[len("layers.") :]] = t
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2, sort_keys=True)
    logger.info("wrote DSpark draft (%d tensors) to %s", len(out), out_dir)
