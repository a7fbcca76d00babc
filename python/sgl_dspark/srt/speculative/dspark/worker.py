"""The DSpark draft side: the draft model and its context KV, proposals (draft forward, Markov
head, confidences) and acceptance of a verified window. The step itself (verify widths, the
target's verify forward, graphs, read-back, request updates) belongs to `DSparkExecutor`.

A proposal for a request whose committed length is s drafts a block at positions s .. s+gamma-1
(the anchor, then mask tokens) attending to the draft's context KV of the positions before s;
that context KV is written from the target's own forwards (`context_kv_consumer`), for every row
of every prefill, decode and verify forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch
from sgl_dspark.srt.core.host_copy import to_device
from sgl_dspark.srt.layers.fused_linear import fuse_after_placement
from sgl_dspark.srt.layers.sampler import ACCEPT_STREAM, BONUS_STREAM, DRAFT_STREAM
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, TapConsumer
from sgl_dspark.srt.model_executor.weights import WeightFactory, build_on_meta, materialise
from sgl_dspark.srt.models.deepseek_v4 import stream_means
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
from sgl_dspark.srt.speculative.dspark.accept import AcceptOutput, create_accept_fn
from sgl_dspark.srt.speculative.dspark.ops import (
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
    ConfidenceOutput,
    MarkovSampleOutput,
    confidence_head,
    draft_probs,
    markov_greedy_shard,
    markov_sample,
    target_probs,
)
from sgl_dspark.srt.speculative.dspark.sts import StsCalibration
from sgl_dspark.srt.speculative.dspark.sts_record import StsRecorder

if TYPE_CHECKING:
    from sgl_dspark.srt.layers.sampler import SamplingBatchInfo
    from sgl_dspark.srt.layers.vocab_parallel import RowSplit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DSparkArgs:
    policy: PolicyArgs = field(default_factory=PolicyArgs)
    sts_path: str | None = None
    simulate_accept_len: float | None = None  # benchmark-only: forced mean accept length
    sts_collect_path: str | None = None  # write (raw confidence, prefix label) shards
    bs1_block_size: int | None = None  # gamma of single-request steps (None: the same)


class DraftProposal(NamedTuple):
    markov: MarkovSampleOutput  # drafts [B, gamma], step logits z, Markov embeddings
    confidence: torch.Tensor | None  # [B, gamma] (None when the policy needs none)
    raw_confidence: torch.Tensor | None = None  # [B, gamma] logits before STS and sigmoid


class SplitProposal(NamedTuple):
    """A proposal whose rows were drafted two ways under tensor parallelism
    (`DSparkWorker.propose_split`)."""

    drafts: torch.Tensor  # [B, gamma] every row's, in batch order
    confidence: torch.Tensor | None  # [B, gamma] every row's (None when the policy needs none)
    whole: DraftProposal  # the rows read whole alone, over the whole vocabulary (no confidence)


class DSparkWorker:
    def __init__(self, runner: ModelRunner, dcfg: DSparkConfig, weights, args: DSparkArgs) -> None:
        self.runner = runner
        self.dcfg = dcfg
        self.args = args
        self.gamma = dcfg.block_size
        # The bs1 runtime: a single request is latency-bound, so it drafts its own block size
        # and verifies its full window.
        self.gamma_bs1 = args.bs1_block_size or self.gamma
        for name, g in (("block size", self.gamma), ("bs1 block size", self.gamma_bs1)):
            if g < 1 or g + 1 > runner.rc.max_verify_tokens:
                raise ValueError(
                    f"DSpark {name} {g} must be >= 1 and leave max_verify_tokens "
                    f">= {g + 1} (got {runner.rc.max_verify_tokens})"
                )
        draft = build_on_meta(
            lambda: DSparkDraftModel(dcfg, runner.kernels, runner.rc.attention_backend)
        )
        # "spec" family implementations, bound once.
        self.accept_fn = create_accept_fn(runner.kernels)
        self.draft_inputs_fn = create_draft_inputs_fn(runner.kernels)
        self.markov_greedy_fn = create_markov_greedy_fn(runner.kernels)
        if isinstance(weights, WeightFactory):
            weights = weights.for_model(draft)
        native = runner.rc.weight_format == "native"
        self.draft = materialise(
            draft, weights, runner.device, runner.dtype, native, "DSpark draft"
        )
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
        self.sts_recorder = (
            StsRecorder(args.sts_collect_path, self.gamma) if args.sts_collect_path else None
        )
        self.context_kv_consumer = TapConsumer(self.tap_layers, self._write_context_kv)
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

    @property
    def needs_confidence(self) -> bool:
        """Whether proposals of the main block size compute confidences (the policy or the STS
        recorder reads them)."""
        return self.policy.needs_confidence or self.sts_recorder is not None

    # ---- context KV -----------------------------------------------------------------------
    def inject(
        self, positions: torch.Tensor, slots: torch.Tensor, tap_streams: dict[int, torch.Tensor]
    ) -> None:
        """Write the draft context KV of target forward rows at `slots`, from the target's
        streams `[N, n, D]` after each tap layer (their means are the features)."""
        if tap_streams[self.tap_layers[0]].shape[0] == 0:
            return
        feats = context_features(tap_streams, self.tap_layers)
        with torch.inference_mode():
            self.draft.write_context_kv(feats, positions, self.ctx_kv, slots)

    def _write_context_kv(self, batch: ForwardBatch, taps: dict[int, torch.Tensor]) -> None:
        """The draft's context KV of every row of a target forward (prefill chunks, decode steps
        and verify windows), inside the forward's graph when one runs. A verify writes its
        rejected rows too, at positions past the committed length: the step that later commits
        a position verifies it again and rewrites its row before any draft reads it, exactly as
        for the target's own KV, so acceptance never waits for this and it can overlap the
        logits and the acceptance (`ModelRunner.run_model`)."""
        self.inject(batch.positions, batch.out_cache_loc, taps)

    # ---- proposals ------------------------------------------------------------------------
    def propose_greedy(
        self,
        gamma: int,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        num_drafts: int | None = None,
    ) -> DraftProposal:
        """All-greedy proposal; `num_drafts` < gamma runs only that many Markov steps (a step
        verifying width W reads W - 1 drafts, and draft k depends on drafts < k only)."""
        return self._propose(anchors, seq_t, slot_t, None, gamma, num_drafts)

    def propose(
        self,
        gamma: int,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        info: SamplingBatchInfo,
        step_logits_out: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Proposal for a batch with sampled rows: their drafts are drawn from softmax(z / T)
        with the requests' `DRAFT_STREAM` uniforms (draft k at output counter + k). Under
        tensor parallelism such a batch gathers the draft's logits rows whole (a draw reads the
        whole distribution; `propose_split` gathers only the rows read whole); a batch whose
        rows are all greedy takes the shard path (`_propose`). `step_logits_out`: [B, gamma, V]
        fp32 where the step logits are written (the sampled draft graphs' buffer,
        `sampled_graphs.py`)."""
        return self._propose(anchors, seq_t, slot_t, info, gamma, None, step_logits_out)

    def propose_split(
        self,
        gamma: int,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        info: SamplingBatchInfo,
        split: RowSplit,
    ) -> SplitProposal:
        """Proposal for a tensor-parallel batch with a sampled row, split by `split` into
        greedy rows and rows read whole (`needs_whole_rows`). One draft forward and one head
        GEMM over every row, as for any batch; then the greedy rows draft from the shard pairs
        as an all-greedy batch does (`markov_greedy_shard`: no logits row crosses ranks), and
        only the rows read whole gather their base logits, `[len(split.whole), gamma, V]`, and
        run `markov_sample` with their rows of `info`. Every Markov operation is per row (a
        row's draws use its own uniforms), so each row drafts what it drafts in a batch that
        gathers every row, up to the summation order of its Markov correction's GEMM, which
        now runs over fewer rows (as the shard path's runs over fewer columns)."""
        y, y_normed = self._draft_forward(anchors, seq_t, slot_t, gamma)
        target = self.runner.model
        reader = target.logits_reader
        base = target.compute_shard_logits(y_normed)  # [B, gamma, V / tp]
        w1, w2 = self.draft.markov_head.embed.weight, self.draft.markov_head.head.weight
        start = reader.vocab_start
        greedy = markov_greedy_shard(
            base[split.greedy_t],
            w1,
            w2[start : start + reader.shard_width],
            anchors[split.greedy_t],
            reader.argmax,
        )
        rows = info.select(split.whole_t)
        whole = markov_sample(
            reader.full(base[split.whole_t]),
            w1,
            w2,
            anchors[split.whole_t],
            rows.temperatures,
            rows.is_greedy,
            uniforms=rows.uniforms(DRAFT_STREAM, gamma),
        )
        drafts = split.merge(greedy.drafts, whole.drafts)
        confidence = None
        if gamma == self.gamma and self.needs_confidence:
            markov_embeds = split.merge(greedy.markov_embeds, whole.markov_embeds)
            confidence = self._confidence(y, markov_embeds).confidence
        return SplitProposal(drafts, confidence, DraftProposal(whole, None))

    def _draft_forward(
        self, anchors: torch.Tensor, seq_t: torch.Tensor, slot_t: torch.Tensor, gamma: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's hidden rows `[B, gamma, d]` over [anchor, mask, ...] at positions
        s .. s+gamma-1, and their normed rows (the head's input)."""
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
        embeds = runner.model.model.embed_tokens(inputs.input_ids)
        return self.draft(embeds, inputs.positions, self.ctx_kv, inputs.ctx_slots, inputs.ctx_valid)

    def _confidence(self, y: torch.Tensor, markov_embeds: torch.Tensor) -> ConfidenceOutput:
        return confidence_head(
            y,
            markov_embeds,
            self.draft.confidence_head.proj.weight,
            temperatures=self.sts_temperatures,
        )

    def _propose(
        self,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        info: SamplingBatchInfo | None,
        gamma: int,
        num_drafts: int | None,
        step_logits_out: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Draft forward over [anchor, mask, ...] at positions s .. s+gamma-1, then the Markov
        head (left to right) and, when read, the confidences. `info` None: every row greedy.

        Under tensor parallelism an all-greedy proposal never gathers a logits row: each rank
        computes its vocabulary columns of the base logits and of the Markov correction, and
        each draft is the argmax of the whole row from the ranks' (max, index) pairs
        (`markov_greedy_shard`; its step logits are then this rank's columns). A batch with a
        sampled row gathers the base logits whole, as a draw needs the whole distribution
        (`propose_split` gathers only some rows'). One rank takes the unsharded path
        unchanged."""
        y, y_normed = self._draft_forward(anchors, seq_t, slot_t, gamma)
        target = self.runner.model
        reader = target.logits_reader
        # `all_greedy` is a host flag: the choice never syncs, and every rank makes the same.
        shard = reader.sharded and (info is None or info.all_greedy)
        if step_logits_out is not None and (shard or info is None):
            raise ValueError("step_logits_out is written by the whole-row (sampled) Markov loop")
        if shard:
            base_logits = target.compute_shard_logits(y_normed)  # [B, gamma, V / tp]
        else:
            base_logits = target.compute_logits(y_normed)  # [B, gamma, V]
        w1, w2 = self.draft.markov_head.embed.weight, self.draft.markov_head.head.weight
        if num_drafts is not None and num_drafts < gamma:
            # The block's rows still all run (the draft attends bidirectionally inside the
            # block); only the sequential Markov loop stops early. No confidences are read.
            assert info is None and not self.needs_confidence
            base_logits = base_logits[:, :num_drafts]
        if shard:
            # W2 stays whole on every rank (the sampled path reads all of it); this rank's
            # rows are a view.
            start = reader.vocab_start
            ms = markov_greedy_shard(
                base_logits, w1, w2[start : start + reader.shard_width], anchors, reader.argmax
            )
        elif info is None:
            ms = self.markov_greedy_fn(base_logits, w1, w2, anchors)
        else:
            ms = markov_sample(
                base_logits,
                w1,
                w2,
                anchors,
                info.temperatures,
                info.is_greedy,
                uniforms=info.uniforms(DRAFT_STREAM, gamma),
                step_logits_out=step_logits_out,
            )
        if gamma != self.gamma or not self.needs_confidence:
            return DraftProposal(ms, None)  # the bs1 runtime schedules no confidences
        c = self._confidence(y, ms.markov_embeds)
        return DraftProposal(ms, c.confidence, c.raw)

    # ---- acceptance -----------------------------------------------------------------------
    def accept(
        self,
        verify_ids: torch.Tensor,
        lens_t: torch.Tensor,
        seq_t: torch.Tensor,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        draft_logits: torch.Tensor,
        cap_lens: torch.Tensor | None,
        forced: torch.Tensor | None,
    ) -> AcceptOutput:
        """Acceptance of verify windows `verify_ids` [B, W] (anchor, then the drafts) with
        target logits [B, W, V]. Sampled rows compare the target's processed distribution with
        the draft's (from the proposal's step logits `draft_logits` [B, >= W - 1, V]) and draw
        their coins (`ACCEPT_STREAM`, position j at counter + j) and bonus (`BONUS_STREAM`, at
        the step's counter) from the requests' uniforms. `forced`: simulated accept counts."""
        B, W = verify_ids.shape
        if forced is not None:
            return self.accept_fn(
                verify_ids, lens_t, seq_t, logits, info.is_greedy, forced_accept=forced
            )
        if info.all_greedy:
            return self.accept_fn(
                verify_ids, lens_t, seq_t, logits, info.is_greedy, cap_lens=cap_lens
            )
        return self.accept_fn(
            verify_ids,
            lens_t,
            seq_t,
            logits,
            info.is_greedy,
            target_probs=target_probs(logits, info),
            draft_probs=draft_probs(
                draft_logits[:, : W - 1], info.temperatures, info.is_greedy, verify_ids[:, 1:]
            ),
            coins=info.uniforms(ACCEPT_STREAM, max(W - 1, 0)),
            bonus_uniforms=info.uniforms(BONUS_STREAM),
            cap_lens=cap_lens,
        )

    def epilogue(
        self,
        verify_ids: torch.Tensor,
        lens_t: torch.Tensor,
        seq_t: torch.Tensor,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        draft_logits: torch.Tensor,
        forced: torch.Tensor,
        cap_lens: torch.Tensor | None = None,
    ) -> tuple[AcceptOutput, torch.Tensor]:
        """Acceptance (`accept`) + the committed tokens' logprobs of a step over whole logits
        rows [B, W, V], any mix of greedy and sampled rows: log_softmax of the logits scaled by
        each request's temperature (unscaled when every row is greedy), the rows plain decoding
        samples from. The eager step's and the sampled acceptance graphs' one function
        (`sampled_graphs.py`). `forced`: the simulated accept counts (ignored without
        simulation)."""
        simulated = forced if self.args.simulate_accept_len is not None else None
        acc = self.accept(
            verify_ids, lens_t, seq_t, logits, info, draft_logits, cap_lens, simulated
        )
        temps = None if info.all_greedy else info.temperatures[:, None, None]
        tok_lp = token_logprobs(logits if temps is None else logits / temps, acc.out_tokens)
        return acc, tok_lp

    def greedy_epilogue(
        self,
        verify_ids: torch.Tensor,
        lens_t: torch.Tensor,
        seq_t: torch.Tensor,
        logits: torch.Tensor,
        forced: torch.Tensor,
        cap_lens: torch.Tensor | None = None,
    ) -> tuple[AcceptOutput, torch.Tensor]:
        """Acceptance + logprobs of an all-greedy step (captured per width); batch-first
        inputs [B, W, ...], padding rows have lens_t == 0 and commit nothing. `logits` are the
        verify rows over this rank's vocab shard (`ModelOutput.shard_logits`): the target's
        argmax chain and the committed tokens' logprobs come from `LogitsReader.greedy`, so
        under tensor parallelism no logits row is gathered. `forced`: the simulated accept
        counts (ignored without simulation); `cap_lens`: the async confidence policy's caps.

        A committed token at verify row j is either the row's argmax (a greedy-accepted draft
        equals it, the bonus is it, and a capped row's bonus is the accepted draft at the cap)
        or, with simulated acceptance only, the forced draft d_{j+1}, whose logprob the reader
        probes; positions past the commit length are never read."""
        B, W = verify_ids.shape
        greedy = torch.ones(B, dtype=torch.bool, device=verify_ids.device)
        simulated = forced if self.args.simulate_accept_len is not None else None
        reader = self.runner.model.logits_reader
        # Row j probes d_{j+1} (the last row has no draft after it: it probes its anchor).
        probes = torch.roll(verify_ids, -1, dims=1).reshape(-1) if simulated is not None else None
        pick = reader.greedy(logits.reshape(B * W, logits.shape[-1]), probe_ids=probes)
        target_ids = pick.ids.view(B, W)
        acc = self.accept_fn(
            verify_ids,
            lens_t,
            seq_t,
            None,
            greedy,
            cap_lens=cap_lens,
            forced_accept=simulated,
            target_ids=target_ids,
        )
        tok_lp = pick.logprobs.view(B, W)
        if pick.probe_logprobs is not None:
            probed = pick.probe_logprobs.view(B, W)
            tok_lp = torch.where(acc.out_tokens == target_ids, tok_lp, probed)
        return acc, tok_lp

    # ---- simulated acceptance (benchmarks) ---------------------------------------------------
    def simulated_counts(self, steps_done: list[int]) -> list[int]:
        """This step's forced draft counts for requests that have taken `steps_done` DSpark
        steps: a deterministic schedule with the requested mean (zeros without simulation)."""
        if self.args.simulate_accept_len is None:
            return [0] * len(steps_done)
        x = float(self.args.simulate_accept_len) - 1.0
        if x <= 0:
            return [0] * len(steps_done)
        return [int((done + 1) * x) - int(done * x) for done in steps_done]

    # ---- graph shapes -----------------------------------------------------------------------
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
        """Verify widths of the fused step graphs: those a full or static policy returns
        (host-known widths; the online width policy reads its statistics on the device), width
        1 excepted (plain decode), and the full window of the async confidence policy (its caps
        are computed in the graph). The sync confidence policy plans on the host from the
        step's own confidences: it has none."""
        policy = self.policy
        if self.sts_recorder is not None:
            return ()
        if isinstance(policy, FullPolicy) or policy.caps_acceptance:
            return (self.gamma + 1,)
        if isinstance(policy, StaticWidthPolicy):
            return tuple(w for w in policy.graph_widths() if w > 1)
        return ()

    def close(self) -> None:
        if self.sts_recorder is not None:
            self.sts_recorder.flush()


def context_features(tap_streams: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    """The draft's context features `[N, n_f * D]` of a target forward's rows: the mean over mHC
    streams of each tap layer's streams `[N, n, D]`, concatenated in `layers` order. The one
    definition the serving worker and the draft trainer both read."""
    rows = tap_streams[layers[0]].shape[0]
    # One stack and one mean for all tap layers: [N, n_f, n, D] -> [N, n_f * D].
    streams = torch.stack([tap_streams[layer] for layer in layers], dim=1)
    return stream_means(streams, dim=2).reshape(rows, -1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, W] log-softmax of verify logits [B, W, V] at the output tokens (-1 fill reads id 0)."""
    return torch.log_softmax(logits, dim=-1).gather(2, tokens.clamp(min=0)[:, :, None]).squeeze(2)
