"""The DSpark step executor: owns the whole speculative step.

Per step: prompt chunks run as a plain forward (their taps write the draft's context KV); the
decoding requests then take one of three paths:

* the verify policy turns speculation off at this batch size (static width 1): a plain decode
  step through the decode executor, which the overlap schedule chains like any decode step;
* an all-greedy batch at a host-known width, or under the async confidence policy (the full
  window, its caps computed in the graph from a budget the host planned), with captured fused
  steps (with the overlap schedule): one fused graph replay (draft, verify, acceptance, context
  KV), whose next state stays on the device, so the overlap schedule chains these steps too;
* otherwise the eager step: draft (a graph per bucket, all-greedy or with sampled rows), verify
  lengths from the policy, the target's verify forward (a graph per width when the batch fits),
  acceptance (a graph per width for uniform steps, all-greedy or with sampled rows:
  `sampled_graphs.py` says which sampled steps replay), one read of the results.

Request state changes only through the `ReqUpdate`s the steps return (`speculative=True`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.host_copy import PendingRead, read_to_host, to_device, to_device_packed
from sgl_dspark.srt.core.step import (
    BaseStepExecutor,
    CompletedStep,
    InflightStep,
    ReqUpdate,
    StepWork,
)
from sgl_dspark.srt.layers.logits_adjust import build_logits_adjust
from sgl_dspark.srt.layers.sampler import SamplingBatchInfo
from sgl_dspark.srt.layers.vocab_parallel import needs_full_logits, needs_whole_rows, split_rows
from sgl_dspark.srt.model_executor.cuda_graph_runner import BatchGraphs, CudaGraphRunner
from sgl_dspark.srt.speculative.dspark.fused_step import FusedGreedySteps, FusedStep
from sgl_dspark.srt.speculative.dspark.metrics import DSparkMetrics
from sgl_dspark.srt.speculative.dspark.policy import ConfidencePolicy
from sgl_dspark.srt.speculative.dspark.sampled_graphs import SampledGraphs
from sgl_dspark.srt.speculative.dspark.verify_logits import (
    accept_split,
    graph_caps,
    split_verify_extras,
    verify_logprob_extras,
)
from sgl_dspark.srt.speculative.dspark.worker import DraftProposal

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.model_executor.decode_executor import DecodeExecutor
    from sgl_dspark.srt.speculative.dspark.worker import DSparkWorker


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """The eager step's one read of its results (a module name, so tests can watch it)."""
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


class DSparkExecutor(BaseStepExecutor):
    def __init__(
        self, decode: DecodeExecutor, worker: DSparkWorker, fused_steps: bool = True
    ) -> None:
        """`fused_steps`: run all-greedy steps of host-known widths (or of the async confidence
        policy) as fused step graphs when they are captured (with the overlap schedule);
        otherwise every speculative step is the eager step, the reference path."""
        self.decode = decode
        self.worker = worker
        self.fused_steps = fused_steps
        self.runner = decode.runner
        self.policy = worker.policy
        # The policy that caps acceptance on the device (the async confidence policy), typed
        # for the fused step's split plan; None for every other policy.
        self._capping: ConfidencePolicy | None = None
        if self.policy.caps_acceptance:
            assert isinstance(self.policy, ConfidencePolicy)
            self._capping = self.policy
        # Host-side: fed with the values each step reads anyway.
        self.metrics = DSparkMetrics(max(worker.gamma, worker.gamma_bs1), device="cpu")
        self._generation: dict[int, int] = {}  # request slot -> admissions (policy state)
        self._sim_steps: dict[str, int] = {}  # DSpark steps launched per request (simulation)
        self.draft_graphs: BatchGraphs | None = None
        self.draft_graphs_bs1: BatchGraphs | None = None
        self.epilogue_graphs: dict[int, BatchGraphs] = {}
        self.sampled_graphs: SampledGraphs | None = None
        self.fused: FusedGreedySteps | None = None
        # (work, fused width) that `can_chain` planned for the `launch` that follows it.
        self._chain_plan: tuple[StepWork, int | None] | None = None

    @property
    def step_window(self) -> int:
        return self.runner.rc.max_verify_tokens

    def refuses(self, req: Req) -> str | None:
        grammar = req.params.grammar
        if grammar is not None and self.worker.args.simulate_accept_len is not None:
            # Simulated acceptance commits drafts whatever the target (and the grammar) says.
            return (
                f"{grammar[0]}: constrained decoding cannot run with simulated DSpark "
                "acceptance (--speculative-dspark-simulate-accept-len)"
            )
        return None

    def on_admit(self, req: Req) -> None:
        self._generation[req.slot] = self._generation.get(req.slot, 0) + 1
        self._sim_steps[req.rid] = 0

    def on_release(self, req: Req) -> None:
        self._sim_steps.pop(req.rid, None)

    def close(self) -> None:
        self.worker.close()

    # ---- graphs ---------------------------------------------------------------------------
    def register_graphs(
        self, graphs: CudaGraphRunner, batch_sizes: Sequence[int], prefill_max_tokens: int = 0
    ) -> None:
        """Register every graph of the step: the target's decode / verify widths and prefill
        (through the decode executor), the greedy draft per bucket (and the bs1 runtime's), the
        greedy acceptance per width, their counterparts for batches with sampled rows, and the
        fused steps of host-known widths."""
        worker, dev = self.worker, self.runner.device
        widths = worker.graph_verify_widths()
        # Under a policy that caps acceptance on the device every acceptance graph takes the
        # caps as an input (`graph_caps`); other policies' graphs run no cap.
        capped = self.policy.caps_acceptance
        self.decode.register_graphs(graphs, batch_sizes, widths, prefill_max_tokens)
        example = (torch.zeros(1, dtype=torch.int64, device=dev),) * 3
        self.draft_graphs = BatchGraphs(
            graphs,
            "DSpark draft",
            functools.partial(worker.propose_greedy, worker.gamma),
            example,
            (0, 1, 0),
            batch_sizes,
        )
        if worker.gamma_bs1 != worker.gamma:
            self.draft_graphs_bs1 = BatchGraphs(
                graphs,
                "DSpark bs1 draft",
                functools.partial(worker.propose_greedy, worker.gamma_bs1),
                example,
                (0, 1, 0),
                [1],
            )
        # The acceptance graphs read this rank's logits columns (whole rows on one rank).
        vocab = self.runner.model.logits_reader.shard_width
        for w in widths:

            def ex(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
                return torch.zeros((1, *shape), dtype=dtype, device=dev)

            self.epilogue_graphs[w] = BatchGraphs(
                graphs,
                f"DSpark acceptance width {w}",
                worker.greedy_epilogue,
                [ex(w), ex(), ex(), ex(w, vocab, dtype=torch.float32), ex(), *[ex()] * capped],
                [0, 0, 1, 0.0, 0, *[0] * capped],
                batch_sizes,
            )
        if worker.sts_recorder is None:  # the recorder's steps run eagerly
            self.sampled_graphs = SampledGraphs(
                graphs,
                worker,
                batch_sizes,
                widths,
                {w: g.static[3] for w, g in self.epilogue_graphs.items()},
                capped,
            )
        fused_widths = worker.fused_widths() if self.fused_steps else ()
        if fused_widths:
            runner = self.runner
            self.fused = FusedGreedySteps(
                graphs,
                runner.req_pool,
                fused_widths,
                batch_sizes,
                worker.gamma,
                worker.gamma_bs1,
                worker.propose_greedy,
                functools.partial(runner.run_model, tap_layers=(), consumer=self.decode.consumer),
                runner.join_taps,
                worker.greedy_epilogue,
                self._capping.device_caps if self._capping is not None else None,
            )

    # ---- the step contract ------------------------------------------------------------------
    def can_chain(self, work: StepWork, prev: InflightStep) -> bool:
        if work.prefill or not work.decode:
            return False
        if len(prev.reqs) != len(work.decode) or any(
            a is not b for a, b in zip(prev.reqs, work.decode)
        ):
            return False
        if self.policy.plain_decode(len(work.decode)):
            return self.decode.can_chain(work, prev)
        if not isinstance(prev, FusedStep):
            return False
        width = self._fused_width(work.decode, prev.width)
        # `launch` takes this work next: it reuses the width (a policy decides once per step).
        self._chain_plan = (work, width)
        return width is not None

    def launch(self, work: StepWork, prev: InflightStep | None) -> InflightStep:
        updates: list[ReqUpdate] = []
        if work.prefill:
            # The prompt chunks' taps write the draft's context KV (the decode executor's
            # consumer); the decoding requests' step follows.
            updates = self.decode.launch(StepWork(prefill=work.prefill), None).wait()
        decoding = work.decode
        if not decoding:
            return CompletedStep(work.reqs, updates)
        step: InflightStep
        if self.policy.plain_decode(len(decoding)):
            # No speculation at this batch size: a plain decode step (it writes the draft's
            # context KV of its tokens, so speculation resumes when the batch shrinks).
            step = self.decode.launch(StepWork(decode=decoding), prev)
        else:
            lag = prev.width if isinstance(prev, FusedStep) else 0
            planned, self._chain_plan = self._chain_plan, None
            if planned is not None and planned[0] is work:
                width = planned[1]
            else:
                width = self._fused_width(decoding, lag)
            if width is not None:
                step = self._launch_fused(decoding, width, prev)
            else:
                assert prev is None, "the eager step never chains"
                step = CompletedStep(decoding, self.eager_step(list(decoding)))
        if not updates:
            return step
        return CompletedStep(work.reqs, updates + step.wait())

    # ---- fused steps ------------------------------------------------------------------------
    def _fused_width(self, reqs: Sequence[Req], lag_width: int) -> int | None:
        """The verify width at which the fused graphs run this all-greedy batch, or None.
        `lag_width`: the width of a fused step still in flight for these requests (its commits
        are not in `kv_len` yet), 0 when none: the step must fit the context after it."""
        fused, worker = self.fused, self.worker
        B = len(reqs)
        if fused is None or needs_full_logits(reqs):
            return None
        bs1 = B == 1 and fused.bs1_width is not None
        # The bs1 runtime verifies its full window whatever the policy (as the eager step); a
        # policy that caps on the device verifies the full window too.
        if bs1:
            width = fused.bs1_width
        elif self.policy.caps_acceptance:
            width = worker.gamma + 1
        else:
            width = int(self.policy.verify_lens(None, [r.slot for r in reqs], [])[0])
        if width is None or not fused.has(width, B):
            return None
        limit = self.runner.req_pool.max_context_len
        gamma = worker.gamma_bs1 if bs1 else worker.gamma
        if any(r.kv_len + lag_width + max(width, gamma) > limit for r in reqs):
            return None
        return width

    def _launch_fused(
        self, reqs: tuple[Req, ...], width: int, prev: InflightStep | None
    ) -> FusedStep:
        """Replay the fused step (no host synchronisation). With `prev` (a fused step of exactly
        these requests, in flight) the graph's state rows already hold their anchors and
        lengths; otherwise they come from the requests."""
        assert self.fused is not None
        # Never verify past max_new_tokens (the request ends there anyway); with a step in flight
        # `output_ids` lags, so this may verify a little more, never less, than needed.
        lens = [max(1, min(width, r.params.max_new_tokens - len(r.output_ids))) for r in reqs]
        slots = [r.slot for r in reqs]
        gens = [self._generation.get(s, 1) for s in slots]
        planned = not (len(reqs) == 1 and self.fused.bs1_width is not None)
        capping = self._capping if planned else None
        budget = capping.host_budget(slots, gens) if capping is not None else -1
        rows = [slots, lens, self._simulated_counts(reqs), gens, [budget] * len(reqs)]
        chained = isinstance(prev, FusedStep)
        if not chained:
            rows = [[r.output_ids[-1] for r in reqs], [r.kv_len for r in reqs], *rows]
        out = self.fused.launch(width, rows, chained)
        if capping is not None:
            capping.snapshot()
        if planned:
            # Online statistics from the device results, ordered before the next replay.
            self.policy.observe(self.fused.verify_lens(len(reqs)), out.accept_len, slots, gens)
        host = PendingRead(
            out.commit_len, out.out_tokens, out.logprobs, out.accept_len, out.cap_trim
        )
        return FusedStep(self.metrics, reqs, width, lens, host)

    def _simulated_counts(self, reqs: Sequence[Req]) -> list[int]:
        steps = [self._sim_steps.get(r.rid, 0) for r in reqs]
        for r, n in zip(reqs, steps):
            self._sim_steps[r.rid] = n + 1
        return self.worker.simulated_counts(steps)

    # ---- the eager step ---------------------------------------------------------------------
    @torch.inference_mode()
    def eager_step(self, reqs: list[Req]) -> list[ReqUpdate]:
        """One DSpark step of `reqs` (all decoding, none in flight), read once at the end."""
        worker, runner = self.worker, self.runner
        dev = runner.device
        B = len(reqs)
        timer = _StepTimer(dev)
        seq = [r.kv_len for r in reqs]
        slots = [r.slot for r in reqs]
        info = SamplingBatchInfo.from_params(
            [r.params for r in reqs],
            runner.model_cfg.vocab_size,
            dev,
            counters=[len(r.output_ids) for r in reqs],
        )
        anchors, seq_t, slot_t = to_device_packed(
            [[r.output_ids[-1] for r in reqs], seq, slots], torch.int64, dev
        )
        # Under tensor parallelism a batch of greedy requests and requests that read whole
        # rows (`needs_whole_rows`) reads each group its own way (`accept_split`); the STS
        # recorder reads every row whole. One rank reads every batch one way. A step that
        # splits runs its draft and acceptance of the rows read whole eagerly: the sampled
        # graphs (`sampled_graphs.py`) gather every row of their bucket whole, which is what
        # the split saves, and the split is host flags only, so every rank takes the same
        # path and runs the same collectives. A batch whose rows are all read whole (every
        # request sampled, say) does not split and replays the sampled graphs, as on one rank.
        reader = runner.model.logits_reader
        split = None
        if reader.sharded and worker.sts_recorder is None:
            split = split_rows(reader, [needs_whole_rows(r) for r in reqs], dev)
        # 1-3. draft forward, Markov sampling, confidences
        bs1 = B == 1 and worker.gamma_bs1 != worker.gamma
        gamma = worker.gamma_bs1 if bs1 else worker.gamma
        if split is not None and not info.all_greedy:
            # Only the rows read whole gather the draft's logits (a sampled row draws from
            # the whole distribution; the greedy rows draft from the shard pairs).
            halves = worker.propose_split(gamma, anchors, seq_t, slot_t, info, split)
            drafts, conf, prop = halves.drafts, halves.confidence, halves.whole
        else:
            prop = self._propose(B, anchors, seq_t, slot_t, info, gamma)
            drafts, conf = prop.markov.drafts, prop.confidence
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
        verify_ids = torch.cat((anchors[:, None], drafts), dim=1)[:, :W]  # [B, W]
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
            runner.req_pool.req_to_token,
            logits_rows="all",
            input_ids_device=(
                verify_ids.reshape(-1).contiguous() if uniform else verify_ids[flat_r, flat_j]
            ),
        )
        out = self.decode.forward(batch)  # its taps write the draft's context KV of every row
        raw_logits = None  # the verify rows before any adjustment (the STS recorder's)
        if split is not None:
            forced = to_device(self._simulated_counts(reqs), torch.int64, dev)
            acc, tok_lp, logits, read_info = accept_split(
                worker,
                split,
                reqs,
                out,
                rows,
                verify_ids,
                lens_t,
                seq_t,
                forced,
                cap_lens,
                info,
                prop,
                self._adjust,
                self.epilogue_graphs.get(W),
                self.policy.caps_acceptance,
                timer.mark,
            )
            read_reqs = [reqs[i] for i in split.whole]
        else:
            # Greedy picks or whole rows (`needs_full_logits`; the STS recorder reads whole
            # rows): under tensor parallelism only a step that needs whole rows gathers them.
            # On one rank both are the same tensor.
            whole = needs_full_logits(reqs) or worker.sts_recorder is not None
            rank_rows = out.logits if whole else out.shard_logits
            if uniform:
                logits = rank_rows.view(B, W, -1)
            else:
                logits = rank_rows.new_zeros((B, W, rank_rows.shape[-1]))
                logits[flat_r, flat_j] = rank_rows
            raw_logits = logits
            logits = self._adjust(reqs, logits, verify_ids)
            timer.mark("verify")
            # 6-7. acceptance on the device and the committed tokens' logprobs. Uniform steps
            #    replay it from a graph (all greedy, or with sampled rows), chosen from host
            #    values only (widths, the recorder, `info`'s flags, the bucket): a graph never
            #    decides. The async confidence policy's caps are a graph input. Ragged widths
            #    and the STS recorder keep the eager acceptance.
            epilogue = self.epilogue_graphs.get(W)
            forced = to_device(self._simulated_counts(reqs), torch.int64, dev)
            step_logits = prop.markov.step_logits
            capped = self.policy.caps_acceptance
            graphed = uniform and (cap_lens is None or capped) and worker.sts_recorder is None
            caps = graph_caps(capped, cap_lens, B, W, dev) if graphed else ()
            sampled = None
            if graphed and not info.all_greedy and self.sampled_graphs is not None:
                sampled = self.sampled_graphs.accept(
                    verify_ids, lens_t, seq_t, logits, forced, step_logits, info, *caps
                )
            # The greedy acceptance graphs take this rank's columns: whole rows gathered under
            # tensor parallelism are wider than their inputs.
            if sampled is not None:
                acc, tok_lp = sampled
            elif (
                epilogue is not None
                and graphed
                and info.all_greedy
                and epilogue.bucket_for(B) is not None
                and not (reader.sharded and whole)
            ):
                acc, tok_lp = epilogue.replay(verify_ids, lens_t, seq_t, logits, forced, *caps)
            elif reader.sharded and not whole:
                # Vocab-parallel greedy rows without a graph: the same epilogue, eagerly.
                acc, tok_lp = worker.greedy_epilogue(
                    verify_ids, lens_t, seq_t, logits, forced, cap_lens
                )
            else:
                acc, tok_lp = worker.epilogue(
                    verify_ids, lens_t, seq_t, logits, info, step_logits, forced, cap_lens
                )
            read_info, read_reqs = info, reqs
        if not bs1:
            self.policy.observe(lens_t, acc.accept_len, slots, gens)
        if worker.sts_recorder is not None and prop.raw_confidence is not None and not bs1:
            assert raw_logits is not None
            worker.sts_recorder.record(prop.raw_confidence, verify_ids, raw_logits, lens_t)
        timer.mark("accept")
        # 8. the finalised results in one read; the metrics are then accumulated on the host
        #    from the same values (no per-step metric kernels). `logits` are the rows read
        #    whole of `read_reqs` (every request unless the rows were split).
        extras = verify_logprob_extras(read_reqs, logits, read_info)
        commit, toks, lps, accepted, trimmed, *extra_lists = _to_host(
            acc.commit_len, acc.out_tokens, tok_lp, acc.accept_len, acc.cap_trim, *extras
        )
        self.metrics.record_step(
            torch.tensor(lens),
            torch.tensor(accepted),
            request_ids=[r.rid for r in reqs],
            timing=timer.spans(),
            cap_trim=torch.tensor(trimmed),
        )
        tops, id_lps = split_verify_extras(read_reqs, W, extra_lists)
        if split is not None:  # the greedy group asks for no extras
            tops_w, id_lps_w = tops, id_lps
            tops, id_lps = [[] for _ in reqs], [[] for _ in reqs]
            for k, i in enumerate(split.whole):
                tops[i], id_lps[i] = tops_w[k], id_lps_w[k]
        return [
            ReqUpdate(
                r,
                c,
                tuple(t[:c]),
                tuple(lp[:c]),
                speculative=True,
                top_logprobs=tuple(top[:c]),
                token_ids_logprobs=tuple(ids[:c]),
            )
            for r, c, t, lp, top, ids in zip(reqs, commit, toks, lps, tops, id_lps)
        ]

    def _adjust(
        self, reqs: list[Req], logits: torch.Tensor, verify_ids: torch.Tensor
    ) -> torch.Tensor:
        """The verify logits [B, W, V] adjusted per position (penalties, biases,
        min_new_tokens, grammar: `srt/layers/logits_adjust.py`): position j sees the drafts
        d_1..d_j as output. A grammar reads the drafts on the host (its matcher is a CPU
        automaton): the one extra read of such a step."""
        B, W, V = logits.shape
        drafts = verify_ids[:, 1:]
        drafts_host = None
        if any(r.grammar is not None for r in reqs) and W > 1:
            (drafts_host,) = read_to_host(drafts)
        adjust = build_logits_adjust(
            reqs,
            V,
            logits.device,
            self.runner.model_cfg.eos_token_ids,
            width=W,
            drafts=drafts,
            drafts_host=drafts_host,
        )
        if adjust is None:
            return logits
        return adjust.apply(logits.reshape(B * W, V)).view(B, W, V)

    def _propose(
        self,
        batch_size: int,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        info: SamplingBatchInfo,
        gamma: int,
    ) -> DraftProposal:
        worker = self.worker
        if info.all_greedy and worker.sts_recorder is None:
            graphs = self.draft_graphs_bs1 if gamma != worker.gamma else self.draft_graphs
            if graphs is not None and graphs.bucket_for(batch_size) is not None:
                return graphs.replay(anchors, seq_t, slot_t)
            return worker.propose_greedy(gamma, anchors, seq_t, slot_t)
        if not info.all_greedy and self.sampled_graphs is not None:
            prop = self.sampled_graphs.propose(gamma, anchors, seq_t, slot_t, info)
            if prop is not None:
                return prop
        return worker.propose(gamma, anchors, seq_t, slot_t, info)

    def _verify_rows(self, reqs: list[Req], lens: list[int]) -> list[int]:
        """Rows each request runs in the verify forward: its verify length, or with graphs the
        captured width that covers the whole batch (when one does and the context fits)."""
        w = self.decode.graph_width_for(len(reqs), max(lens))
        limit = self.runner.req_pool.max_context_len
        if w is None or any(r.kv_len + w > limit for r in reqs):
            return lens
        return [w] * len(reqs)
