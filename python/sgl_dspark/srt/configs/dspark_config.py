"""DSpark draft configuration: resolved once from the draft's config.json.

Key precedence: `dspark_<key>` at top level > nested `dspark_config` > nested `dflash_config` >
plain top-level key (a composite V4.1 config's `text_config` keys count as top-level keys, below
those written at the top level itself). The draft stages inherit the layer shape of the target (hidden size, heads,
mHC, ...) with the draft's own expert count / top-k and sliding window.

A DeepSeek-V4.1 target's stages are V4.1 window-only layers (`stage_v41`): single-pass mHC (no
hyper head: the output is the last FFN site's collapse), no per-head q norm, the V4.1 router and
experts (gate temperature, the route weight before the down projection), the FP8 window
quantiser on their KV rows; no compressed attention, no Engram. The entries of the target's
`compress_ratios` past its backbone describe the draft layers and must be 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from sgl_dspark.srt.configs.deepseek_v41 import V41Config
from sgl_dspark.srt.configs.model_config import MOE, SLIDING, ModelConfig, UnsupportedConfigError

DEFAULT_BLOCK_SIZE = 7


@dataclass(frozen=True, slots=True)
class DSparkConfig:
    block_size: int  # gamma: drafts proposed per step
    markov_rank: int  # r
    noise_token_id: int  # mask token fed after the anchor
    target_layer_ids: tuple[int, ...]  # target layers whose features feed the draft (= stages)
    enable_confidence_head: bool
    stage_config: ModelConfig  # V4 layer shape of the draft stages
    markov_head_type: str = "vanilla"

    @property
    def num_stages(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], target: ModelConfig, block_size_override: int | None = None
    ) -> DSparkConfig:
        text = raw.get("text_config")
        if isinstance(text, dict):
            # A composite DeepSeek-V4.1 config.json keeps the text model's fields (dspark_*
            # included) in `text_config`; keys at the top level win.
            raw = {**text, **{k: v for k, v in raw.items() if k != "text_config"}}
        nested = [raw.get("dspark_config") or {}, raw.get("dflash_config") or {}]

        def get(key: str, *aliases: str, default: Any = None) -> Any:
            if f"dspark_{key}" in raw:
                return raw[f"dspark_{key}"]
            for d in nested:
                for k in (key, *aliases):
                    if k in d:
                        return d[k]
            for k in (key, *aliases):
                if k in raw:
                    return raw[k]
            return default

        gamma = block_size_override or get("block_size", default=None)
        if gamma is None:
            gamma = DEFAULT_BLOCK_SIZE
        gamma = int(gamma)
        if gamma < 1:
            raise ValueError(f"DSpark block size must be >= 1, got {gamma}")
        rank = int(get("markov_rank", default=0))
        if rank <= 0:
            raise ValueError(
                "DSpark config field 'markov_rank' must be > 0 (the Markov head is required)"
            )
        head_type = str(get("markov_head_type", default="vanilla"))
        if head_type != "vanilla":
            raise UnsupportedConfigError(
                f"DSpark config field 'markov_head_type'={head_type!r}: only 'vanilla' is "
                "implemented"
            )
        if not bool(get("sample_from_anchor", default=True)):
            raise UnsupportedConfigError(
                "DSpark config field 'sample_from_anchor'=false (the DFlash layout) is not "
                "implemented"
            )
        noise = get("noise_token_id", "mask_token_id")
        if noise is None or not 0 <= int(noise) < target.vocab_size:
            raise ValueError(
                f"DSpark config field 'noise_token_id'={noise!r} must index the "
                f"target embedding (vocab {target.vocab_size})"
            )
        layers = get("target_layer_ids")
        if not layers:
            raise ValueError("DSpark config field 'target_layer_ids' is required")
        layers = tuple(int(x) for x in layers)
        bad = [x for x in layers if not 0 <= x < target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"DSpark config field 'target_layer_ids' has layers {bad} outside the "
                f"target's {target.num_hidden_layers} layers"
            )
        n_stages = len(layers)
        window = int(get("sliding_window", "window_size", default=target.sliding_window))
        v41 = None if target.v41 is None else stage_v41(target.v41, n_stages)
        stage_cfg = dataclasses.replace(
            target,
            num_hidden_layers=n_stages,
            layer_types=(SLIDING,) * n_stages,
            mlp_layer_types=(MOE,) * n_stages,
            n_routed_experts=int(get("n_routed_experts", default=target.n_routed_experts)),
            num_experts_per_tok=int(
                get(
                    "num_experts_per_tok", "n_activated_experts", default=target.num_experts_per_tok
                )
            ),
            sliding_window=window,
            hc_mult=int(raw.get("hc_mult", target.hc_mult)),
            hc_eps=float(raw.get("hc_eps", target.hc_eps)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", target.hc_sinkhorn_iters)),
            q_head_norm=bool(raw.get("q_head_norm", target.q_head_norm)),
            v41=v41,
        )
        return cls(
            block_size=gamma,
            markov_rank=rank,
            noise_token_id=int(noise),
            target_layer_ids=layers,
            enable_confidence_head=bool(get("enable_confidence_head", default=True)),
            stage_config=stage_cfg,
            markov_head_type=head_type,
        )

    @classmethod
    def from_pretrained(
        cls, path: str, target: ModelConfig, block_size_override: int | None = None
    ) -> DSparkConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in DSpark draft directory {path!r}")
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f), target, block_size_override)


def stage_v41(target: V41Config, n_stages: int) -> V41Config:
    """The V4.1 record of the draft stages: window-only layers, no Engram, the target's router
    temperature. Raises UnsupportedConfigError when the target declares compressed draft
    layers."""
    ratios = target.draft_compress_ratios
    if any(ratios):
        raise UnsupportedConfigError(
            f"config field 'compress_ratios': the DSpark draft layers (entries past the "
            f"backbone) are {list(ratios)}; draft stages attend their sliding window only (0)"
        )
    return dataclasses.replace(
        target,
        compress_ratios=(0,) * n_stages,
        draft_compress_ratios=(),
        kv_source_layer_ids=(),
        index_source_layer_ids=(),
        candidate_source_layer_id=-1,
        candidate_topk_blocks=0,
        candidate_block_size=0,
        engram=None,
    )
