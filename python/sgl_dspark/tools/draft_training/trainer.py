"""The optimisation loop: AdamW with a warmup + cosine schedule and gradient clipping, bf16
autocast on CUDA (fp32 master weights) and fp32 on the CPU, and a resumable training state.

Every step's blocks are drawn from a generator seeded by (seed, step), so a run resumed from its
state file draws the same batches as an uninterrupted one and ends with the same weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from sgl_dspark.srt.models.base import BaseCausalLM
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.tools.draft_training.features import SequenceTaps
from sgl_dspark.tools.draft_training.objective import (
    ObjectiveWeights,
    cosine_lr,
    dspark_loss,
    make_block_batch,
)

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 16  # blocks per sequence per step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    weights: ObjectiveWeights = field(default_factory=ObjectiveWeights)


@dataclass
class TrainState:
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    total_steps: int | None = None  # the run's length when a time budget shortened it


def anchor_range(seq: SequenceTaps, prompt_len: int) -> range:
    """Anchor positions of a sequence: the target's continuation tokens that have a next one
    (after prefill the first generated token is the anchor, at the prompt's length)."""
    return range(prompt_len, len(seq.token_ids) - 1)


BUDGET_PROBE_STEPS = 10  # steps timed before a time budget sets the step count


def sample_step(
    data: list[SequenceTaps], prompt_lens: list[int], cfg: TrainConfig, step: int
) -> tuple[list[SequenceTaps], list[tuple[int, int]]]:
    """The sequences and anchors of `step` (a function of the random seed and `step` only)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    usable = [i for i, (s, p) in enumerate(zip(data, prompt_lens)) if len(anchor_range(s, p))]
    if not usable:
        raise ValueError("no training sequence has a continuation of two tokens or more")
    pick = torch.randperm(len(usable), generator=g)[: cfg.batch_size].tolist()
    seqs, anchors = [], []
    for j, u in enumerate(pick):
        i = usable[u]
        seqs.append(data[i])
        cand = anchor_range(data[i], prompt_lens[i])
        order = torch.randperm(len(cand), generator=g)[: cfg.anchors_per_seq].tolist()
        anchors.extend((j, cand[k]) for k in sorted(order))
    return seqs, anchors


def autocast_for(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def train(
    draft: DSparkDraftModel,
    target: BaseCausalLM,
    data: list[SequenceTaps],
    prompt_lens: list[int],
    cfg: TrainConfig,
    state_dir: str,
    compute_dtype: torch.dtype = torch.float32,
    resume: bool = False,
    stop_after: int | None = None,
    time_limit_s: float | None = None,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> TrainState:
    """Train `draft` (fp32 parameters on the target's device) in place; the state (weights,
    optimiser, schedule, history) is saved to `state_dir` every `save_every` steps and on
    return. `stop_after` / `time_limit_s`: return early (resumable) after that many steps of
    this call or that much wall time. `time_budget_s`: after the first `BUDGET_PROBE_STEPS`
    steps, shorten the run (and with it the schedule, still in its warmup) to what fits in
    that much training time at the measured speed (`state.total_steps`); the run then finishes
    normally."""
    device = next(draft.parameters()).device
    for p in target.parameters():
        p.requires_grad_(False)
    draft.train()
    opt = torch.optim.AdamW(
        draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    state = TrainState()
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_lr(s, state.total_steps or cfg.steps, cfg.warmup, cfg.min_lr_ratio)
    )
    path = os.path.join(state_dir, STATE_FILE)
    if resume and os.path.isfile(path):
        saved = torch.load(path, map_location=device, weights_only=False)
        if saved["config"] != asdict(cfg):
            raise ValueError(
                f"--resume: {path} was written with other training settings "
                f"({saved['config']}); rerun with the same flags or a new --output"
            )
        draft.load_state_dict(saved["draft"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        state = TrainState(saved["step"], saved["history"], saved.get("total_steps"))
        logger.info("resumed at step %d from %s", state.step, path)
    pool_dtype = compute_dtype
    start_step, t0 = state.step, time.monotonic()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=state.step, desc="draft training", unit="step")
    while state.step < (state.total_steps or cfg.steps):
        seqs, anchors = sample_step(data, prompt_lens, cfg, state.step)
        batch = make_block_batch(seqs, anchors, draft.dcfg.block_size).to(device)
        with autocast_for(device, compute_dtype):
            parts = dspark_loss(draft, target, batch, cfg.weights, pool_dtype)
        opt.zero_grad(set_to_none=True)
        parts.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        state.step += 1
        record = {
            "step": state.step,
            "loss": float(parts.total.detach()),
            "ce": parts.ce,
            "tv": parts.tv,
            "confidence": parts.confidence,
            "accept": parts.accept,
            "grad_norm": float(grad_norm),
            "lr": sched.get_last_lr()[0],
        }
        state.history.append(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", accept=f"{parts.accept:.3f}")
        if time_budget_s is not None and state.step - start_step == BUDGET_PROBE_STEPS:
            per_step = (time.monotonic() - t0) / BUDGET_PROBE_STEPS
            fits = state.step + int((time_budget_s - (time.monotonic() - t0)) / per_step)
            if fits < cfg.steps:
                logger.info(
                    "time budget: %d steps (%.3f s/step) instead of %d", fits, per_step, cfg.steps
                )
                state.total_steps = max(fits, state.step)
                if bar is not None:
                    bar.total = state.total_steps
        done = state.step >= (state.total_steps or cfg.steps)
        stopping = (stop_after is not None and state.step - start_step >= stop_after) or (
            time_limit_s is not None and time.monotonic() - t0 >= time_limit_s
        )
        if done or stopping or state.step % cfg.save_every == 0:
            save_state(path, draft, opt, sched, state, cfg)
        if stopping and not done:
            logger.info("stopping at step %d (resume with --resume)", state.step)
            break
    if bar is not None:
        bar.close()
    draft.eval()
    return state


def save_state(
    path: str,
    draft: DSparkDraftModel,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    cfg: TrainConfig,
) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(
        {
            "draft": draft.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "step": state.step,
            "history": state.history,
            "total_steps": state.total_steps,
            "config": asdict(cfg),
        },
        tmp,
    )
    os.replace(tmp, path)
