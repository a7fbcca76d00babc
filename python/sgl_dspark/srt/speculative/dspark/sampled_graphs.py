"""CUDA graphs of the DSpark draft proposal and acceptance for batches with sampled rows.

A DSpark step whose batch has a sampled request (temperature > 0, alone or mixed with greedy
ones) runs the eager step; these graphs replace its two launch-bound parts, as the all-greedy
draft and acceptance graphs do for greedy batches: the draft proposal (draft forward, Markov
sampling, confidences) per batch bucket and block size (the bs1 runtime has its own), and the
acceptance with the committed tokens' logprobs per (verify width, batch bucket). A replay runs
the eager step's own functions (`DSparkWorker.propose`, `DSparkWorker.epilogue`) on static
buffers, so it commits the eager step's tokens bit for bit.

Inputs, copied into the static buffers at every replay, besides the step's anchors, lengths,
slots and verify logits: the per-request sampling parameters (temperature, top-k, top-p, min-p,
greedy flag) and the keys of the request's randomness (seed, output counter). Every uniform is
a hash of (seed, counter + position, stream) computed inside the graph (`counter_uniform`), so a
replay draws its own step's uniforms, never the capture's.

What a graph cannot decide, the host decides before the replay, from host flags only:

* `processed_probs` sorts the rows only when a row asks for top-k or top-p, and thresholds them
  only when one asks for min-p (`SamplingBatchInfo.need_*`). So each width has two acceptance
  graphs: temperature only (every flag off) and every filter on. A filter at its neutral value
  (top-k = V, top-p = 1, min-p = 0) keeps every token and changes no mass, so the filtered graph
  computes, for any batch with a filter, the bits the eager step computes with that batch's own
  flags.
* The executor keeps the eager acceptance where the step itself decides on the host: ragged
  verify widths (no captured width covers the batch, or the context ends first), the STS
  recorder (both graphs), batches past the largest bucket, and (both graphs) a tensor-parallel
  batch of greedy requests and requests read whole, which gathers only the latter's rows
  (`verify_logits.py::accept_split`) where these graphs gather every row of their bucket.
  Logit adjustments (penalties, biases, min_new_tokens, grammars) run before the acceptance on
  the verify logits it takes as input, and logprob extras after it: neither is in a graph.
  Under the async confidence policy the acceptance graphs take its on-device caps as one more
  input (`verify_logits.graph_caps`), as the all-greedy ones do.

Buffers: the draft graphs write their step logits [B, gamma, V] into one buffer that the
acceptance graphs take as their draft-logits input (a replay does not copy an input that is
already its buffer), so no bucket keeps its own; the acceptance graphs of a width share their
static inputs, and on one rank the logits buffer of the all-greedy acceptance of that width.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from sgl_dspark.srt.layers.sampler import SamplingBatchInfo
from sgl_dspark.srt.model_executor.cuda_graph_runner import BatchGraphs, CudaGraphRunner

if TYPE_CHECKING:
    from sgl_dspark.srt.speculative.dspark.accept import AcceptOutput
    from sgl_dspark.srt.speculative.dspark.worker import DraftProposal, DSparkWorker

DRAFT_FAMILY = "DSpark sampled draft"
BS1_DRAFT_FAMILY = "DSpark bs1 sampled draft"
ACCEPT_FAMILY = "DSpark sampled acceptance width {}"
FILTERED_ACCEPT_FAMILY = "DSpark sampled acceptance width {} top-k/top-p/min-p"


def _needs_filters(info: SamplingBatchInfo) -> bool:
    return info.need_top_k or info.need_top_p or info.need_min_p


class SampledGraphs:
    """The sampled draft graphs (per block size) and acceptance graphs (per width and filter
    kind), registered with `graphs` for `batch_sizes`.

    Args:
        worker: the draft side; its `propose` and `epilogue` are the captured functions.
        widths: the verify widths of the target's graphs (acceptance graphs for each).
        greedy_logits: per width, the all-greedy acceptance graphs' logits buffer
            `[max_bs, W, V / tp]`, shared where it holds whole rows (one rank).
        capped: whether the acceptance graphs take the policy's caps as their last input.
    """

    def __init__(
        self,
        graphs: CudaGraphRunner,
        worker: DSparkWorker,
        batch_sizes: Sequence[int],
        widths: Sequence[int],
        greedy_logits: Mapping[int, torch.Tensor],
        capped: bool,
    ) -> None:
        self.graphs = graphs
        self.worker = worker
        self.vocab = worker.runner.model.logits_reader.vocab  # whole rows: a draw reads all
        self.batch_sizes = sorted(set(batch_sizes))
        dev = graphs.device
        max_bs = self.batch_sizes[-1]
        gammas = {worker.gamma: (DRAFT_FAMILY, self.batch_sizes)}
        if worker.gamma_bs1 != worker.gamma:
            gammas[worker.gamma_bs1] = (BS1_DRAFT_FAMILY, [1])
        # The draft graphs' step logits and the acceptance graphs' draft-logits input.
        self.draft_logits = torch.zeros(
            max_bs, max(gammas), self.vocab, dtype=torch.float32, device=dev
        )

        def ex(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros((1, *shape), dtype=dtype, device=dev)

        f32 = torch.float32
        # Padding rows: greedy with neutral parameters, slot 0, verify length 0 (they commit
        # nothing, and their writes land in the reserved dummy slot).
        params = [ex(dtype=f32), ex(dtype=torch.bool), ex(), ex()]  # temperature, greedy, keys
        param_pads = [1.0, True, 0, 0]
        self.drafts: dict[int, BatchGraphs] = {
            gamma: BatchGraphs(
                graphs,
                family,
                functools.partial(self._propose, gamma),
                [ex(), ex(), ex(), *params],
                [0, 1, 0, *param_pads],
                sizes,
            )
            for gamma, (family, sizes) in gammas.items()
        }
        self.accepts: dict[tuple[int, bool], BatchGraphs] = {}
        for w in widths:
            inputs = [
                ex(w),  # verify ids
                ex(),  # verify lengths
                ex(),  # sequence lengths
                ex(w, self.vocab, dtype=f32),  # verify logits
                ex(),  # simulated accept counts
                ex(w - 1, self.vocab, dtype=f32),  # draft step logits
                ex(dtype=f32),  # temperature
                ex(dtype=f32),  # top-p
                ex(),  # top-k
                ex(dtype=f32),  # min-p
                ex(dtype=torch.bool),  # greedy
                ex(),  # seed
                ex(),  # counter
                *[ex()] * capped,  # caps on accepted drafts
            ]
            pads = [0, 0, 1, 0.0, 0, 0.0, 1.0, 1.0, self.vocab, 0.0, True, 0, 0, *[0] * capped]
            logits = greedy_logits.get(w)
            static: list[torch.Tensor | None] = [None] * len(inputs)
            static[3] = logits if logits is not None and logits.shape[-1] == self.vocab else None
            static[5] = self.draft_logits[:, : w - 1]
            for filtered in (False, True):
                family = (FILTERED_ACCEPT_FAMILY if filtered else ACCEPT_FAMILY).format(w)
                g = BatchGraphs(
                    graphs,
                    family,
                    functools.partial(self._accept, filtered),
                    inputs,
                    pads,
                    self.batch_sizes,
                    static,
                )
                static = list(g.static)  # the other filter kind takes the same buffers
                self.accepts[(w, filtered)] = g

    @property
    def replays(self) -> int:
        return sum(g.replays for g in (*self.drafts.values(), *self.accepts.values()))

    # ---- the captured functions --------------------------------------------------------------
    def _propose(
        self,
        gamma: int,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        temperatures: torch.Tensor,
        greedy: torch.Tensor,
        seeds: torch.Tensor,
        counters: torch.Tensor,
    ) -> DraftProposal:
        bs = anchors.shape[0]
        # The proposal reads the temperatures, greedy flags and keys; the filters are the
        # target's alone (`draft_probs`), neutral here.
        info = self._info(
            temperatures,
            torch.ones_like(temperatures),
            torch.full_like(seeds, self.vocab),
            torch.zeros_like(temperatures),
            greedy,
            seeds,
            counters,
            filtered=False,
        )
        out = self.draft_logits[:bs, :gamma]
        return self.worker.propose(gamma, anchors, seq_t, slot_t, info, step_logits_out=out)

    def _info(
        self,
        temperatures: torch.Tensor,
        top_ps: torch.Tensor,
        top_ks: torch.Tensor,
        min_ps: torch.Tensor,
        greedy: torch.Tensor,
        seeds: torch.Tensor,
        counters: torch.Tensor,
        filtered: bool,
    ) -> SamplingBatchInfo:
        """The sampling record a captured function reads, built from the static buffers: a batch
        with a sampled row, every filter on (`filtered`) or off."""
        return SamplingBatchInfo(
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            is_greedy=greedy,
            seeds=seeds,
            counters=counters,
            vocab_size=self.vocab,
            all_greedy=False,
            need_top_k=filtered,
            need_top_p=filtered,
            need_min_p=filtered,
        )

    def _accept(
        self,
        filtered: bool,
        verify_ids: torch.Tensor,
        lens_t: torch.Tensor,
        seq_t: torch.Tensor,
        logits: torch.Tensor,
        forced: torch.Tensor,
        draft_logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_ps: torch.Tensor,
        top_ks: torch.Tensor,
        min_ps: torch.Tensor,
        greedy: torch.Tensor,
        seeds: torch.Tensor,
        counters: torch.Tensor,
        cap_lens: torch.Tensor | None = None,
    ) -> tuple[AcceptOutput, torch.Tensor]:
        info = self._info(
            temperatures, top_ps, top_ks, min_ps, greedy, seeds, counters, filtered=filtered
        )
        return self.worker.epilogue(
            verify_ids, lens_t, seq_t, logits, info, draft_logits, forced, cap_lens
        )

    # ---- replays -----------------------------------------------------------------------------
    def propose(
        self,
        gamma: int,
        anchors: torch.Tensor,
        seq_t: torch.Tensor,
        slot_t: torch.Tensor,
        info: SamplingBatchInfo,
    ) -> DraftProposal | None:
        """The proposal of a batch with a sampled row (`DSparkWorker.propose`) from its graph,
        or None when no graph runs it (block size or batch size not captured). The step logits
        it returns stay valid until the next sampled draft replay."""
        assert not info.all_greedy
        g = self.drafts.get(gamma)
        if g is None or g.bucket_for(info.batch_size) is None:
            return None
        return g.replay(
            anchors, seq_t, slot_t, info.temperatures, info.is_greedy, info.seeds, info.counters
        )

    def accept(
        self,
        verify_ids: torch.Tensor,
        lens_t: torch.Tensor,
        seq_t: torch.Tensor,
        logits: torch.Tensor,
        forced: torch.Tensor,
        draft_logits: torch.Tensor,
        info: SamplingBatchInfo,
        *caps: torch.Tensor,
    ) -> tuple[AcceptOutput, torch.Tensor] | None:
        """`DSparkWorker.epilogue` of a uniform-width batch with a sampled row (whole logits
        rows [B, W, V]) from its graph, or None when no graph runs it. `caps`: the cap input
        when the graphs take one (`verify_logits.graph_caps`)."""
        assert not info.all_greedy
        B, W = verify_ids.shape
        g = self.accepts.get((W, _needs_filters(info)))
        if g is None or g.bucket_for(B) is None or logits.shape[-1] != self.vocab:
            return None
        return g.replay(
            verify_ids,
            lens_t,
            seq_t,
            logits,
            forced,
            draft_logits[:, : W - 1],
            info.temperatures,
            info.top_ps,
            info.top_ks,
            info.min_ps,
            info.is_greedy,
            info.seeds,
            info.counters,
            *caps,
        )
