"""Training of a DeepSeek-V4.1 target from scratch: initialisation, AdamW with warmup and a cosine
schedule over a time budget (so a run split over several time-limited commands follows one
schedule), the balancing of the routed experts, resumable state, and the served directory."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.model_loader.export import write_shards
from sgl_dspark.srt.models.deepseek_v41 import DeepseekV41ForCausalLM
from sgl_dspark.srt.models.registry import model_entry
from sgl_dspark.srt.tokenizer.engram_map import compressed_token_map
from sgl_dspark.tools.target_training.data import TokenBatch, make_batches
from sgl_dspark.tools.target_training.export import quantization_config, quantize_tensors
from sgl_dspark.tools.target_training.forward import RouterStats, V41TrainingForward

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
# Tensors the loader derives from other files of the served directory.
DERIVED_TENSORS = frozenset({"model.engram_token_map"})
MAX_SHARD_BYTES = 15 * 2**20  # every served file stays under 16 MiB


@dataclass
class TargetTrainConfig:
    total_minutes: float  # the length of the whole schedule, over every resumed command
    stop_after_minutes: float  # this command trains at most this long, then saves
    tokens_per_batch: int = 32768
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    balance_loss_weight: float = 1e-3
    bias_update_rate: float = 1e-3  # the router's correction bias, moved toward balance
    eval_every: int = 200
    seed: int = 0


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    train_seconds: float = 0.0
    tokens: int = 0
    history: list[dict] = field(default_factory=list)


def build_model(hf_config: dict, tokenizer_file: str, device: str) -> DeepseekV41ForCausalLM:
    """The serving module (torch kernels), on `device`, its Engram token map from the tokenizer."""
    cfg = ModelConfig.from_hf_dict(hf_config)
    with torch.device(device):
        model = model_entry(cfg).build_model(cfg, KernelChoice())
    assert isinstance(model, DeepseekV41ForCausalLM)
    model.to(device)  # the buffers a build keeps on the host (Engram's hashing constants)
    engram = cfg.v41.engram if cfg.v41 is not None else None
    if engram is not None:
        token_map = compressed_token_map(
            tokenizer_file, cfg.vocab_size, engram.compressed_vocab_size, engram.pad_id
        )
        model.model.engram_token_map.copy_(token_map)
    return model


@torch.no_grad()
def init_weights(model: DeepseekV41ForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) matrices and embeddings, output projections scaled down by the depth,
    unit norms, zero sinks and router bias; mHC mixers start near the identity mix (small `fn`,
    `comb` biased to the diagonal) so the streams do not collapse into one."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    depth_scale = (2 * model.cfg.num_hidden_layers) ** -0.5
    n = model.cfg.hc_mult
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if leaf == "weight" and name.endswith("norm.weight"):
            value = torch.ones(shape)
        elif leaf in ("q_weight", "k_weight", "scale"):
            value = torch.ones(shape)
        elif leaf == "sinks":
            value = torch.zeros(shape)
        elif leaf == "fn":
            value = torch.randn(shape, generator=g) * 1e-3
        elif leaf == "base":
            value = torch.zeros(shape)
            value[2 * n :] = (4.0 * torch.eye(n)).reshape(-1)
        else:
            std = 0.02
            if name.endswith(("o_b_proj.weight", "down_proj.weight", "down_proj")):
                std *= depth_scale
            value = torch.randn(shape, generator=g) * std
        p.copy_(value.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()


def lr_at(cfg: TargetTrainConfig, step: int, train_seconds: float) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    progress = min(1.0, train_seconds / (cfg.total_minutes * 60))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _optimizer(model: torch.nn.Module, cfg: TargetTrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and not name.endswith("fn") else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def batch_loss(
    forward: V41TrainingForward, batch: TokenBatch, stats: RouterStats | None
) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over the real positions, and their count."""
    logits = forward(batch.input_ids, batch.lengths, stats)
    B, S, V = logits.shape
    targets = batch.input_ids[:, 1:]
    real = torch.arange(S - 1, device=targets.device)[None, :] < (batch.lengths[:, None] - 1)
    loss = F.cross_entropy(logits[:, :-1][real].float(), targets[real])
    return loss, int(real.sum())


@torch.no_grad()
def evaluate(forward: V41TrainingForward, batches: list[TokenBatch], device: str) -> float:
    total, count = 0.0, 0
    for batch in batches:
        loss, n = batch_loss(forward, batch.to(device), None)
        total += float(loss) * n
        count += n
    return total / max(count, 1)


@torch.no_grad()
def _rebalance(model: DeepseekV41ForCausalLM, stats: RouterStats, rate: float) -> None:
    """Move each router's correction bias toward balance: + for under-loaded experts, - for
    over-loaded ones (the bias changes the choice of experts, not their weights)."""
    gates = [layer.mlp.gate for layer in model.model.layers]  # type: ignore[union-attr]
    for gate, load in zip(gates, stats.load):
        gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def train_target(
    model: DeepseekV41ForCausalLM,
    train_seqs: list[list[int]],
    held_batches: list[TokenBatch],
    cfg: TargetTrainConfig,
    out_dir: str,
    device: str,
    pad_id: int,
    resume: bool,
    progress: Callable[[TrainState, dict], None] | None = None,
) -> TrainState:
    """Train until the schedule's end or this command's time limit; the resumable state is in
    `out_dir/train_state.pt` after every return."""
    forward = V41TrainingForward(model)
    opt = _optimizer(model, cfg)
    state = TrainState()
    state_path = os.path.join(out_dir, STATE_FILE)
    if resume and os.path.isfile(state_path):
        saved = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = TrainState(**saved["state"])
        logger.info("resumed at step %d (%.1f min trained)", state.step, state.train_seconds / 60)
    budget = cfg.total_minutes * 60
    stop_at = time.monotonic() + cfg.stop_after_minutes * 60
    batches = make_batches(train_seqs, cfg.tokens_per_batch, pad_id, cfg.seed + state.epoch)
    model.train()
    while state.train_seconds < budget and time.monotonic() < stop_at:
        if state.batch_index >= len(batches):
            state.epoch += 1
            state.batch_index = 0
            batches = make_batches(train_seqs, cfg.tokens_per_batch, pad_id, cfg.seed + state.epoch)
        start = time.monotonic()
        batch = batches[state.batch_index].to(device)
        lr = lr_at(cfg, state.step, state.train_seconds)
        for group in opt.param_groups:
            group["lr"] = lr
        stats = RouterStats()
        loss, n_tokens = batch_loss(forward, batch, stats)
        balance = stats.balance_loss()
        total = loss + cfg.balance_loss_weight * balance
        opt.zero_grad(set_to_none=True)
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        opt.step()
        _rebalance(model, stats, cfg.bias_update_rate)
        state.step += 1
        state.batch_index += 1
        state.tokens += n_tokens
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        state.train_seconds += time.monotonic() - start
        record = {
            "step": state.step,
            "loss": float(loss),
            "balance": float(balance),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": state.tokens,
            "minutes": state.train_seconds / 60,
            "max_load": float(torch.stack(stats.load).max()),
        }
        if state.step % cfg.eval_every == 0:
            model.eval()
            record["held_out_loss"] = evaluate(forward, held_batches, device)
            model.train()
        state.history.append(record)
        if progress is not None:
            progress(state, record)
    model.eval()
    final = evaluate(forward, held_batches, device)
    state.history.append({"step": state.step, "held_out_loss": final, "tokens": state.tokens})
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state)},
        state_path,
    )
    return state


def save_served_dir(
    model: DeepseekV41ForCausalLM,
    hf_config: dict,
    out_dir: str,
    dtype: torch.dtype,
    extra_files: dict[str, str],
    quantized_experts: str | None = None,
) -> None:
    """The directory `--model-path` serves: config.json, the weights in `dtype` (router bias and
    mHC parameters stay fp32, as the loader keeps them) in shards under 16 MiB, and
    `extra_files` (name -> source path: tokenizer files, license notes). With
    `quantized_experts` ("bf16", "fp8" or "mxfp4") the release's FP8 projections are stored
    FP8 and the routed experts in that format (`export.quantize_tensors`)."""
    import shutil

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name in DERIVED_TENSORS:
            continue
        keep_fp32 = t.dtype != torch.float32 or name.endswith(
            ("_hc.fn", "_hc.base", "_hc.scale", "e_score_correction_bias", "sinks")
        )
        tensors[name] = (t if keep_fp32 else t.to(dtype)).detach().cpu().contiguous()
    if quantized_experts is not None:
        tensors = quantize_tensors(tensors, quantized_experts)
        hf_config = {**hf_config, "quantization_config": quantization_config(quantized_experts)}
    write_shards(tensors, out_dir, MAX_SHARD_BYTES)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    for name, src in extra_files.items():
        shutil.copy(src, os.path.join(out_dir, name))


__all__ = [
    "DERIVED_TENSORS",
    "TargetTrainConfig",
    "TrainState",
    "build_model",
    "evaluate",
    "init_weights",
    "save_served_dir",
    "train_target",
]
