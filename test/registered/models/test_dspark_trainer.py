"""The DSpark draft trainer (`sgl_dspark.tools.train_dspark_draft`) on tiny targets.

* Its features are the serving engine's taps, bit for bit: the engine's DSpark worker records
  what its tap consumer hands the draft during a prefill, and the trainer's extraction of the
  same sequences through the same runner must give the same bits (V4 and V4.1 targets).
* Its training forward is the serving draft forward: base logits, Markov step logits (teacher
  forced with the serving loop's own drafts) and confidences equal the inference path's bits,
  and gradients reach every draft parameter.
* A resumed run ends with the weights of an uninterrupted one.
* A short run on a repetitive dataset raises the acceptance length the serving engine measures
  on held-out prompts well above the untrained draft's, and the written draft loads in the
  engine with greedy DSpark output equal to the target's own.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from sgl_dspark import Engine
from sgl_dspark.srt.model_executor.model_runner import load_weights
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.speculative.dspark.ops import create_draft_inputs_fn, create_markov_greedy_fn
from sgl_dspark.srt.speculative.dspark.sampling import confidence_head
from sgl_dspark.tools.draft_training.features import TargetTaps
from sgl_dspark.tools.draft_training.objective import (
    ObjectiveWeights,
    draft_block_forward,
    dspark_loss,
    make_block_batch,
)
from sgl_dspark.tools.draft_training.trainer import BUDGET_PROBE_STEPS, TrainConfig, train
from sgl_dspark.tools.init_dspark_draft import draft_config, init_dspark_draft, random_draft_weights
from sgl_dspark.tools.train_dspark_draft import main as train_main
from sgl_dspark.tools.train_dspark_draft import target_hf_config
from v41_random import write_random_v41


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops: one intra-op thread avoids the pool's synchronisation on a shared CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sequences(seed: int, count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            5, vocab, (int(torch.randint(6, 40, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(count)
    ]


def _engine_prefill_features(engine: Engine, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The features the serving worker's tap consumer hands the draft, per target forward."""
    spec = engine.spec
    assert spec is not None
    draft = spec.worker.draft
    seen: list[torch.Tensor] = []
    write = draft.write_context_kv

    def record(features, positions, pools, slots):
        seen.append(features.clone())
        return write(features, positions, pools, slots)

    draft.write_context_kv = record
    try:
        engine.generate(input_ids=seqs, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    finally:
        del draft.write_context_kv
    return seen


@pytest.fixture(scope="module")
def v41_target(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("v41")
    target = write_random_v41("r2_candidates_hc3_engram", root / "target", seed=0)
    draft = root / "draft"
    init_dspark_draft(
        str(target), str(draft), num_layers=2, block_size=3, markov_rank=8, noise_token_id=3
    )
    return str(target), str(draft)


@pytest.mark.parametrize("target", ["tiny", "v41", "tiny-v41"])
def test_training_features_are_the_engine_taps(target, v41_target):
    kwargs: dict = {"model_path": target}
    vocab = 512
    if target == "v41":
        kwargs = {"model_path": v41_target[0], "speculative_draft_model_path": v41_target[1]}
        vocab = 320
    elif target == "tiny-v41":
        # The built-in V4.1 target and its built-in draft.
        from sgl_dspark.srt.models.tiny_v41 import tiny_v41_config

        vocab = tiny_v41_config().vocab_size
    engine = Engine(
        **kwargs,
        device="cpu",
        skip_tokenizer_init=True,
        context_length=128,
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=3,
    )
    seqs = _sequences(1, 5, vocab)
    served = _engine_prefill_features(engine, seqs)
    # One prefill batch of every sequence (prefix 0), then the decode step of max_new_tokens 1
    # never runs (the prefill samples the only token).
    assert len(served) == 1
    taps = TargetTaps(engine.runner, engine.spec.worker.tap_layers, top=0)
    feats, logits = taps.features_and_logits(seqs)
    assert feats.shape == served[0].shape == (sum(map(len, seqs)), served[0].shape[1])
    assert feats.abs().sum() > 0
    assert torch.equal(feats, served[0])
    # The extraction's per-sequence split keeps each sequence's rows.
    per_seq = taps.extract(seqs, max_batch_tokens=10_000)
    assert torch.equal(torch.cat([s.features for s in per_seq]), served[0].float())
    assert logits.shape == (feats.shape[0], vocab)


def _tiny_draft(block_size: int, seed: int = 3) -> tuple[dict, DSparkDraftModel]:
    cfg, dcfg = draft_config(
        target_hf_config("tiny"),
        2,
        block_size,
        16,
        noise_token_id=3,
        n_routed_experts=4,
        num_experts_per_tok=2,
    )
    draft = DSparkDraftModel(dcfg)
    load_weights(draft, random_draft_weights(dcfg, seed).items())
    return cfg, draft


def test_training_forward_equals_inference_forward():
    engine = Engine(model_path="tiny", device="cpu", skip_tokenizer_init=True, context_length=128)
    target = engine.runner.model
    gamma = 4
    _, draft = _tiny_draft(gamma)
    seqs = _sequences(2, 4, 512)
    data = TargetTaps(engine.runner, draft.dcfg.target_layer_ids, top=0).extract(seqs, 10_000)
    anchors = [(i, s) for i, seq in enumerate(seqs) for s in (0, len(seq) // 2, len(seq) - 2)]
    batch = make_block_batch(data, anchors, gamma)

    # Inference: the serving worker's calls (context KV write, draft inputs, draft forward,
    # logits, greedy Markov loop, confidence head) under inference mode.
    with torch.inference_mode():
        pools = [
            torch.zeros(batch.features.shape[0], draft.dcfg.stage_config.head_dim)
            for _ in range(draft.dcfg.num_stages)
        ]
        draft.write_context_kv(
            batch.features, batch.positions, pools, torch.arange(batch.features.shape[0])
        )
        inputs = create_draft_inputs_fn(draft.kernels)(
            batch.anchor_ids,
            batch.anchor_pos,
            batch.seq_index,
            batch.token_table,
            gamma,
            draft.dcfg.stage_config.sliding_window,
            draft.dcfg.noise_token_id,
        )
        y_inf, y_normed = draft(
            target.model.embed_tokens(inputs.input_ids),
            inputs.positions,
            pools,
            inputs.ctx_slots,
            inputs.ctx_valid,
        )
        base_inf = target.compute_logits(y_normed)
        markov = create_markov_greedy_fn(draft.kernels)(
            base_inf,
            draft.markov_head.embed.weight,
            draft.markov_head.head.weight,
            batch.anchor_ids,
        )
        conf_inf = confidence_head(
            y_inf, markov.markov_embeds, draft.confidence_head.proj.weight
        ).confidence

    # Training: differentiable, the Markov head fed the inference loop's own previous tokens.
    draft.train()
    y_tr, base_tr = draft_block_forward(draft, target, batch, torch.float32)
    prev = torch.cat([batch.anchor_ids[:, None], markov.drafts[:, :-1]], dim=1)
    z_tr, e_tr = draft.markov_head.teacher_forced_logits(base_tr, prev)
    conf_tr = confidence_head(y_tr, e_tr, draft.confidence_head.proj.weight).confidence
    assert torch.equal(base_tr, base_inf)
    assert torch.equal(z_tr, markov.step_logits)
    assert torch.equal(e_tr, markov.markov_embeds)
    assert torch.equal(conf_tr, conf_inf)
    assert torch.equal(z_tr.argmax(-1), markov.drafts)

    # Every draft parameter receives a gradient from the objective (the router's correction
    # bias only shifts which experts are picked, a non-differentiable choice).
    loss = dspark_loss(draft, target, batch, ObjectiveWeights(), torch.float32)
    loss.total.backward()
    no_grad = [
        n
        for n, p in draft.named_parameters()
        if (p.grad is None or not p.grad.abs().sum() > 0)
        and not n.endswith("e_score_correction_bias")
    ]
    assert no_grad == []


def _repetitive_prompts(seed: int, count: int, alphabet: int = 8) -> list[list[int]]:
    """`count` distinct prompts, each a short motif over a small alphabet repeated."""
    r = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < count:
        motif = [r.randrange(10, 10 + alphabet) for _ in range(r.randint(2, 4))]
        prompt = (motif * 8)[: r.randint(8, 14)]
        if prompt not in out:
            out.append(prompt)
    return out


def test_resume_equals_uninterrupted_run(tmp_path):
    engine = Engine(model_path="tiny", device="cpu", skip_tokenizer_init=True, context_length=128)
    target = engine.runner.model
    prompts = _repetitive_prompts(5, 6)
    outs = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0.0}
    )
    seqs = [p + o["output_ids"] for p, o in zip(prompts, outs)]
    data = TargetTaps(engine.runner, (3, 4), top=0).extract(seqs, 10_000)
    plens = [len(p) for p in prompts]
    cfg = TrainConfig(steps=6, batch_size=3, anchors_per_seq=4, warmup=2, save_every=100)

    _, whole = _tiny_draft(3)
    train(whole, target, data, plens, cfg, str(tmp_path / "whole"), progress=False)
    _, split = _tiny_draft(3)
    first = train(
        split, target, data, plens, cfg, str(tmp_path / "split"), stop_after=2, progress=False
    )
    assert first.step == 2
    _, resumed = _tiny_draft(3, seed=99)  # other weights: everything must come from the state
    state = train(
        resumed, target, data, plens, cfg, str(tmp_path / "split"), resume=True, progress=False
    )
    assert state.step == 6 and len(state.history) == 6
    ref, got = whole.state_dict(), resumed.state_dict()
    assert ref.keys() == got.keys()
    changed = False
    _, init = _tiny_draft(3)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
        changed |= not torch.equal(ref[k], init.state_dict()[k])
    assert changed
    with pytest.raises(ValueError, match="other training settings"):
        train(
            resumed,
            target,
            data,
            plens,
            TrainConfig(steps=7),
            str(tmp_path / "split"),
            resume=True,
            progress=False,
        )


def test_time_budget_shortens_the_run_and_its_schedule(tmp_path):
    """A budget far below the requested steps' time: after the probe steps the run is cut to
    what fits (here: nothing more) and finishes normally, its length saved with the state."""
    engine = Engine(model_path="tiny", device="cpu", skip_tokenizer_init=True, context_length=128)
    prompts = _repetitive_prompts(7, 4)
    outs = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0.0}
    )
    seqs = [p + o["output_ids"] for p, o in zip(prompts, outs)]
    data = TargetTaps(engine.runner, (3, 4), top=0).extract(seqs, 10_000)
    plens = [len(p) for p in prompts]
    cfg = TrainConfig(steps=100_000, batch_size=2, anchors_per_seq=2, warmup=2, min_lr_ratio=0.1)
    _, draft = _tiny_draft(3)
    state = train(
        draft,
        engine.runner.model,
        data,
        plens,
        cfg,
        str(tmp_path),
        progress=False,
        time_budget_s=1e-3,
    )
    assert state.total_steps == BUDGET_PROBE_STEPS == state.step
    assert len(state.history) == BUDGET_PROBE_STEPS
    saved = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert saved["step"] == saved["total_steps"] == BUDGET_PROBE_STEPS


def test_training_raises_engine_acceptance(tmp_path):
    data = tmp_path / "prompts.jsonl"
    prompts = _repetitive_prompts(0, 120)  # the last 6 are held out
    data.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "draft"
    result = train_main(
        [
            "--target-path",
            "tiny",
            "--data",
            str(data),
            "--output",
            str(out),
            "--device",
            "cpu",
            "--context-length",
            "128",
            "--max-new-tokens",
            "24",
            "--eval-prompts",
            "6",
            "--eval-new-tokens",
            "20",
            "--target-topk",
            "0",
            "--num-layers",
            "2",
            "--markov-rank",
            "16",
            "--block-size",
            "3",
            "--n-routed-experts",
            "4",
            "--steps",
            "300",
            "--batch-size",
            "8",
            "--anchors-per-seq",
            "16",
            "--warmup",
            "30",
            "--ce-weight",
            "1.0",
            "--no-progress",
        ]
    )
    before, after = result["initial"], result["trained"]
    # Lossless both ways; the trained draft is measured on prompts training never saw.
    assert before["identical"] and after["identical"]
    assert before["verify_steps"] > 0 and after["verify_steps"] > 0
    # 1.05 -> 1.61 with these settings on one thread; the bound leaves room for
    # another BLAS summation order
    assert after["accept_length"] >= before["accept_length"] + 0.35, (before, after)
    for name in ("config.json", "model.safetensors", "training_report.md", "train_state.pt"):
        assert (out / name).is_file(), name
    report = (out / "training_report.md").read_text()
    assert "| trained |" in report and "--steps 300" in report

    # The written draft loads in the engine; greedy DSpark output equals the target's own.
    held_out = [[p[0] + 1, *p[1:]] for p in _repetitive_prompts(7, 3)]
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    base = Engine(model_path="tiny", device="cpu", skip_tokenizer_init=True, context_length=128)
    spec = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=128,
        speculative_algorithm="DSpark",
        speculative_draft_model_path=str(out),
    )
    ref = [o["output_ids"] for o in base.generate(input_ids=held_out, sampling_params=params)]
    got = spec.generate(input_ids=held_out, sampling_params=params)
    assert [o["output_ids"] for o in got] == ref
    assert sum(o["meta_info"]["spec_verify_ct"] for o in got) > 0


def test_decode_time_taps_match_training_features():
    """The features the draft reads while serving a request (its prompt's prefill, then verify
    forwards a few rows at a time) are the training features of the same positions (one prefill
    of prompt + output) up to fp32 rounding: other batch shapes sum in another order."""
    engine = Engine(
        model_path="tiny",
        device="cpu",
        skip_tokenizer_init=True,
        context_length=128,
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=3,
    )
    draft = engine.spec.worker.draft
    latest: dict[int, torch.Tensor] = {}
    write = draft.write_context_kv

    def record(features, positions, pools, slots):
        # A rejected verify row is rewritten by the step that commits its position, so the
        # last write of a position is the committed token's.
        for row, pos in enumerate(positions.tolist()):
            latest[pos] = features[row].clone()
        return write(features, positions, pools, slots)

    draft.write_context_kv = record
    prompt = _sequences(4, 1, 512)[0]
    out = engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True},
    )
    del draft.write_context_kv
    assert out["meta_info"]["spec_verify_ct"] > 0
    seq = prompt + out["output_ids"]
    feats, _ = TargetTaps(engine.runner, engine.spec.worker.tap_layers, top=0).features_and_logits(
        [seq]
    )
    positions = [p for p in range(len(seq)) if p in latest]
    assert len(positions) >= len(prompt) + 20
    served = torch.stack([latest[p] for p in positions])
    trained = feats[positions]
    assert not torch.equal(served, torch.zeros_like(served))
    torch.testing.assert_close(served, trained, rtol=1e-4, atol=1e-4 * float(trained.abs().max()))
