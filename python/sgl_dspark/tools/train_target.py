"""Train the demo DeepSeek-V4.1 target from scratch on the demo corpus.

    python -m sgl_dspark.tools.train_target --corpus DIR --output DIR \\
        --total-minutes 16 --stop-after-minutes 8 [--resume] [--device cuda]

DIR (corpus) is `python -m sgl_dspark.tools.build_demo_corpus`'s output (corpus.jsonl, the
tokenizer, DATA_LICENSE.md). The schedule (warmup, cosine decay) runs over `--total-minutes` of
training time; each command stops after `--stop-after-minutes` and saves
`OUTPUT/train_state.pt`, and `--resume` continues it, so a run fits time-limited commands. Every
command writes the served directory `OUTPUT/model` (config.json, weight shards under 16 MiB,
tokenizer, license notes), `OUTPUT/training_log.jsonl`, `OUTPUT/loss.png` and
`OUTPUT/training_report.md`. Train a draft for it with `python -m
sgl_dspark.tools.train_dspark_draft --target-path OUTPUT/model ...`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys

import torch

from sgl_dspark.srt.tokenizer.engram_map import tokenizer_compressed_size
from sgl_dspark.tools.target_training.data import load_records, make_batches
from sgl_dspark.tools.target_training.demo_target import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SELECTION_COVERS,
    demo_target_hf_config,
)
from sgl_dspark.tools.target_training.trainer import (
    TargetTrainConfig,
    TrainState,
    build_model,
    init_weights,
    save_served_dir,
    train_target,
)

logger = logging.getLogger(__name__)

CORPUS_FILES = ("tokenizer.json", "tokenizer_config.json", "DATA_LICENSE.md")


def _progress_printer(every: int):
    from tqdm import tqdm

    bar = tqdm(desc="training", unit="step", dynamic_ncols=True, mininterval=2.0)

    def show(state: TrainState, record: dict) -> None:
        bar.update(1)
        if state.step % every == 0 or "held_out_loss" in record:
            shown = {k: round(v, 4) for k, v in record.items() if isinstance(v, float)}
            bar.set_postfix(shown, refresh=False)
            if "held_out_loss" in record:
                bar.write(json.dumps(record))

    return show


def _plot(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history if "loss" in r]
    losses = [r["loss"] for r in history if "loss" in r]
    held = [(r["step"], r["held_out_loss"]) for r in history if "held_out_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.6, label="train (batch)")
    if held:
        ax.plot(*zip(*held), "o-", label="held out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _report(args: argparse.Namespace, state: TrainState, stats: dict, path: str) -> None:
    held = [r for r in state.history if "held_out_loss" in r]
    lines = [
        "# Demo target training report",
        "",
        f"Command: `python -m sgl_dspark.tools.train_target {shlex.join(sys.argv[1:])}`",
        "",
        f"- steps: {state.step}, epochs started: {state.epoch + 1}, tokens: {state.tokens:,}",
        f"- training time: {state.train_seconds / 60:.1f} of {args.total_minutes} min",
        f"- device: {stats['device']}, parameters: {stats['parameters']:,}",
        f"- corpus: {stats['train_records']:,} training records, {stats['held_records']:,} "
        f"held out, {stats['dropped']} longer than {args.max_len} tokens dropped",
        f"- held-out loss: {held[-1]['held_out_loss']:.4f} nats/token" if held else "",
        f"- the indexer selection covers every visible group up to {SELECTION_COVERS} tokens",
        "",
        "![loss](loss.png)",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv: list[str] | None = None) -> TrainState:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", required=True, help="build_demo_corpus output directory")
    p.add_argument("--output", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--total-minutes", type=float, required=True)
    p.add_argument("--stop-after-minutes", type=float, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tokens-per-batch", type=int, default=32768)
    p.add_argument("--max-len", type=int, default=SELECTION_COVERS)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--held-out-share", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokenizer_file = os.path.join(args.corpus, "tokenizer.json")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(tokenizer_file).get_vocab_size(with_added_tokens=True)
    hf_config = demo_target_hf_config(vocab, tokenizer_compressed_size(tokenizer_file))
    train_seqs, held_seqs, dropped = load_records(
        args.corpus, tokenizer_file, BOS_ID, EOS_ID, args.max_len, args.held_out_share
    )
    held_batches = make_batches(held_seqs, args.tokens_per_batch, PAD_ID, seed=12345)
    torch.manual_seed(args.seed)
    model = build_model(hf_config, tokenizer_file, args.device)
    init_weights(model, args.seed)
    cfg = TargetTrainConfig(
        total_minutes=args.total_minutes,
        stop_after_minutes=args.stop_after_minutes or args.total_minutes,
        tokens_per_batch=args.tokens_per_batch,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        eval_every=args.eval_every,
        seed=args.seed,
    )
    os.makedirs(args.output, exist_ok=True)
    state = train_target(
        model,
        train_seqs,
        held_batches,
        cfg,
        args.output,
        args.device,
        PAD_ID,
        args.resume,
        progress=_progress_printer(50),
    )
    with open(os.path.join(args.output, "training_log.jsonl"), "w") as f:
        for record in state.history:
            f.write(json.dumps(record) + "\n")
    served = os.path.join(args.output, "model")
    extra = {name: os.path.join(args.corpus, name) for name in CORPUS_FILES}
    save_served_dir(model, hf_config, served, torch.bfloat16, extra)
    _plot(state.history, os.path.join(args.output, "loss.png"))
    stats = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_records": len(train_seqs),
        "held_records": len(held_seqs),
        "dropped": dropped,
    }
    _report(args, state, stats, os.path.join(args.output, "training_report.md"))
    logger.info("served directory: %s", served)
    return state


if __name__ == "__main__":
    main()
