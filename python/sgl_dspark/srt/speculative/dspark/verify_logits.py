"""What the eager DSpark step reads from its verify rows besides the plain acceptance: the
acceptance of a tensor-parallel batch whose requests read their rows two ways
(`accept_split`), and the top-N / token-id logprobs of every verify position
(`verify_logprob_extras`, split per request on the host by `split_verify_extras`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sgl_dspark.srt.core.host_copy import to_device_packed
from sgl_dspark.srt.layers.logprobs import logprob_extras, row_logprobs, split_extras
from sgl_dspark.srt.speculative.dspark.accept import AcceptOutput

if TYPE_CHECKING:
    from sgl_dspark.srt.core.req import Req
    from sgl_dspark.srt.layers.sampler import SamplingBatchInfo
    from sgl_dspark.srt.layers.vocab_parallel import RowSplit
    from sgl_dspark.srt.model_executor.cuda_graph_runner import BatchGraphs
    from sgl_dspark.srt.models.deepseek_v4 import ModelOutput
    from sgl_dspark.srt.speculative.dspark.worker import DraftProposal, DSparkWorker

# The verify logits of some requests [b, W, V] adjusted per position (`DSparkExecutor._adjust`).
Adjust = Callable[[list["Req"], torch.Tensor, torch.Tensor], torch.Tensor]


def graph_caps(
    capped: bool, cap_lens: torch.Tensor | None, batch: int, width: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The cap input of an acceptance graph replay: none when the graphs are captured without
    one (`capped` False: the policy never caps); else the step's caps, or width - 1 for a step
    its policy did not plan (the bs1 runtime), which trims no draft and so gives the bits of an
    uncapped acceptance."""
    if not capped:
        return ()
    if cap_lens is None:
        cap_lens = torch.full((batch,), width - 1, dtype=torch.int64, device=device)
    return (cap_lens,)


def accept_split(
    worker: DSparkWorker,
    split: RowSplit,
    reqs: list[Req],
    out: ModelOutput,
    rows: list[int],
    verify_ids: torch.Tensor,
    lens_t: torch.Tensor,
    seq_t: torch.Tensor,
    forced: torch.Tensor,
    cap_lens: torch.Tensor | None,
    info: SamplingBatchInfo,
    proposal: DraftProposal,
    adjust: Adjust,
    epilogue: BatchGraphs | None,
    capped_graphs: bool,
    mark: Callable[[str], None],
) -> tuple[AcceptOutput, torch.Tensor, torch.Tensor, SamplingBatchInfo]:
    """Acceptance of a tensor-parallel verify whose requests read their rows two ways
    (`split`): the greedy group through the picks of this rank's columns (the greedy
    epilogue, from `epilogue`'s graphs when they fit, as in an all-greedy batch: no row
    crosses ranks), the other group from its own rows gathered whole, adjusted and accepted
    as when every row is gathered (`DSparkWorker.epilogue` with the group's rows of `info`;
    `proposal` is the group's own when the batch samples). `rows`: each request's verify
    rows in the forward (uniform when all are the width of `verify_ids`); `forced`: the
    simulated accept counts of every request; `capped_graphs`: whether `epilogue`'s graphs
    take a cap input (`graph_caps`); `mark`: the step timer's, called once the rows are read.

    The acceptance runs once per group, on the groups' rows picked by index, and the results
    are put back in batch order: one call cannot take both groups, because the acceptance
    (the "spec" family's kernel and its torch reference) reads one logits layout for the
    whole batch, and a whole-vocabulary layout for the greedy rows would gather them.
    Acceptance is per row (a row's accept length, bonus and logprobs depend on its own
    window, logits and uniforms only), so the merged results are the batch's.

    Returns the acceptance and the committed tokens' logprobs (batch order), and the group
    read whole's adjusted rows `[len(split.whole), W, V]` and record."""
    reader = out.reader
    dev = verify_ids.device
    B, W = verify_ids.shape
    g, w = split.greedy_t, split.whole_t
    shard = out.shard_logits  # [rows, V / tp]
    uniform = all(n == W for n in rows)
    if uniform:
        windows = shard.view(B, W, -1)
        greedy_logits = windows[g]
        whole_logits = reader.full(windows[w])  # the only verify rows gathered
    else:
        # Ragged verify lengths: each group's rows alone, laid out per request in windows of
        # W as the batch's are (rows past a request's length are never accepted).
        starts = list(itertools.accumulate(rows, initial=0))
        index = []
        for group in (split.greedy, split.whole):
            index += [
                [starts[i] + j for i in group for j in range(rows[i])],
                [k for k, i in enumerate(group) for _ in range(rows[i])],
                [j for i in group for j in range(rows[i])],
            ]
        g_rows, g_r, g_j, w_rows, w_r, w_j = to_device_packed(index, torch.int64, dev)
        greedy_logits = shard.new_zeros((len(split.greedy), W, shard.shape[-1]))
        greedy_logits[g_r, g_j] = shard[g_rows]
        gathered = reader.full(shard[w_rows])  # the only verify rows gathered
        whole_logits = gathered.new_zeros((len(split.whole), W, gathered.shape[-1]))
        whole_logits[w_r, w_j] = gathered
    whole_ids = verify_ids[w]
    whole_logits = adjust([reqs[i] for i in split.whole], whole_logits, whole_ids)
    mark("verify")
    greedy_caps = whole_caps = None
    if cap_lens is not None:
        greedy_caps, whole_caps = cap_lens[g], cap_lens[w]
    greedy_args = (verify_ids[g], lens_t[g], seq_t[g], greedy_logits, forced[g])
    if (
        epilogue is not None
        and uniform
        and (cap_lens is None or capped_graphs)
        and epilogue.bucket_for(len(split.greedy)) is not None
    ):
        caps = graph_caps(capped_graphs, greedy_caps, len(split.greedy), W, verify_ids.device)
        greedy_acc, greedy_lp = epilogue.replay(*greedy_args, *caps)
    else:
        greedy_acc, greedy_lp = worker.greedy_epilogue(*greedy_args, greedy_caps)
    whole_info = info.select(w)
    whole_acc, whole_lp = worker.epilogue(
        whole_ids,
        lens_t[w],
        seq_t[w],
        whole_logits,
        whole_info,
        proposal.markov.step_logits,
        forced[w],
        whole_caps,
    )
    acc = AcceptOutput(*(split.merge(a, b) for a, b in zip(greedy_acc, whole_acc)))
    return acc, split.merge(greedy_lp, whole_lp), whole_logits, whole_info


def verify_logprob_extras(
    reqs: list[Req], logits: torch.Tensor, info: SamplingBatchInfo
) -> list[torch.Tensor]:
    """Top-N / token-id logprobs of every verify position of the requests that ask (the host
    keeps the committed ones), from the adjusted verify logits [B, W, V] scaled by each
    request's temperature: the rows plain decoding would sample those tokens from."""
    if not any(r.logprob_extras for r in reqs):
        return []
    B, W, V = logits.shape
    temps = None if info.all_greedy else info.temperatures.repeat_interleave(W)
    lp = row_logprobs(logits.reshape(B * W, V), temps)
    top_k = max(r.top_logprobs_num if r.return_logprob else 0 for r in reqs)
    ids = [
        tuple(r.token_ids_logprob or ()) if r.return_logprob else () for r in reqs for _ in range(W)
    ]
    ex = logprob_extras(lp, top_k, ids)
    return [ex.top_ids, ex.top_values, ex.id_values]


def split_verify_extras(
    reqs: list[Req], width: int, lists: list[list]
) -> tuple[list[list], list[list]]:
    """Per request, its positions' top-N and token-id logprobs (empty when not asked)."""
    if not lists:
        return [[] for _ in reqs], [[] for _ in reqs]
    top_ids, top_vals, id_vals = lists
    tops_out, ids_out = [], []
    for i, r in enumerate(reqs):
        rows = slice(i * width, (i + 1) * width)
        top_n = r.top_logprobs_num if r.return_logprob else 0
        n_ids = len(r.token_ids_logprob or ()) if r.return_logprob else 0
        tops, id_lps = split_extras(
            top_ids[rows], top_vals[rows], id_vals[rows], [top_n] * width, [n_ids] * width
        )
        tops_out.append(tops if top_n else [])
        ids_out.append(id_lps if r.return_logprob and r.token_ids_logprob is not None else [])
    return tops_out, ids_out
