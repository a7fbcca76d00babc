"""DeepSeek-V4.1 fields of `config.json`: the CSA2 layer schedule, its per-layer roles, Engram,
and the router temperature, as one frozen record (`V41Config`) built by `parse_v41_fields`.

Roles of a backbone layer l with compress ratio m (`V41Config.role`):
* window-only (m = 0): attends its sliding window only;
* Full (a kv source): owns a compressor (latents of its ratio) and an indexer with its own index
  keys; publishes its top-k;
* Reindex (an index source, not a kv source): its own index queries scored against the keys of
  `source_of(l)`; publishes its top-k;
* Reuse (m > 0, neither): attends the latents of `source_of(l)` at the top-k last published.
Every layer computes its own queries and window KV. `source_of(l)` is the latest kv source at or
before l; the validation below makes it have l's ratio, so the per-source state of the serving
caches and the reference's single "latest publisher" slot always agree.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from sgl_dspark.srt.configs.engram_layout import (
    engram_multipliers,
    engram_offsets,
    engram_primes,
)
from sgl_dspark.srt.configs.errors import UnsupportedConfigError

# The released Flash schedule (40 backbone layers): HF's default when `compress_ratios` is absent.
_FLASH_LAYERS = 40
_FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
_FLASH_KV_SOURCES = (2, 8, 14, 20)
_FLASH_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
_SUPPORTED_RATIOS = (0, 1, 2)

# Alternative spellings of V4.1 keys -> canonical names.
FIELD_ALIASES = {
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "intermediate_size": "moe_intermediate_size",
    "num_local_experts": "n_routed_experts",
    "window_size": "sliding_window",
    "engram_pad_token_id": "engram_pad_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}

# HF `DeepseekV41TextConfig` defaults where they differ from the V4 record's defaults.
V41_DEFAULTS: dict[str, Any] = {
    "hidden_size": 5120,
    "num_hidden_layers": _FLASH_LAYERS,
    "q_lora_rank": 1280,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "moe_intermediate_size": 2304,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "rms_norm_eps": 1e-20,
    "num_nextn_predict_layers": 3,
}

_ENGRAM_REQUIRED = (
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_vocab_size",
    "engram_compressed_vocab_size",
)


class LayerRole(enum.Enum):
    WINDOW = "window"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


@dataclass(frozen=True, slots=True)
class EngramConfig:
    """n-gram hash memory added to the streams before each of `layer_ids`."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]  # table rows per engram layer
    max_ngram_size: int  # N: n-grams of sizes 2..N
    n_heads: int
    head_dim: int
    vocab_size: int  # primes are searched upwards from vocab_size - 1
    pad_id: int  # token used for missing history
    compressed_vocab_size: int  # size of the tokenizer-derived compressed token map
    # Derived (`engram_layout`): primes [layer][n-gram size - 2][head], multipliers [layer][N].
    primes: tuple[tuple[tuple[int, ...], ...], ...] = ()
    multipliers: tuple[tuple[int, ...], ...] = ()

    @property
    def ids_per_token(self) -> int:
        """Hash ids per token and engram layer: (N - 1) n-gram sizes x heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    def offsets(self, index: int) -> tuple[int, ...]:
        """Row offsets of the (n-gram, head) slices of engram layer `index`'s table."""
        return engram_offsets(self.primes[index])


@dataclass(frozen=True, slots=True)
class V41Config:
    """The V4.1-only part of a model config (see the module docstring for the roles)."""

    compress_ratios: tuple[int, ...]  # one per backbone layer, each 0, 1 or 2
    draft_compress_ratios: tuple[int, ...]  # entries past the backbone (DSpark draft stages)
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # -1: no two-level top-k
    candidate_topk_blocks: int
    candidate_block_size: int
    gate_temp: float
    engram: EngramConfig | None
    image_token_id: int | None
    has_vision_tower: bool  # a vision_config is present; image inputs are refused by the API

    def role(self, layer: int) -> LayerRole:
        if self.compress_ratios[layer] == 0:
            return LayerRole.WINDOW
        if layer in self.kv_source_layer_ids:
            return LayerRole.FULL
        if layer in self.index_source_layer_ids:
            return LayerRole.REINDEX
        return LayerRole.REUSE

    def source_of(self, layer: int) -> int | None:
        """The kv source whose latents (and index keys, ratio-2 pending pairs) `layer` reads."""
        if self.compress_ratios[layer] == 0:
            return None
        return _latest(self.kv_source_layer_ids, layer, inclusive=True)

    def topk_source_of(self, layer: int) -> int | None:
        """The index source whose top-k `layer` attends: itself, or the latest one before it."""
        if self.compress_ratios[layer] == 0:
            return None
        return _latest(self.index_source_layer_ids, layer, inclusive=True)

    def candidates_of(self, layer: int) -> int | None:
        """The candidate source whose blocks restrict this index source's top-k, if any."""
        c = self.candidate_source_layer_id
        if layer in self.index_source_layer_ids and 0 <= c < layer:
            return c
        return None

    def is_candidate_source(self, layer: int) -> bool:
        return layer == self.candidate_source_layer_id

    def is_engram_layer(self, layer: int) -> bool:
        return self.engram is not None and layer in self.engram.layer_ids


def _latest(layers: tuple[int, ...], layer: int, inclusive: bool) -> int | None:
    found = [s for s in layers if (s <= layer if inclusive else s < layer)]
    return max(found) if found else None


def resolve_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """Rename alias keys to their canonical names; both spellings with different values is an
    error naming both."""
    out = dict(raw)
    for alias, canonical in FIELD_ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if canonical in out and out[canonical] is not None and out[canonical] != value:
            raise ValueError(
                f"config fields {alias!r}={value!r} and {canonical!r}={out[canonical]!r} "
                "disagree (they are the same setting)"
            )
        if out.get(canonical) is None:
            out[canonical] = value
    return out


def _int_list(raw: dict[str, Any], key: str) -> tuple[int, ...]:
    value = raw[key]
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"config field {key!r}={value!r} must be a list of integers")
    return tuple(int(v) for v in value)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _ratios(raw: dict[str, Any], n: int, n_draft: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if raw.get("compress_ratios") is None:
        if n != _FLASH_LAYERS:
            raise ValueError(
                f"config field 'compress_ratios' is required for a DeepSeek-V4.1 model with "
                f"num_hidden_layers={n} (only the {_FLASH_LAYERS}-layer default is derived)"
            )
        return _FLASH_RATIOS, (0,) * n_draft
    ratios = _int_list(raw, "compress_ratios")
    _need(
        len(ratios) >= n,
        f"config field 'compress_ratios' has {len(ratios)} entries, need at least "
        f"num_hidden_layers={n}",
    )
    bad = sorted({r for r in ratios if r not in _SUPPORTED_RATIOS})
    if bad:
        raise UnsupportedConfigError(
            f"config field 'compress_ratios' contains {bad}: a DeepSeek-V4.1 model supports "
            f"ratios {_SUPPORTED_RATIOS} (CSA2; V4's 4/128 layers are not V4.1 layers)"
        )
    draft = ratios[n : n + n_draft]
    return ratios[:n], draft + (0,) * (n_draft - len(draft))


def _default_sources(ratios: tuple[int, ...]) -> tuple[int, ...]:
    """HF: the first layer of each run of equal nonzero ratios."""
    return tuple(i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r))


def _sources(raw: dict[str, Any], ratios: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    flash = ratios == _FLASH_RATIOS
    if raw.get("kv_source_layer_ids") is None:
        kv = _FLASH_KV_SOURCES if flash else _default_sources(ratios)
    else:
        kv = _int_list(raw, "kv_source_layer_ids")
    if raw.get("index_source_layer_ids") is None:
        index = _FLASH_INDEX_SOURCES if flash and kv == _FLASH_KV_SOURCES else kv
    else:
        index = _int_list(raw, "index_source_layer_ids")
    n = len(ratios)
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        _need(len(set(ids)) == len(ids), f"config field {key!r}={list(ids)} repeats a layer")
        for i in ids:
            _need(0 <= i < n, f"config field {key!r}: layer {i} is outside [0, {n})")
            _need(ratios[i] > 0, f"config field {key!r}: layer {i} has compress ratio 0")
    return tuple(sorted(kv)), tuple(sorted(index))


def _candidates(raw: dict[str, Any], index: tuple[int, ...]) -> tuple[int, int, int]:
    c = raw.get("candidate_source_layer_id")
    if c is None:
        if not index:
            return -1, 0, 0
        raise ValueError(
            "config field 'candidate_source_layer_id' is required for a DeepSeek-V4.1 model "
            "with index sources (an index source layer id, or -1 for no candidate blocks)"
        )
    c = int(c)
    if c < 0:
        return -1, 0, 0
    _need(
        c in index,
        f"config field 'candidate_source_layer_id'={c} must be one of "
        f"index_source_layer_ids={list(index)}",
    )
    sizes = []
    for key in ("candidate_topk_blocks", "candidate_block_size"):
        _need(raw.get(key) is not None, f"config field {key!r} is required with a candidate source")
        value = int(raw[key])
        _need(value >= 1, f"config field {key!r}={value} must be >= 1")
        sizes.append(value)
    return c, sizes[0], sizes[1]


def _engram(raw: dict[str, Any], n: int) -> EngramConfig | None:
    layer_ids = _int_list(raw, "engram_layer_ids") if raw.get("engram_layer_ids") else ()
    if not layer_ids:
        return None
    for key in _ENGRAM_REQUIRED:
        _need(raw.get(key) is not None, f"config field {key!r} is required with engram_layer_ids")
    rows = _int_list(raw, "engram_num_embeddings")
    _need(
        len(rows) == len(layer_ids),
        f"config field 'engram_num_embeddings' has {len(rows)} entries for "
        f"engram_layer_ids={list(layer_ids)}",
    )
    _need(len(set(layer_ids)) == len(layer_ids), "config field 'engram_layer_ids' repeats a layer")
    for i in layer_ids:
        _need(0 <= i < n, f"config field 'engram_layer_ids': layer {i} is outside [0, {n})")
    cfg = EngramConfig(
        layer_ids=layer_ids,
        num_embeddings=rows,
        max_ngram_size=int(raw["engram_max_ngram_size"]),
        n_heads=int(raw["engram_n_heads"]),
        head_dim=int(raw["engram_head_dim"]),
        vocab_size=int(raw["engram_vocab_size"]),
        pad_id=2 if raw.get("engram_pad_id") is None else int(raw["engram_pad_id"]),
        compressed_vocab_size=int(raw["engram_compressed_vocab_size"]),
    )
    for key, value, low in (
        ("engram_max_ngram_size", cfg.max_ngram_size, 2),
        ("engram_n_heads", cfg.n_heads, 1),
        ("engram_head_dim", cfg.head_dim, 1),
        ("engram_vocab_size", cfg.vocab_size, 2),
        ("engram_compressed_vocab_size", cfg.compressed_vocab_size, 1),
    ):
        _need(value >= low, f"config field {key!r}={value} must be >= {low}")
    primes = engram_primes(layer_ids, cfg.max_ngram_size, cfg.n_heads, cfg.vocab_size)
    for layer, n_rows, layer_primes in zip(layer_ids, rows, primes):
        needed = sum(sum(heads) for heads in layer_primes)
        _need(
            n_rows >= needed,
            f"config field 'engram_num_embeddings': layer {layer} has {n_rows} rows, its hash "
            f"ids reach {needed}",
        )
    multipliers = tuple(
        engram_multipliers(layer, cfg.max_ngram_size, cfg.compressed_vocab_size)
        for layer in layer_ids
    )
    return dataclasses.replace(cfg, primes=primes, multipliers=multipliers)


def _check_roles(cfg: V41Config) -> None:
    """Layers that read shared state must find it at their own ratio and source."""
    ratios = cfg.compress_ratios
    for kv in cfg.kv_source_layer_ids:
        _need(
            kv in cfg.index_source_layer_ids,
            f"config field 'index_source_layer_ids' must contain every kv source: layer {kv} "
            "owns latents but would attend none (no top-k of its own)",
        )
    for layer, m in enumerate(ratios):
        if m == 0:
            continue
        src = cfg.source_of(layer)
        _need(
            src is not None,
            f"config field 'kv_source_layer_ids': layer {layer} (ratio {m}) has no kv source at "
            "or before it",
        )
        assert src is not None
        _need(
            ratios[src] == m,
            f"config field 'kv_source_layer_ids': layer {layer} has ratio {m} but its latest kv "
            f"source {src} has ratio {ratios[src]}",
        )
        topk = cfg.topk_source_of(layer)
        _need(
            topk is not None and cfg.source_of(topk) == src,
            f"config field 'index_source_layer_ids': layer {layer} reads the top-k of index "
            f"source {topk}, which does not score the latents of its kv source {src}",
        )
    c = cfg.candidate_source_layer_id
    if c >= 0:
        for layer in cfg.index_source_layer_ids:
            if layer > c:
                _need(
                    cfg.source_of(layer) == cfg.source_of(c),
                    f"config field 'candidate_source_layer_id'={c}: index source {layer} after "
                    "it scores another kv source's latents, so the candidate blocks do not apply",
                )


def parse_v41_fields(raw: dict[str, Any], num_layers: int, num_draft_layers: int) -> V41Config:
    """The V4.1 record of a flattened, alias-resolved config dict (`resolve_aliases`).

    Raises ValueError (UnsupportedConfigError for unsupported features) naming the field.
    """
    ratios, draft = _ratios(raw, num_layers, num_draft_layers)
    kv, index = _sources(raw, ratios)
    cand, blocks, block_size = _candidates(raw, index)
    gate_temp = 1.0 if raw.get("gate_temp") is None else float(raw["gate_temp"])
    _need(gate_temp > 0, f"config field 'gate_temp'={gate_temp} must be > 0")
    vision = raw.get("vision_config")
    image_token = raw.get("image_token_id")
    cfg = V41Config(
        compress_ratios=ratios,
        draft_compress_ratios=draft,
        kv_source_layer_ids=kv,
        index_source_layer_ids=index,
        candidate_source_layer_id=cand,
        candidate_topk_blocks=blocks,
        candidate_block_size=block_size,
        gate_temp=gate_temp,
        engram=_engram(raw, num_layers),
        image_token_id=None if image_token is None else int(image_token),
        has_vision_tower=vision not in (None, {}),
    )
    _check_roles(cfg)
    return cfg


# Keys of V4.1-only features and the value that means "feature off": a V4 config (model type
# `deepseek_v4`) may not turn them on.
_V41_ONLY_FIELDS: dict[str, tuple[Any, ...]] = {
    "engram_layer_ids": ([], None),
    "kv_source_layer_ids": ([], None),
    "index_source_layer_ids": ([], None),
    "candidate_source_layer_id": (-1, None),
    "candidate_topk_blocks": (0, None),
    "vision_config": (None, {}),
    "image_token_id": (None,),
}
V41_ARCHITECTURE = "DeepseekV41ForCausalLM"
_V41_ARCHITECTURES = (V41_ARCHITECTURE, "DeepseekV41ForConditionalGeneration")


def refuse_v41_fields(raw: dict[str, Any]) -> None:
    """A V4 config that turns on a V4.1 feature is an error naming the field."""
    for key, off_values in _V41_ONLY_FIELDS.items():
        if key in raw and raw[key] not in off_values:
            raise UnsupportedConfigError(
                f"config field {key!r}={raw[key]!r}: a DeepSeek-V4.1 feature in a "
                f"model_type={raw.get('model_type', 'deepseek_v4')!r} config (V4 layers have "
                "compress ratios 0/4/128; V4.1 configs use model_type 'deepseek_v41')"
            )
    for key in raw:
        if key.startswith("vision_") and raw[key] not in (None, {}, []):
            raise UnsupportedConfigError(f"config field {key!r}: vision models are not supported")


def refuse_hash_layers(raw: dict[str, Any], mlp_types: Any) -> None:
    """V4.1 has no hash-routed MoE layers."""
    if int(raw.get("num_hash_layers") or 0) > 0:
        raise UnsupportedConfigError(
            f"config field 'num_hash_layers'={raw['num_hash_layers']}: DeepSeek-V4.1 has no "
            "hash-routed MoE layers"
        )
    if mlp_types is not None and any(t != "moe" for t in mlp_types):
        raise UnsupportedConfigError(
            f"config field 'mlp_layer_types'={list(mlp_types)}: DeepSeek-V4.1 layers are all "
            "'moe' (no hash-routed MoE)"
        )


def v41_architectures(raw: dict[str, Any], v4_architecture: str) -> tuple[str, ...]:
    """V4.1 text and multimodal class names (and V4's, which SGLang maps V4.1 to) resolve to the
    text model this engine serves."""
    names = tuple(raw.get("architectures") or ())
    unknown = [a for a in names if a not in (*_V41_ARCHITECTURES, v4_architecture)]
    if unknown:
        raise UnsupportedConfigError(
            f"config field 'architectures'={list(names)}: a DeepSeek-V4.1 config names one of "
            f"{[*_V41_ARCHITECTURES, v4_architecture]}"
        )
    return (V41_ARCHITECTURE,)


__all__ = [
    "FIELD_ALIASES",
    "V41_ARCHITECTURE",
    "V41_DEFAULTS",
    "EngramConfig",
    "LayerRole",
    "V41Config",
    "parse_v41_fields",
    "refuse_hash_layers",
    "refuse_v41_fields",
    "resolve_aliases",
    "v41_architectures",
]
