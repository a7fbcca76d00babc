"""Train a DSpark draft for a target by self-distillation.

    python -m sgl_dspark.tools.train_dspark_draft --target-path DIR|tiny --data PROMPTS.jsonl \\
        --output DIR [--steps N] [--resume] ...

1. The target generates its own continuation of every training prompt with the serving engine
   (greedy, or sampled with --temperature), cached in the output directory.
2. Prompt + continuation run through the serving model runner's prefill forward with the draft's
   tap consumer: the draft's context features exactly as the engine taps them, and the target's
   next-token distributions.
3. The draft (random, or --init-draft) trains on blocks anchored in the continuations: weighted
   cross-entropy + total variation against the target + the confidence head's BCE.
4. The output directory holds the draft in the layout `--speculative-draft-model-path` loads
   (config.json + model.safetensors, `mtp.<stage>.` names), the resumable training state, the loss
   plot and training_report.md with the acceptance length the serving engine measures on
   held-out prompts before and after training.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shlex
import sys
from typing import Any

import torch

from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.entrypoints.engine import Engine
from sgl_dspark.srt.model_executor.model_runner import load_weights
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, TINY_MODEL_NAME
from sgl_dspark.srt.speculative.dspark.draft_checkpoint import (
    load_draft_weights,
    save_draft_checkpoint,
)
from sgl_dspark.tools.draft_training.data import (
    GenerationSpec,
    generate_continuations,
    load_prompts,
    split_held_out,
)
from sgl_dspark.tools.draft_training.evaluate import (
    AcceptanceResult,
    greedy_reference,
    measure_acceptance,
)
from sgl_dspark.tools.draft_training.features import TargetTaps
from sgl_dspark.tools.draft_training.objective import ObjectiveWeights
from sgl_dspark.tools.draft_training.report import plot_losses, write_report
from sgl_dspark.tools.draft_training.trainer import TrainConfig, train
from sgl_dspark.tools.init_dspark_draft import draft_config, random_draft_weights

logger = logging.getLogger(__name__)

CONTINUATIONS_FILE = "continuations.json"
INITIAL_DIR = "initial_draft"
EVAL_FILE = "acceptance.json"


def target_hf_config(target_path: str) -> dict:
    """The target's config.json contents (built-in targets: their HF config)."""
    if target_path == TINY_MODEL_NAME:
        return dict(TINY_HF_CONFIG)
    if os.path.isdir(target_path):
        with open(os.path.join(target_path, "config.json")) as f:
            return json.load(f)
    builtin = target_path.replace("-", "_")
    try:
        module = importlib.import_module(f"sgl_dspark.srt.models.{builtin}")
    except ImportError:
        raise ValueError(
            f"--target-path {target_path!r}: not a directory and not a built-in target"
        ) from None
    return dict(getattr(module, f"{builtin}_hf_config")())


def build_draft(
    args: argparse.Namespace, raw: dict, device: torch.device
) -> tuple[dict, DSparkConfig, DSparkDraftModel]:
    """The draft to train (fp32, on `device`): --init-draft's, or a seeded random one."""
    from sgl_dspark.srt.configs.model_config import ModelConfig

    if args.init_draft:
        with open(os.path.join(args.init_draft, "config.json")) as f:
            cfg = json.load(f)
        dcfg = DSparkConfig.from_dict(cfg, ModelConfig.from_hf_dict(raw), args.block_size)
        cfg["dspark_block_size"] = dcfg.block_size
        weights: Any = load_draft_weights(args.init_draft, dcfg)
    else:
        cfg, dcfg = draft_config(
            raw,
            args.num_layers,
            args.block_size or 5,
            args.markov_rank,
            args.noise_token_id,
            args.n_routed_experts,
            args.num_experts_per_tok,
        )
        weights = random_draft_weights(dcfg, args.seed).items()
    draft = DSparkDraftModel(dcfg)
    load_weights(draft, weights)
    return cfg, dcfg, draft.float().to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("target and data")
    g.add_argument("--target-path", required=True, help="target model directory, or 'tiny'")
    g.add_argument("--data", required=True, help="JSON lines: input_ids or prompt/text/question")
    g.add_argument("--output", required=True, help="directory for the draft and the run")
    g.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    g.add_argument("--context-length", type=int, default=1024)
    g.add_argument(
        "--engine-args",
        default="{}",
        help='more Engine (server) arguments as JSON, e.g. \'{"attention_backend": "torch"}\'',
    )
    g.add_argument("--max-new-tokens", type=int, default=128, help="continuation length")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="continuations: 0 greedy, else sampled"
    )
    g.add_argument("--gen-batch-size", type=int, default=32, help="prompts per generate call")
    g.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts only")
    g.add_argument("--eval-prompts", type=int, default=8, help="held out: the last N prompts")
    g.add_argument("--eval-new-tokens", type=int, default=64)
    g.add_argument("--skip-eval", action="store_true", help="no acceptance measurement")
    g.add_argument("--tap-batch-tokens", type=int, default=8192, help="tokens per feature forward")
    g.add_argument(
        "--target-topk",
        type=int,
        default=64,
        help="target probabilities kept per position (0: the whole vocabulary, exact TV)",
    )
    d = p.add_argument_group("draft")
    d.add_argument("--init-draft", default=None, help="start from this draft directory")
    d.add_argument("--num-layers", type=int, default=3, help="stages = target layers read")
    d.add_argument("--block-size", type=int, default=None, help="gamma (default 5)")
    d.add_argument("--markov-rank", type=int, default=64)
    d.add_argument("--noise-token-id", type=int, default=None)
    d.add_argument("--n-routed-experts", type=int, default=None)
    d.add_argument("--num-experts-per-tok", type=int, default=None)
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    t.add_argument("--anchors-per-seq", type=int, default=16, help="blocks per sequence")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--ce-weight", type=float, default=0.1)
    t.add_argument("--tv-weight", type=float, default=0.9)
    t.add_argument("--confidence-weight", type=float, default=1.0)
    t.add_argument("--position-decay", type=float, default=4.0, help="weight exp(-(k-1)/decay)")
    t.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp32")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--resume", action="store_true", help="continue from the output's state")
    t.add_argument("--stop-after", type=int, default=None, help="steps of this run (resumable)")
    t.add_argument("--time-limit-min", type=float, default=None, help="save and stop after")
    t.add_argument(
        "--time-budget-min",
        type=float,
        default=None,
        help="fit the whole run (schedule included) into this much training time: --steps is "
        "lowered to what the first steps' speed allows",
    )
    t.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bf16" if device.type == "cuda" else "fp32"
    compute_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    os.makedirs(args.output, exist_ok=True)
    raw = target_hf_config(args.target_path)
    engine_args: dict[str, Any] = {
        "model_path": args.target_path,
        "device": device_name,
        "context_length": args.context_length,
        **json.loads(args.engine_args),
    }
    try:
        engine = Engine(**engine_args)
    except (OSError, RuntimeError) as e:
        # A target without a tokenizer still trains on token-id prompts.
        logger.warning("target tokenizer not loaded (%s): prompts must give input_ids", e)
        engine_args["skip_tokenizer_init"] = True
        engine = Engine(**engine_args)
    engine_args["skip_tokenizer_init"] = True  # evaluation engines read token ids only
    prompts = load_prompts(args.data, engine)[: args.max_prompts]
    n_eval = 0 if args.skip_eval else args.eval_prompts
    train_prompts, eval_prompts = split_held_out(prompts, n_eval) if n_eval else (prompts, [])
    spec = GenerationSpec(args.target_path, args.max_new_tokens, args.temperature, args.seed)
    continuations = generate_continuations(
        engine,
        train_prompts,
        spec,
        args.gen_batch_size,
        os.path.join(args.output, CONTINUATIONS_FILE),
        progress=not args.no_progress,
    )
    cfg_dict, dcfg, draft = build_draft(args, raw, device)
    taps = TargetTaps(engine.runner, dcfg.target_layer_ids, args.target_topk)
    sequences = [p + c for p, c in zip(train_prompts, continuations)]
    data = taps.extract(sequences, args.tap_batch_tokens)
    prompt_lens = [len(p) for p in train_prompts]

    eval_path = os.path.join(args.output, EVAL_FILE)
    evals: dict[str, Any] = {}
    if os.path.isfile(eval_path) and args.resume:
        with open(eval_path) as f:
            evals = json.load(f)
    reference: list[list[int]] = []
    if eval_prompts:
        reference = greedy_reference(engine, eval_prompts, args.eval_new_tokens)
    if eval_prompts and "initial" not in evals:
        initial_dir = os.path.join(args.output, INITIAL_DIR)
        save_draft_checkpoint(draft.state_dict(), dcfg, cfg_dict, initial_dir)
        evals["initial"] = measure_acceptance(
            initial_dir, eval_prompts, reference, args.eval_new_tokens, engine_args
        ).__dict__
        with open(eval_path, "w") as f:
            json.dump(evals, f, indent=2)

    cfg = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        anchors_per_seq=args.anchors_per_seq,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        seed=args.seed,
        save_every=args.save_every,
        weights=ObjectiveWeights(
            args.ce_weight, args.tv_weight, args.confidence_weight, args.position_decay
        ),
    )
    state = train(
        draft,
        engine.runner.model,
        data,
        prompt_lens,
        cfg,
        args.output,
        compute_dtype=compute_dtype,
        resume=args.resume,
        stop_after=args.stop_after,
        time_limit_s=None if args.time_limit_min is None else 60 * args.time_limit_min,
        progress=not args.no_progress,
        time_budget_s=None if args.time_budget_min is None else 60 * args.time_budget_min,
    )
    total_steps = state.total_steps or cfg.steps
    result: dict[str, Any] = {"step": state.step, "finished": state.step >= total_steps}
    if state.step < total_steps:
        logger.info("stopped at step %d of %d: rerun with --resume", state.step, total_steps)
        return result
    save_draft_checkpoint(draft.state_dict(), dcfg, cfg_dict, args.output)
    if eval_prompts:
        evals["trained"] = measure_acceptance(
            args.output, eval_prompts, reference, args.eval_new_tokens, engine_args
        ).__dict__
        with open(eval_path, "w") as f:
            json.dump(evals, f, indent=2)
    before = AcceptanceResult(**evals["initial"]) if "initial" in evals else None
    after = AcceptanceResult(**evals["trained"]) if "trained" in evals else None
    plot = plot_losses(state.history, args.output)
    command = "python -m sgl_dspark.tools.train_dspark_draft " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    n_tokens = sum(len(c) for c in continuations)
    report = write_report(
        args.output,
        command,
        {
            "prompts file": args.data,
            "training prompts": len(train_prompts),
            "held-out prompts": len(eval_prompts),
            "continuation tokens": n_tokens,
            "continuations": "greedy" if args.temperature == 0 else f"T={args.temperature}",
            "target": args.target_path,
        },
        {
            "device": device_name,
            "dtype": dtype_name,
            "block size": dcfg.block_size,
            "stages (target layers)": list(dcfg.target_layer_ids),
            "markov rank": dcfg.markov_rank,
            "training": cfg,
        },
        state.history,
        before,
        after,
        plot,
    )
    logger.info("draft written to %s; report %s", args.output, report)
    result.update(evals)
    return result


if __name__ == "__main__":
    main()
