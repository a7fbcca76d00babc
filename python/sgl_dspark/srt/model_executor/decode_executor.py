"""The executor of plain steps: one flat target forward over the step's prompt chunks and decode
tokens, sampling where a token is due, and the read-back of the sampled tokens.

It owns the target's forward graphs (decode / verify per width, prefill per token bucket) and
the sampler; DSpark's executor runs its prefill and plain-decode steps through it and its verify
forwards through `forward`. With the overlap schedule, a decode step of the same requests chains
onto the step in flight: its input tokens are that step's sampled ids, still on the device, and
its positions and sampling counters account for the one token the host has not seen yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.host_copy import PendingRead, to_device_packed
from sgl_dspark.srt.core.step import (
    BaseStepExecutor,
    InflightStep,
    PromptLogprobs,
    ReqUpdate,
    StepWork,
)
from sgl_dspark.srt.layers.logits_adjust import build_logits_adjust
from sgl_dspark.srt.layers.logprobs import logprob_extras, row_logprobs, split_extras
from sgl_dspark.srt.layers.sampler import Sampler, SamplerOutput, SamplingBatchInfo
from sgl_dspark.srt.layers.vocab_parallel import RowSplit, needs_full_logits, needs_whole_rows
from sgl_dspark.srt.model_executor.prefill_graphs import PrefillGraphs
from sgl_dspark.srt.model_executor.target_graphs import TargetGraphs

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sgl_dspark.srt.model_executor.model_runner import ModelRunner, TapConsumer
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput


class DecodeStep(InflightStep):
    """A launched plain step: its sampled ids stay on the device (the next chained step's
    input) while their host copy is under way."""

    kind = "decode"

    def __init__(
        self,
        work: StepWork,
        sampled: list[bool],
        next_ids: torch.Tensor,
        host: PendingRead,
        extras: _StepLogprobs | None = None,
    ) -> None:
        self.work = work
        self.sampled = sampled  # per request of work.reqs: whether a token was sampled
        self.next_ids = next_ids  # [number of sampled requests] int64, on the device
        self.host = host  # next ids, their logprobs, then `extras`' tensors
        self.extras = extras
        # A request whose logits depend on its last token (penalties, a grammar) needs that
        # token on the host before its next step is planned.
        self.chainable = not work.prefill and not any(r.params.adjusts_logits for r in work.decode)

    @property
    def reqs(self) -> tuple[Req, ...]:
        return self.work.reqs

    def wait(self) -> list[ReqUpdate]:
        ids, lps, *extra_lists = self.host.wait()
        per_req = self.extras.split(extra_lists) if self.extras is not None else {}
        tokens = iter(zip(ids, lps))
        kv = [len(chunk) for _, chunk in self.work.prefill] + [1] * len(self.work.decode)
        updates = []
        for req, n, sampled in zip(self.work.reqs, kv, self.sampled):
            tok = next(tokens) if sampled else None
            top, id_lps, prompt = per_req.get(req.rid, ((), (), None))
            updates.append(
                ReqUpdate(
                    req,
                    n,
                    (tok[0],) if tok else (),
                    (tok[1],) if tok else (),
                    top_logprobs=top,
                    token_ids_logprobs=id_lps,
                    prompt_logprobs=prompt,
                )
            )
        return updates


class _StepLogprobs:
    """The logprob extras of a step (top-N, token-id values, prompt logprobs), launched on the
    device with the step and split per request on the host (`srt/layers/logprobs.py`).

    Rows: for each request that asks, its scored prompt positions (a prefill chunk) then its
    sampled token, in the step's request order."""

    def __init__(self) -> None:
        # (rid, prompt start index, number of prompt rows, sampled?, top N, token ids)
        self.entries: list[tuple[str, int, int, bool, int, tuple[int, ...]]] = []
        self.tensors: list[torch.Tensor] = []

    def split(self, lists: list[list]) -> dict[str, tuple]:
        if not self.entries:
            return {}
        prompt_lps, top_ids, top_vals, id_vals = lists
        out: dict[str, tuple] = {}
        row = 0
        for rid, start, n_prompt, sampled, top_n, ids in self.entries:
            n = n_prompt + int(sampled)
            tops, id_lps = split_extras(
                top_ids[row : row + n],
                top_vals[row : row + n],
                id_vals[row : row + n],
                [top_n] * n,
                [len(ids)] * n,
            )
            prompt = None
            if n_prompt:
                prompt = PromptLogprobs(
                    start,
                    tuple(prompt_lps[row : row + n_prompt]),
                    tuple(tops[:n_prompt]) if top_n else (),
                    tuple(id_lps[:n_prompt]) if ids else (),
                )
            sampled_top = (tops[n_prompt],) if sampled and top_n else ()
            sampled_ids = (id_lps[n_prompt],) if sampled and ids else ()
            out[rid] = (sampled_top, sampled_ids, prompt)
            row += n
        return out


def _prompt_rows(req: Req, chunk: tuple[int, ...]) -> range:
    """Offsets in `chunk` whose logits score a prompt token the request asks logprobs for:
    position p scores prompt token p + 1, for p from logprob_start_len on (SGLang: the token at
    logprob_start_len itself gets None)."""
    if not req.wants_prompt_logprobs:
        return range(0)
    start = req.kv_len
    first = max(start, req.logprob_start_len)
    last = min(start + len(chunk), len(req.prompt_ids) - 1)  # exclusive; the last scores output
    return range(first - start, max(first, last) - start)


class DecodeExecutor(BaseStepExecutor):
    def __init__(
        self,
        runner: ModelRunner,
        consumer: TapConsumer | None = None,
        step_window: int = 1,
    ) -> None:
        """`consumer`: runs on the taps of every target forward (DSpark's context-KV writer).
        `step_window`: KV positions a step may write past a request's committed length."""
        self.runner = runner
        self.consumer = consumer
        self.sampler = Sampler(runner.kernels)
        self._step_window = step_window
        self.target_graphs: TargetGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    @property
    def step_window(self) -> int:
        return self._step_window

    def register_graphs(
        self,
        graphs: CudaGraphRunner,
        batch_sizes: Sequence[int],
        widths: Sequence[int] = (1,),
        prefill_max_tokens: int = 0,
    ) -> None:
        """Register the target's decode (width 1) and verify (wider) graphs for `batch_sizes`
        and, with `prefill_max_tokens` > 0, prefill graphs for up to that many tokens of up to
        `max(batch_sizes)` requests. Needs a forward without host synchronisation: the torch
        MoE backend reads expert counts on the host, so CUDA graphs require `moe=triton`."""
        runner = self.runner
        if runner.device.type == "cuda" and runner.kernels.of("moe") != "triton":
            raise ValueError(
                "CUDA graphs need the sync-free MoE path: use --kernel-backend triton "
                "(or --kernel-backend-overrides moe=triton), or --disable-cuda-graph"
            )
        self.target_graphs = TargetGraphs(graphs, runner, batch_sizes, widths, self.consumer)
        if prefill_max_tokens > 0:
            self.prefill_graphs = PrefillGraphs(
                graphs, runner, prefill_max_tokens, max(batch_sizes), self.consumer
            )

    # ---- the target forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, tap_layers: tuple[int, ...] = ()) -> ModelOutput:
        """The target forward of `batch` with the consumer on its taps: a graph replay where one
        fits, else eager."""
        if batch.mode is not ForwardMode.EXTEND:
            graphs = self.target_graphs
            if graphs is not None and graphs.can_run(batch, tap_layers):
                return graphs.replay(batch)
        elif self.prefill_graphs is not None and self.prefill_graphs.can_run(batch, tap_layers):
            return self.prefill_graphs.replay(batch)
        return self.runner.forward(batch, tap_layers, self.consumer)

    def graph_width_for(self, batch_size: int, width: int) -> int | None:
        """The captured verify width that runs `batch_size` requests of up to `width` rows in
        one replay, or None when no graph does."""
        graphs = self.target_graphs
        if graphs is None or graphs.bucket_for(batch_size) is None:
            return None
        return graphs.width_for(width)

    # ---- steps --------------------------------------------------------------------------------
    def can_chain(self, work: StepWork, prev: InflightStep) -> bool:
        return (
            isinstance(prev, DecodeStep)
            and prev.chainable
            and not work.prefill
            and len(work.decode) == len(prev.work.decode)
            and all(a is b for a, b in zip(work.decode, prev.work.decode))
        )

    def launch(self, work: StepWork, prev: InflightStep | None) -> DecodeStep:
        """One forward over `work` (prompt chunks, then decode tokens), sampling the last prompt
        token of a completed prompt and every decode token. `prev`: a decode step of exactly
        these requests still in flight, whose sampled ids are this step's inputs."""
        chained = isinstance(prev, DecodeStep)
        assert prev is None or (chained and not work.prefill), "only decode steps chain"
        lag = 1 if chained else 0  # tokens sampled for these requests, not yet appended
        ids: list[list[int]] = [list(chunk) for _, chunk in work.prefill]
        ids += [[0] if chained else [r.output_ids[-1]] for r in work.decode]
        reqs = work.reqs
        # Logits only where a token is sampled (the last prompt token and every decode token)
        # and where a prompt token's logprob is asked for.
        sampled = [r.kv_len + len(chunk) >= len(r.prompt_ids) for r, chunk in work.prefill]
        sampled += [True] * len(work.decode)
        scored = [_prompt_rows(r, chunk) for r, chunk in work.prefill]
        scored += [range(0)] * len(work.decode)
        rows = [[*p, len(x) - 1] if s else [*p] for x, s, p in zip(ids, sampled, scored)]
        mode = ForwardMode.EXTEND if work.prefill else ForwardMode.DECODE
        pool = self.runner.req_pool
        batch = ForwardBatch.build(
            mode,
            ids,
            [r.kv_len + lag for r in reqs],
            [r.slot for r in reqs],
            pool.req_to_token,
            logits_rows=rows,
            input_ids_device=prev.next_ids if isinstance(prev, DecodeStep) else None,
        )
        out = self.forward(batch)
        sampled_reqs = [r for r, s in zip(reqs, sampled) if s]
        if out.reader.sharded:
            # Tensor parallelism: each request's rows are read the way it needs, whatever the
            # others need (`needs_whole_rows`; scored prompt positions are read whole). A
            # request without a logits row reads nothing.
            whole = [needs_whole_rows(r) or bool(p) for r, p in zip(reqs, scored)]
            has_rows = [s or bool(p) for s, p in zip(sampled, scored)]
            any_whole = any(w and h for w, h in zip(whole, has_rows))
            if any_whole and any(h and not w for w, h in zip(whole, has_rows)):
                return self._launch_split(work, out, sampled, scored, whole, lag)
            greedy_only = not any_whole
        else:
            greedy_only = not any(scored) and not needs_full_logits(reqs)
        if greedy_only:
            # Greedy picks only: every logits row is a sampled token of a greedy request that
            # adjusts nothing and asks for no logprob extras (under tensor parallelism no
            # logits row is gathered: `layers/vocab_parallel.py`).
            pick = out.greedy()
            res = SamplerOutput(pick.ids, pick.logprobs)
            host = PendingRead(res.next_token_ids, res.next_token_logprobs)
            return DecodeStep(work, sampled, res.next_token_ids, host)
        logits = out.logits  # whole rows (gathered under tensor parallelism)
        greedy = (out.greedy_ids, out.greedy_logprobs)
        sample_rows: list[int] = []
        at = 0
        for p, s in zip(scored, sampled):
            at += len(p)
            if s:
                sample_rows.append(at)
                at += 1
        if any(scored):
            logits = logits[torch.tensor(sample_rows, device=logits.device)]
            greedy = (None, None)
        res, final_logits, temps = self._sample(sampled_reqs, logits, greedy, lag)
        tensors = [res.next_token_ids, res.next_token_logprobs]
        extras = self._logprob_extras(reqs, sampled, scored, out.logits, final_logits, temps)
        if extras is not None:
            tensors += extras.tensors
        return DecodeStep(work, sampled, res.next_token_ids, PendingRead(*tensors), extras)

    def _launch_split(
        self,
        work: StepWork,
        out: ModelOutput,
        sampled: list[bool],
        scored: list[range],
        whole: list[bool],
        lag: int,
    ) -> DecodeStep:
        """A tensor-parallel step with logits rows of both kinds of request (`whole`: the
        request reads its rows whole). The greedy requests' tokens and logprobs are the picks
        (the decode graph's own when it made them, else `LogitsReader.greedy` of their rows
        alone), so their rows never cross ranks; only the other requests' rows are gathered,
        then sampled, adjusted and scored exactly as in a step that gathers every row (each of
        those operations is per row, and the sampling record is the whole step's, narrowed).
        The sampled tokens go back in step order."""
        reqs = work.reqs
        reader = out.reader
        greedy_rows: list[int] = []  # of the forward's rows: a greedy request's sampled token
        whole_rows: list[int] = []  # of the forward's rows: every row of a request read whole
        sample_rows: list[int] = []  # of `whole_rows`: the sampled tokens' rows
        at = 0
        for w, s, p in zip(whole, sampled, scored):
            if w:
                whole_rows.extend(range(at, at + len(p) + int(s)))
                if s:
                    sample_rows.append(len(whole_rows) - 1)
            elif s:
                greedy_rows.append(at)
            at += len(p) + int(s)
        dev = out.shard_logits.device
        greedy_t, whole_t, sample_t = to_device_packed(
            [greedy_rows, whole_rows, sample_rows], torch.int64, dev
        )
        w_reqs = tuple(r for r, w in zip(reqs, whole) if w)
        w_sampled = [s for s, w in zip(sampled, whole) if w]
        w_scored = [p for p, w in zip(scored, whole) if w]
        # A decode graph's picks (every row is a sampled token there): the greedy requests'
        # tokens, and what the rows read whole pass to `_sample`, as when every row is.
        graph_ids, graph_lps = out.greedy_ids, out.greedy_logprobs
        picked: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if graph_ids is not None and graph_lps is not None:
            greedy_ids, greedy_lps = graph_ids[greedy_t], graph_lps[greedy_t]
            if not any(w_scored):
                picked = (graph_ids[whole_t], graph_lps[whole_t])
        else:
            pick = reader.greedy(out.shard_logits[greedy_t])
            greedy_ids, greedy_lps = pick.ids, pick.logprobs
        rows = reader.full(out.shard_logits[whole_t])  # the only logits rows gathered
        # The sampled requests in two groups: the greedy ones, and those sampled from rows.
        kinds = [w for w, s in zip(whole, sampled) if s]
        split = RowSplit(
            [k for k, w in enumerate(kinds) if not w], [k for k, w in enumerate(kinds) if w], dev
        )
        logits = rows[sample_t] if any(w_scored) else rows
        sampled_reqs = [r for r, s in zip(reqs, sampled) if s]
        res, final_logits, temps = self._sample(sampled_reqs, logits, picked, lag, split)
        next_ids = split.merge(greedy_ids, res.next_token_ids)
        tensors = [next_ids, split.merge(greedy_lps, res.next_token_logprobs)]
        extras = self._logprob_extras(w_reqs, w_sampled, w_scored, rows, final_logits, temps)
        if extras is not None:
            tensors += extras.tensors
        return DecodeStep(work, sampled, next_ids, PendingRead(*tensors), extras)

    def _sample(
        self,
        reqs: list[Req],
        logits: torch.Tensor,
        greedy: tuple[torch.Tensor | None, torch.Tensor | None],
        lag: int,
        split: RowSplit | None = None,
    ) -> tuple[SamplerOutput, torch.Tensor, torch.Tensor | None]:
        """One token per logits row (rows in `reqs` order), left on the device, with the
        logits it was sampled from (adjusted when a request asks: `logits_adjust.py`) and the
        rows' temperatures (None: all 1). A decode graph already computed the greedy choice,
        which an all-greedy batch without adjustments takes as is (the same ops as the
        sampler); otherwise the sampler runs with the batch record. `lag`: tokens sampled for
        these requests but not appended yet (sampling counters). With `split`, `logits` holds
        the rows of the requests at `split.whole` only, and only those are sampled: the record
        is built for every request of `reqs` and narrowed to them, so each row keeps the key
        (an unseeded row's) and the host flags it has when the step samples every row."""
        kept = reqs if split is None else [reqs[i] for i in split.whole]
        if not kept:
            empty = logits.new_zeros((0,), dtype=torch.int64)
            return SamplerOutput(empty, logits.new_zeros((0,))), logits, None
        adjust = build_logits_adjust(
            kept, logits.shape[1], logits.device, self.runner.model_cfg.eos_token_ids
        )
        if adjust is not None:
            assert lag == 0, "requests that adjust their logits never chain"
            logits = adjust.apply(logits)
        greedy_ids, greedy_lps = greedy
        if adjust is None and greedy_ids is not None and all(r.params.is_greedy for r in kept):
            assert greedy_lps is not None
            return SamplerOutput(greedy_ids, greedy_lps), logits, None
        info = SamplingBatchInfo.from_params(
            [r.params for r in reqs],
            logits.shape[1],
            logits.device,
            counters=[len(r.output_ids) + lag for r in reqs],
        )
        if split is not None:
            info = info.select(split.whole_t)
        return self.sampler(logits, info), logits, None if info.all_greedy else info.temperatures

    def _logprob_extras(
        self,
        reqs: tuple[Req, ...],
        sampled: list[bool],
        scored: list[range],
        raw_logits: torch.Tensor,
        sample_logits: torch.Tensor,
        temps: torch.Tensor | None,
    ) -> _StepLogprobs | None:
        """Prompt logprobs and top-N / token-id logprobs of the requests that ask for them, on
        the device (read back with the step's tokens)."""
        if not any(scored) and not any(r.logprob_extras for r in reqs):
            return None
        extras = _StepLogprobs()
        prompt_rows: list[int] = []  # rows of raw_logits
        prompt_targets: list[int] = []  # the prompt token each scores
        extra_rows: list[tuple[bool, int]] = []  # (from sample_logits?, row)
        top_k = 0
        token_ids: list[tuple[int, ...]] = []
        raw_at = sample_at = 0
        for req, s, p in zip(reqs, sampled, scored):
            wants = req.logprob_extras or bool(p)
            top_n = req.top_logprobs_num if req.return_logprob else 0
            ids = tuple(req.token_ids_logprob or ()) if req.return_logprob else ()
            if wants:
                start = req.kv_len + (p.start if p else 0) + 1
                extras.entries.append((req.rid, start, len(p), s, top_n, ids))
                for j in range(len(p)):
                    prompt_rows.append(raw_at + j)
                    prompt_targets.append(req.prompt_ids[req.kv_len + p.start + j + 1])
                    extra_rows.append((False, raw_at + j))
                    token_ids.append(ids)
                if s:
                    extra_rows.append((True, sample_at))
                    token_ids.append(ids)
                top_k = max(top_k, top_n)
            raw_at += len(p) + int(s)
            sample_at += int(s)
        dev = raw_logits.device
        raw_lp = row_logprobs(raw_logits)
        sample_lp = row_logprobs(sample_logits, temps)
        table = torch.cat([raw_lp, sample_lp], dim=0)
        index = [
            row + (raw_logits.shape[0] if from_sample else 0) for from_sample, row in extra_rows
        ]
        picked = table[torch.tensor(index, dtype=torch.int64, device=dev)]
        prompt_lp = raw_lp.new_zeros((0,))
        if prompt_rows:
            rows_t, targets_t = to_device_packed([prompt_rows, prompt_targets], torch.int64, dev)
            prompt_lp = raw_lp[rows_t, targets_t]
        ex = logprob_extras(picked, top_k, token_ids)
        extras.tensors = [prompt_lp, ex.top_ids, ex.top_values, ex.id_values]
        return extras
