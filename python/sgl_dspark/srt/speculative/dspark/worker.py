"""DSpark decode cycle (dspark.md §2): draft -> Markov sampling -> confidence -> verify lengths ->
one target verify forward (ragged) -> acceptance -> commit; rejected state is discarded by
committing a shorter length (all KV state is addressed by position, see `DeepseekV4KVPool`).

The step runs eagerly in torch. Verify lengths of the `full`/`static` policies are host values,
so the draft tokens never leave the device before the verify forward; acceptance and the
committed tokens are finalised on the device and read by the scheduler once, at the end.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.host_copy import read_to_host, to_device, to_device_packed
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.layers.fused_linear import fuse_after_placement
from sgl_dspark.srt.model_executor.cuda_graph_runner import BatchGraphs, graph_batch_sizes
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, cast_model, load_weights
from sgl_dspark.srt.models.deepseek_v4 import stream_means
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.speculative.dspark.fused_step import FusedGreedySteps
from sgl_dspark.srt.speculative.dspark.metrics import DSparkMetrics
from sgl_dspark.srt.speculative.dspark.ops import (
    create_accept_fn,
    create_draft_inputs_fn,
    create_markov_greedy_fn,
)
from sgl_dspark.srt.speculative.dspark.policy import (
    FullPolicy,
    PolicyArgs,
    StaticWidthPolicy,
    create_verify_policy,
)
from sgl_dspark.srt.speculative.dspark.sampling import (
    TOP_K_ALL,
    MarkovSampleOutput,
    confidence_head,
    draft_probs,
    markov_sample,
    target_probs,
)
from sgl_dspark.srt.speculative.dspark.sts import StsCalibration
from sgl_dspark.srt.speculative.dspark.sts_record import StsRecorder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DSparkArgs:
    policy: PolicyArgs = field(default_factory=PolicyArgs)
    sts_path: str | None = None
    simulate_accept_len: float | None = None  # benchmark-only: forced mean accept length
    sts_collect_path: str | None = None  # write (raw confidence, prefix label) shards
    bs1_block_size: int | None = None  # gamma of single-request steps (None: the same)
    seed: int = 0


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """The step's one read of its results (a module name, so tests can watch it)."""
    return read_to_host(*tensors)


class _StepTimer:
    """Segment times of a step: CUDA event pairs (read lazily by the metrics) or host ms."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = [("start", self._now())]

    def _now(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def spans(self) -> dict:
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = (a, b) if self.cuda else (b - a) * 1e3  # type: ignore[operator]
        return out


class DraftProposal(NamedTuple):
    markov: MarkovSampleOutput  # drafts [B, gamma], step logits z, Markov embeddings
    confidence: torch.Tensor | None  # [B, gamma] (None when the policy needs none)
    raw_confidence: torch.Tensor | None = None  # [B, gamma] logits before STS and sigmoid


class SpecStepOutput(NamedTuple):
    tokens: list[int]  # committed tokens (accepted drafts + bonus), in order
    logprobs: list[float]  # target logprob of each (raw verify logits)


class DSparkWorker:
    def __init__(self, runner: ModelRunner, dcfg: DSparkConfig, weights, args: DSparkArgs) -> None:
        self.runner = runner
        self.dcfg = dcfg
        self.args = args
        self.gamma = dcfg.block_size
        # The bs1 runtime (dspark.md §3.4, the seed's "bs1 gamma 7"): a single request is
        # latency-bound, so it drafts its own block size and verifies its full window.
        self.gamma_bs1 = args.bs1_block_size or self.gamma
        for name, g in (("block size", self.gamma), ("bs1 block size", self.gamma_bs1)):
            if g < 1 or g + 1 > runner.rc.max_verify_tokens:
                raise ValueError(
                    f"DSpark {name} {g} must be >= 1 and leave max_verify_tokens "
                    f">= {g + 1} (got {runner.rc.max_verify_tokens})"
                )
        draft = DSparkDraftModel(dcfg, runner.kernels, runner.rc.attention_backend)
        # "spec" family implementations, bound once (style R11).
        self.accept_fn = create_accept_fn(runner.kernels)
        self.draft_inputs_fn = create_draft_inputs_fn(runner.kernels)
        self.markov_greedy_fn = create_markov_greedy_fn(runner.kernels)
        load_weights(draft, weights)
        self.draft = cast_model(draft, runner.dtype).to(runner.device).eval()  # type: ignore[arg-type]
        fuse_after_placement(self.draft)  # after placement (see fused_linear.py)
        # Block rows reach seq + gamma - 1 (the bs1 runtime's gamma when larger).
        self.draft.build_rope_table(
            runner.req_pool.max_context_len + max(self.gamma, self.gamma_bs1)
        )
        dh = dcfg.stage_config.head_dim
        self.ctx_kv = [
            torch.zeros(runner.kv_pool.num_slots, dh, dtype=runner.dtype, device=runner.device)
            for _ in range(dcfg.num_stages)
        ]
        self.window = dcfg.stage_config.sliding_window
        self.policy = create_verify_policy(
            self.gamma, args.policy, runner.device, runner.req_pool.size
        )
        self.sts = StsCalibration.load(args.sts_path, self.gamma) if args.sts_path else None
        self.sts_temperatures = (
            None
            if self.sts is None
            else to_device(self.sts.temperatures, torch.float32, runner.device)
        )
        if self.policy.needs_confidence and not dcfg.enable_confidence_head:
            raise ValueError("the confidence verify policy needs a draft with a confidence head")
        self.generator = torch.Generator(device=runner.device).manual_seed(args.seed)
        # host-side: fed with the values each step reads anyway (see step 8)
        self.metrics = DSparkMetrics(max(self.gamma, self.gamma_bs1), device="cpu")
        self.sts_recorder = (
            StsRecorder(args.sts_collect_path, self.gamma) if args.sts_collect_path else None
        )
        self._sim_progress: dict[str, float] = {}
        runner.set_tap_hook(self._write_context_kv, self.tap_layers)
        self.draft_graphs: BatchGraphs | None = None
        self.draft_graphs_bs1: BatchGraphs | None = None
        self.epilogue_graphs: dict[int, BatchGraphs] = {}
        self.fused: FusedGreedySteps | None = None
        self._generation: dict[int, int] = {}
        if args.simulate_accept_len is not None:
            top = min(self.gamma, self.gamma_bs1) + 1
            if not 1.0 <= args.simulate_accept_len <= top:
                raise ValueError(
                    f"--speculative-dspark-simulate-accept-len must be in "
                    f"[1, {top}], got {args.simulate_accept_len}"
                )
            logger.warning(
                "DSpark SIMULATED ACCEPTANCE (mean accept length %.2f): outputs are NOT "
                "the model's; use only to benchmark",
                args.simulate_accept_len,
            )

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.dcfg.target_layer_ids

    # ---- context KV -----------------------------------------------------------------------
    def plain_decode(self, batch_size: int) -> bool:
        """The verify policy turns speculation off for this batch size (static width 1)."""
        return self.policy.plain_decode(batch_size)

    def inject(
        self, positions: torch.Tensor, slots: torch.Tensor, tap_streams: dict[int, torch.Tensor]
    ) -> None:
        """Write the draft context KV of target forward rows at `slots`, from the target's
        streams `[N, n, D]` after each tap layer (their means are the features)."""
        rows = tap_streams[self.tap_layers[0]].shape[0]
        if rows == 0:
            return
        # One stack and one mean for all tap layers: [N, n_f, n, D] -> [N, n_f * D].
        streams = torch.stack([tap_streams[layer] for layer in self.tap_layers], dim=1)
        feats = stream_means(streams, dim=2).reshape(rows, -1)
        with torch.inference_mode():
            self.draft.write_context_kv(feats, positions, self.ctx_kv, slots)

    def _write_context_kv(self, batch: ForwardBatch, taps: dict[int, torch.Tensor]) -> None:
        """The runner's tap hook: the draft's context KV of every row of every target forward
        (prefill chunks, decode steps and verify windows), inside the forward's graph when one
        runs. A verify writes its rejected rows too, at positions past the committed length:
        the step that later commits a position verifies it again and rewrites its row before
        any draft reads it, exactly as for the target's own KV, so acceptance never waits for
        this and the hook can overlap the logits and the acceptance (`set_tap_hook`)."""
        self.inject(batch.positions, batch.out_cache_loc, taps)

    def on_new_request(self, req: Req) -> None:
        self._generation[req.slot] = self._generation.get(req.slot, 0) + 1
        self._sim_progress[req.rid] = 0.0

    def close(self) -> None:
        if self.sts_recorder is not None:
            self.sts_recorder.flush()

    def on_request_done(self, req: Req) -> None:
        self._sim_progress.pop(req.rid, None)

    # ---- one decode step ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, reqs: list[Req]) -> list[SpecStepOutput]:
        runner, dev = self.runner, self.runner.device
        B = len(reqs)
        pool = runner.req_pool
        timer = _StepTimer(dev)
        seq = [r.kv_len for r in reqs]
        slots = [r.slot for r in reqs]
        params = [r.params for r in reqs]
        all_greedy = all(p.is_greedy for p in params)
        # the step's host inputs in two transfers (one per dtype)
        anchors, seq_t, slot_t, top_k, greedy_i = to_device_packed(
            [
                [r.output_ids[-1] for r in reqs],
                seq,
                slots,
                [TOP_K_ALL if p.top_k < 0 else p.top_k for p in params],
                [int(p.is_greedy) for p in params],
            ],
            torch.int64,
            dev,
        )
        greedy = greedy_i.bool()
        temp, top_p = to_device_packed(
            [[1.0 if p.is_greedy else p.temperature for p in params], [p.top_p for p in params]],
            torch.float32,
            dev,
        )
        need_trunc = any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params)

        # 1-3. draft forward, Markov sampling, confidences
        bs1 = B == 1 and self.gamma_bs1 != self.gamma
        gamma = self.gamma_bs1 if bs1 else self.gamma
        prop = self.propose(reqs, anchors, seq_t, slot_t, temp, greedy, all_greedy, gamma)
        ms, conf = prop.markov, prop.confidence
        timer.mark("draft")
        gens = [self._generation.get(s, 1) for s in slots]
        # 4. verify lengths: host values for full/static/sync policies (no device round trip);
        #    the async confidence policy verifies the full window and caps acceptance on device.
        #    The bs1 runtime always verifies its full window.
        planned = [gamma + 1] if bs1 else self.policy.verify_lens(conf, slots, gens)
        cap_lens = None
        if isinstance(planned, torch.Tensor):
            cap_lens, lens = planned - 1, [gamma + 1] * B
        else:
            lens = list(planned)
        # never verify past max_new_tokens: the request ends there anyway
        lens = [
            max(1, min(n, r.params.max_new_tokens - len(r.output_ids))) for n, r in zip(lens, reqs)
        ]
        # 5. one target verify forward. Eager: ragged widths in a flat batch (flat row (r, j)
        #    indices are host-known, so the device ids are gathered without a sync). With CUDA
        #    graphs: every request verifies the smallest captured width >= the widest request;
        #    rows past a request's own length are never accepted (acceptance reads lens_t).
        rows = self._verify_rows(reqs, lens)
        W = max(rows)
        verify_ids = torch.cat((anchors[:, None], ms.drafts), dim=1)[:, :W]  # [B, W]
        for r, n in zip(reqs, rows):
            pool.reserve(r.slot, r.kv_len + n)
        flat_r, flat_j, lens_t = to_device_packed(
            [
                [i for i, n in enumerate(rows) for _ in range(n)],
                [j for n in rows for j in range(n)],
                lens,
            ],
            torch.int64,
            dev,
        )
        uniform = all(n == W for n in rows)
        batch = ForwardBatch.build(
            ForwardMode.VERIFY,
            [[0] * n for n in rows],
            seq,
            slots,
            pool.req_to_token,
            logits_rows="all",
            input_ids_device=(
                verify_ids.reshape(-1).contiguous() if uniform else verify_ids[flat_r, flat_j]
            ),
        )
        out = runner.forward(batch, tap_layers=self.tap_layers)
        if uniform:
            logits = out.logits.view(B, W, -1)
        else:
            logits = out.logits.new_zeros((B, W, out.logits.shape[-1]))
            logits[flat_r, flat_j] = out.logits
        timer.mark("verify")
        # 6-7. acceptance on the device and the committed tokens' logprobs (the verify forward
        #    wrote the draft context KV of its rows: `_write_context_kv`). Greedy uniform steps
        #    replay this epilogue from a CUDA graph.
        epilogue = self.epilogue_graphs.get(W)
        if (
            epilogue is not None
            and uniform
            and all_greedy
            and cap_lens is None
            and self.sts_recorder is None
            and epilogue.bucket_for(B) is not None
        ):
            forced = self._sim_counts(reqs, lens_t.device)
            acc, tok_lp = epilogue.replay(verify_ids, lens_t, seq_t, logits, forced)
        else:
            acc = self._accept(
                verify_ids,
                lens_t,
                seq_t,
                logits,
                greedy,
                all_greedy,
                temp,
                top_k,
                top_p,
                need_trunc,
                ms,
                cap_lens,
                reqs,
            )
            tok_lp = _token_logprobs(logits, acc.out_tokens)
        if not bs1:
            self.policy.observe(lens_t, acc.accept_len, conf, slots, gens)
        if self.sts_recorder is not None and prop.raw_confidence is not None and not bs1:
            self.sts_recorder.record(prop.raw_confidence, verify_ids, logits, lens_t)
        timer.mark("accept")
        # 8. the scheduler reads the finalised results once, through one copy; the metrics are
        #    then accumulated on the host from the same values (no per-step metric kernels)
        commit, toks, lps, accepted, trimmed = _to_host(
            acc.commit_len, acc.out_tokens, tok_lp, acc.accept_len, acc.cap_trim
        )
        self.metrics.record_step(
            torch.tensor(lens),
            torch.tensor(accepted),
            request_ids=[r.rid for r in reqs],
            timing=timer.spans(),
            cap_trim=torch.tensor(trimmed),
        )
        for r, c in zip(reqs, commit):
            r.kv_len += c
            r.spec_verify_ct += 1
            r.spec_committed += c
        return [SpecStepOutput(t[:c], lp[:c]) for t, lp, c in zip(toks, lps, commit)]

    def _verify_rows(self, reqs: list[Req], lens: list[int]) -> list[int]:
        """Rows each request runs in the verify forward: its verify length, or with CUDA graphs
        the captured width that covers the whole batch (when one does and the context fits)."""
        graphs = self.runner.graph_runner
        if graphs is None or graphs.bucket_for(len(reqs)) is None:
            return lens
        w = graphs.width_for(max(lens))
        limit = self.runner.req_pool.max_context_len
        if w is None or any(r.kv_len + w > limit for r in reqs):
            return lens
        return [w] * len(reqs)

    # ---- CUDA graphs ----------------------------------------------------------------------
    def graph_verify_widths(self) -> tuple[int, ...]:
        """Verify widths to capture target graphs for: 1 (also the plain decode graph), the
        policy's narrow widths and the full window; every width for the confidence policy,
        whose per-request lengths are ragged."""
        full = self.gamma + 1
        if self.policy.needs_confidence:
            return tuple(sorted({*range(1, full + 1), self.gamma_bs1 + 1}))
        narrow: tuple[int, ...] = ()
        if isinstance(self.policy, StaticWidthPolicy):
            narrow = self.policy.graph_widths()
        return tuple(
            sorted({1, 2, 3, full, *narrow} & set(range(1, full + 1)) | {self.gamma_bs1 + 1})
        )

    def fused_widths(self) -> tuple[int, ...]:
        """Verify widths of the fused step graphs: those a full or table-driven static policy
        returns (host-known widths, no confidences), width 1 excepted (plain decode)."""
        policy = self.policy
        if isinstance(policy, FullPolicy):
            return (self.gamma + 1,)
        if isinstance(policy, StaticWidthPolicy) and policy.online is None:
            return tuple(w for w in policy.graph_widths() if w > 1)
        return ()

    def init_cuda_graphs(self, max_bs: int, graph_factory=None) -> None:
        """Capture the greedy draft (draft forward, Markov loop, confidences) per batch bucket.
        Sampled batches draw Gumbel noise from a generator and propose eagerly."""
        dev = self.runner.device
        example = (torch.zeros(1, dtype=torch.int64, device=dev),) * 3
        self.draft_graphs = BatchGraphs(
            functools.partial(self._propose_greedy, self.gamma),
            example,
            (0, 1, 0),
            graph_batch_sizes(max_bs),
            dev,
            graph_factory,
            name="DSpark draft graphs",
        )
        runner = self.runner
        vocab = runner.model_cfg.vocab_size
        for w in self.graph_verify_widths():

            def ex(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
                return torch.zeros((1, *shape), dtype=dtype, device=dev)

            inputs = [ex(w), ex(), ex(), ex(w, vocab, dtype=torch.float32), ex()]
            pads = [0, 0, 1, 0.0, 0]
            self.epilogue_graphs[w] = BatchGraphs(
                self._greedy_epilogue,
                inputs,
                pads,
                graph_batch_sizes(max_bs),
                dev,
                graph_factory,
                name=f"DSpark epilogue graphs (width {w})",
            )
        widths = self.fused_widths()
        if widths and self.sts_recorder is None:
            self.fused = FusedGreedySteps(self, widths, graph_batch_sizes(max_bs), graph_factory)
        if self.gamma_bs1 != self.gamma:
            self.draft_graphs_bs1 = BatchGraphs(
                functools.partial(self._propose_greedy, self.gamma_bs1),
                example,
                (0, 1, 0),
                [1],
                dev,
                graph_factory,
                name="DSpark bs1 draft graph",
            )

    def _propose_greedy(
        self,
        gamma: int,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        num_drafts: int | None = None,
    ) -> DraftProposal:
        """All-greedy proposal; `num_drafts` < gamma runs only that many Markov steps (a step
        verifying width W reads W - 1 drafts, and draft k depends on drafts < k only)."""
        ones = torch.ones(anchors.shape[0], dtype=torch.float32, device=anchors.device)
        return self._propose(anchors, seq_t, slot_t, ones, ones.bool(), True, gamma, num_drafts)

    def propose(
        self,
        reqs: list[Req],
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        temp: torch.Tensor,
        greedy: torch.Tensor,
        all_greedy: bool,
        gamma: int,
    ) -> DraftProposal:
        graphs = self.draft_graphs_bs1 if gamma != self.gamma else self.draft_graphs
        if (
            graphs is not None
            and all_greedy
            and self.sts_recorder is None
            and graphs.bucket_for(len(reqs)) is not None
        ):
            return graphs.replay(anchors, seq_t, slot_t)
        return self._propose(anchors, seq_t, slot_t, temp, greedy, all_greedy, gamma)

    def _propose(
        self,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        temp: torch.Tensor,
        greedy: torch.Tensor,
        all_greedy: bool,
        gamma: int,
        num_drafts: int | None = None,
    ) -> DraftProposal:
        """Draft forward over [anchor, mask, ...] at positions s .. s+gamma-1, then the Markov
        head (left to right) and, when the policy reads them, the confidences."""
        runner = self.runner
        inputs = self.draft_inputs_fn(
            anchors,
            seq_t,
            slot_t,
            runner.req_pool.req_to_token,
            gamma,
            self.window,
            self.dcfg.noise_token_id,
        )
        target = runner.model
        embeds = target.model.embed_tokens(inputs.input_ids)
        y, y_normed = self.draft(
            embeds, inputs.positions, self.ctx_kv, inputs.ctx_slots, inputs.ctx_valid
        )
        base_logits = target.compute_logits(y_normed)  # [B, gamma, V]
        w1, w2 = self.draft.markov_head.embed.weight, self.draft.markov_head.head.weight
        if num_drafts is not None and num_drafts < gamma:
            # The block's rows still all run (the draft attends bidirectionally inside the
            # block); only the sequential Markov loop stops early. No confidences are read.
            assert all_greedy and not (
                self.policy.needs_confidence or self.sts_recorder is not None
            )
            base_logits = base_logits[:, :num_drafts]
        if all_greedy:
            ms = self.markov_greedy_fn(base_logits, w1, w2, anchors)
        else:
            ms = markov_sample(base_logits, w1, w2, anchors, temp, greedy, generator=self.generator)
        if gamma != self.gamma or not (
            self.policy.needs_confidence or self.sts_recorder is not None
        ):
            return DraftProposal(ms, None)  # the bs1 runtime schedules no confidences
        c = confidence_head(
            y,
            ms.markov_embeds,
            self.draft.confidence_head.proj.weight,
            temperatures=self.sts_temperatures,
        )
        return DraftProposal(ms, c.confidence, c.raw)

    def _accept(
        self,
        verify_ids,
        lens_t,
        seq_t,
        logits,
        greedy,
        all_greedy,
        temp,
        top_k,
        top_p,
        need_trunc,
        ms,
        cap_lens,
        reqs,
    ):
        dev = logits.device
        B, W = verify_ids.shape
        if self.args.simulate_accept_len is not None:
            return self.accept_fn(
                verify_ids, lens_t, seq_t, logits, greedy, forced_accept=self._sim_counts(reqs, dev)
            )
        if all_greedy:
            return self.accept_fn(verify_ids, lens_t, seq_t, logits, greedy, cap_lens=cap_lens)
        p = target_probs(logits, temp, top_k, top_p, apply_top_k_top_p=need_trunc)
        q = draft_probs(ms.step_logits[:, : W - 1], temp, greedy, ms.drafts[:, : W - 1])
        coins = torch.rand((B, max(W - 1, 0)), generator=self.generator, device=dev)
        bonus_u = torch.rand((B,), generator=self.generator, device=dev)
        return self.accept_fn(
            verify_ids,
            lens_t,
            seq_t,
            logits,
            greedy,
            target_probs=p,
            draft_probs=q,
            coins=coins,
            bonus_uniforms=bonus_u,
            cap_lens=cap_lens,
        )

    def _sim_counts(self, reqs: list[Req], device: torch.device) -> torch.Tensor:
        return to_device(self.sim_count_list(reqs), torch.int64, device)

    def sim_count_list(self, reqs: list[Req]) -> list[int]:
        """Benchmark-only simulated acceptance: this step's forced draft counts, a deterministic
        schedule with the requested mean (zeros when acceptance is not simulated)."""
        if self.args.simulate_accept_len is None:
            return [0] * len(reqs)
        x = float(self.args.simulate_accept_len) - 1.0
        forced = []
        for r in reqs:
            done = self._sim_progress.get(r.rid, 0.0)
            forced.append(int((done + 1) * x) - int(done * x) if x > 0 else 0)
            self._sim_progress[r.rid] = done + 1
        return forced

    def _forced(self, counts: torch.Tensor) -> torch.Tensor | None:
        """The accept counts to force: `counts` when acceptance is simulated, else None."""
        return counts if self.args.simulate_accept_len is not None else None

    def _greedy_epilogue(
        self,
        verify_ids: torch.Tensor,
        lens_t: torch.Tensor,
        seq_t: torch.Tensor,
        logits: torch.Tensor,
        forced: torch.Tensor,
    ):
        """Acceptance + logprobs of an all-greedy uniform step (the captured "folded
        epilogue"); batch-first inputs [B, W, ...], padding rows have lens_t == 0 and commit
        nothing. `forced`: the simulated accept counts (ignored without simulation)."""
        greedy = torch.ones(verify_ids.shape[0], dtype=torch.bool, device=verify_ids.device)
        acc = self.accept_fn(
            verify_ids, lens_t, seq_t, logits, greedy, forced_accept=self._forced(forced)
        )
        return acc, _token_logprobs(logits, acc.out_tokens)


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, W] log-softmax of verify logits [B, W, V] at the output tokens (-1 fill reads id 0)."""
    return torch.log_softmax(logits, dim=-1).gather(2, tokens.clamp(min=0)[:, :, None]).squeeze(2)
