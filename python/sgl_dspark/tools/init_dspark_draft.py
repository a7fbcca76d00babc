"""Write a randomly initialised DSpark draft for a DeepSeek-V4 target directory.

    python -m sgl_dspark.tools.init_dspark_draft --target-path DIR --output DIR \\
        [--num-layers N] [--block-size G] [--markov-rank R] [--seed S]

`--target-path tiny` reads the built-in tiny model's materialised directory. The draft reads the
features of the target's last N layers, so it has N stages. Its config.json
is the target's plus `dspark_*` keys; tensors use SGLang's `mtp.<stage>.` names. A random draft
is useful to test losslessness (it disagrees with the target almost always) and to benchmark
with simulated acceptance; it predicts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.entrypoints.builtin_dirs import BUILTIN_MODELS, materialize
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.models.tiny import tiny_weights
from sgl_dspark.srt.speculative.dspark.draft_checkpoint import save_draft_checkpoint

logger = logging.getLogger(__name__)


def draft_config(
    raw: dict,
    num_layers: int = 3,
    block_size: int = 5,
    markov_rank: int = 64,
    noise_token_id: int | None = None,
    n_routed_experts: int | None = None,
    num_experts_per_tok: int | None = None,
) -> tuple[dict, DSparkConfig]:
    """The draft's config.json (the target's `raw` config plus `dspark_*` keys) and its parsed
    form, for a draft reading the target's last `num_layers` layers."""
    target = ModelConfig.from_hf_dict(raw)
    if not 1 <= num_layers <= target.num_hidden_layers:
        raise ValueError(f"--num-layers {num_layers} must be in [1, {target.num_hidden_layers}]")
    layers = list(range(target.num_hidden_layers - num_layers, target.num_hidden_layers))
    cfg = {
        **raw,
        "dspark_block_size": block_size,
        "dspark_markov_rank": markov_rank,
        "dspark_noise_token_id": (
            target.vocab_size - 1 if noise_token_id is None else noise_token_id
        ),
        "dspark_target_layer_ids": layers,
        "dspark_n_routed_experts": n_routed_experts or target.n_routed_experts,
        "dspark_num_experts_per_tok": num_experts_per_tok or target.num_experts_per_tok,
        "enable_confidence_head": True,
    }
    cfg.pop("quantization_config", None)
    return cfg, DSparkConfig.from_dict(cfg, target)


def random_draft_weights(dcfg: DSparkConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights of every draft tensor (internal names)."""
    model = DSparkDraftModel(dcfg)
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    return dict(tiny_weights(dcfg.stage_config, shapes, seed=seed))


def init_dspark_draft(
    target_path: str,
    output: str,
    num_layers: int = 3,
    block_size: int = 5,
    markov_rank: int = 64,
    seed: int = 0,
    noise_token_id: int | None = None,
    n_routed_experts: int | None = None,
    num_experts_per_tok: int | None = None,
) -> DSparkConfig:
    if target_path in BUILTIN_MODELS:
        target_path = materialize(target_path)
        logger.info("built-in target materialised at %s", target_path)
    with open(os.path.join(target_path, "config.json")) as f:
        raw = json.load(f)
    cfg, dcfg = draft_config(
        raw,
        num_layers,
        block_size,
        markov_rank,
        noise_token_id,
        n_routed_experts,
        num_experts_per_tok,
    )
    save_draft_checkpoint(random_draft_weights(dcfg, seed), dcfg, cfg, output)
    return dcfg


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--target-path",
        required=True,
        help="target model directory (config.json), or a built-in model ('tiny')",
    )
    p.add_argument("--output", required=True, help="directory to write the draft into")
    p.add_argument("--num-layers", type=int, default=3, help="draft stages (target layers read)")
    p.add_argument("--block-size", type=int, default=5, help="gamma: drafts per step")
    p.add_argument("--markov-rank", type=int, default=64, help="rank r of the Markov head")
    p.add_argument(
        "--noise-token-id", type=int, default=None, help="mask token id (default: vocab_size - 1)"
    )
    p.add_argument("--n-routed-experts", type=int, default=None)
    p.add_argument("--num-experts-per-tok", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    init_dspark_draft(
        a.target_path,
        a.output,
        a.num_layers,
        a.block_size,
        a.markov_rank,
        a.seed,
        a.noise_token_id,
        a.n_routed_experts,
        a.num_experts_per_tok,
    )


if __name__ == "__main__":
    main()
