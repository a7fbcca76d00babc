"""Offline engine, SGLang-style: `Engine(model_path=...).generate(prompt=..., sampling_params=...)`.

Builds the model runner, the step executor (plain, or DSpark's over the plain one), their CUDA
graphs (captured once, at startup) and the host-only scheduler; the HTTP server drives the same
scheduler from its own thread. Its arguments are `ServerArgs` fields.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from sgl_dspark.srt.constrained import Grammars
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.core.step import BaseStepExecutor
from sgl_dspark.srt.distributed import get_parallel_state, replicated, single_process_state
from sgl_dspark.srt.distributed import set_parallel_state as _set_parallel_state
from sgl_dspark.srt.entrypoints.logprob_format import LogprobOptions, req_logprob_meta
from sgl_dspark.srt.entrypoints.rank_group import RankGroup, layout_of
from sgl_dspark.srt.managers.replicated_scheduler import ReplicatedScheduler
from sgl_dspark.srt.managers.scheduler import Scheduler, SchedulerConfig
from sgl_dspark.srt.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    GraphFactory,
    graph_batch_sizes,
)
from sgl_dspark.srt.model_executor.decode_executor import DecodeExecutor
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig, resolve_dtype
from sgl_dspark.srt.models.source import resolve_model
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.server_args import ServerArgs
from sgl_dspark.srt.speculative.dspark.executor import DSparkExecutor
from sgl_dspark.srt.speculative.dspark.factory import create_dspark_worker
from sgl_dspark.srt.speculative.dspark.policy import PolicyArgs
from sgl_dspark.srt.speculative.dspark.worker import DSparkArgs
from sgl_dspark.srt.tokenizer import IncrementalDetokenizer, TokenizerLike, get_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_DSPARK_BLOCK_SIZE = 7


def max_verify_tokens(args: ServerArgs) -> int:
    """The widest verify window a DSpark step may run (KV positions past the committed length)."""
    gamma = args.speculative_dspark_block_size or DEFAULT_DSPARK_BLOCK_SIZE
    return max(16, gamma + 1, (args.speculative_dspark_bs1_block_size or 0) + 1)


def create_executor(args: ServerArgs, runner: ModelRunner) -> BaseStepExecutor:
    """The plain decode executor, or DSpark's executor over one (its draft's context-KV writer
    on every target forward)."""
    if args.speculative_algorithm is None:
        return DecodeExecutor(runner)
    policy = PolicyArgs(
        policy=args.speculative_dspark_verify_policy,
        width_table_path=args.speculative_dspark_width_table_path,
        online_width=args.speculative_dspark_online_width,
        verify_widths=args.speculative_dspark_verify_widths,
        sps_table_path=args.speculative_dspark_sps_table_path,
        confidence_mode=args.speculative_dspark_confidence_mode,
        device_name=device_name(runner.device),
    )
    dargs = DSparkArgs(
        policy=policy,
        sts_path=args.speculative_dspark_confidence_sts_path,
        simulate_accept_len=args.speculative_dspark_simulate_accept_len,
        sts_collect_path=args.speculative_dspark_sts_collect_path,
        bs1_block_size=args.speculative_dspark_bs1_block_size,
    )
    with replicated():  # the draft runs whole on every rank (same proposals everywhere)
        worker = create_dspark_worker(
            runner,
            args.model_path,
            args.speculative_draft_model_path,
            args.speculative_dspark_block_size,
            dargs,
            seed=args.random_seed,
            load_format=args.load_format,
        )
    decode = DecodeExecutor(
        runner, consumer=worker.context_kv_consumer, step_window=runner.rc.max_verify_tokens
    )
    return DSparkExecutor(decode, worker, fused_steps=not args.disable_overlap_schedule)


def init_cuda_graphs(
    executor: BaseStepExecutor,
    runner: ModelRunner,
    max_bs: int,
    prefill_max_tokens: int = 0,
    graph_factory: GraphFactory | None = None,
) -> CudaGraphRunner:
    """Register every graph of `executor` for batch buckets up to `max_bs` (and prefill graphs
    for up to `prefill_max_tokens` tokens) and capture them. `graph_factory` replaces the graph
    type (CPU tests use `EagerGraph`)."""
    graphs = CudaGraphRunner(runner.device, graph_factory)
    sizes = graph_batch_sizes(max_bs)
    if isinstance(executor, DSparkExecutor):
        executor.register_graphs(graphs, sizes, prefill_max_tokens)
    else:
        assert isinstance(executor, DecodeExecutor), type(executor)
        executor.register_graphs(graphs, sizes, (1,), prefill_max_tokens)
    graphs.capture()
    return graphs


# Largest graphed batch unless --cuda-graph-max-bs says otherwise (capped by the running requests).
DEFAULT_GRAPH_MAX_BS = 32


def graph_limits(args: ServerArgs, runner: ModelRunner) -> tuple[int, int] | None:
    """(largest graph batch size, largest graphed prefill) the server args ask for, or None when
    the engine runs eagerly. Graphs need the sync-free MoE path; with the torch MoE backend they
    are only an error when asked for explicitly (--cuda-graph-max-bs)."""
    if runner.device.type != "cuda" or args.disable_cuda_graph or args.cuda_graph_max_bs == 0:
        return None
    if runner.kernels.of("moe") != "triton" and args.cuda_graph_max_bs is None:
        logger.warning(
            "CUDA graphs off: the torch MoE backend synchronises with the host; use "
            "--kernel-backend triton for graphs"
        )
        return None
    max_bs = args.cuda_graph_max_bs or min(args.max_running_requests, DEFAULT_GRAPH_MAX_BS)
    if args.cuda_graph_max_bs is None and args.max_running_requests > max_bs:
        logger.warning(
            "CUDA graphs capture batches of up to %d requests (the default); decode steps of "
            "more run eagerly, each kernel launched from the host: --cuda-graph-max-bs %d "
            "captures every batch --max-running-requests allows",
            max_bs,
            args.max_running_requests,
        )
    prefill_tokens = args.cuda_graph_max_prefill_tokens
    if prefill_tokens is None:
        chunk = args.chunked_prefill_size
        prefill_tokens = min(chunk if chunk > 0 else args.context_length, 4096)
    return max_bs, prefill_tokens


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


class Engine:
    """Keyword arguments are `ServerArgs` fields (`model_path` is required); "auto" values are
    resolved as for the server (float32 and the torch kernels on CPU)."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(ServerArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown Engine arguments: {sorted(unknown)}")
        self._init(ServerArgs(**kwargs).resolved())

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> Engine:
        engine = cls.__new__(cls)
        engine._init(args.resolved())
        return engine

    @classmethod
    def for_rank(cls, args: ServerArgs) -> Engine:
        """The engine of a rank >= 1 that has joined the world (`rank_group.follower_main`)."""
        engine = cls.__new__(cls)
        engine.ranks = None
        engine._build(args)
        return engine

    def _init(self, args: ServerArgs) -> None:
        """Rank 0: with --tp-size/--ep-size > 1, spawn the other ranks first (one process
        each, `rank_group.py`); they build the same engine over their shards."""
        self.ranks: RankGroup | None = None
        if layout_of(args).world_size > 1:
            if not get_parallel_state().is_single:
                raise RuntimeError("this process already runs a parallel engine")
            self.ranks = RankGroup.start(args)
        try:
            self._build(args)
        except BaseException:
            self._stop_ranks()
            raise

    def _build(self, args: ServerArgs) -> None:
        self.args = args
        cfg, weights = resolve_model(
            args.model_path,
            resolve_dtype(args.dtype),
            seed=args.random_seed,
            load_format=args.load_format,
        )
        rc = RunnerConfig.from_server_args(args, max_verify_tokens(args))
        # Process-wide (the launchers read it at every launch and at graph capture): the last
        # engine built in a process decides. It moves timing only, never a result bit.
        if args.device != "cpu":
            from sgl_dspark.kernels._triton_utils import set_programmatic_launch

            set_programmatic_launch(
                not args.disable_programmatic_launch,
                max_graph_batch=args.programmatic_launch_max_bs,
            )
        self.runner = ModelRunner(cfg, rc, weights=weights)
        self.executor = create_executor(args, self.runner)
        self.graphs: CudaGraphRunner | None = None
        limits = graph_limits(args, self.runner)
        if limits is not None:
            self.init_graphs(*limits)
        self.tokenizer: TokenizerLike | None = None
        if not args.skip_tokenizer_init:
            self.tokenizer = get_tokenizer(
                args.model_path, args.tokenizer_path, trust_remote_code=args.trust_remote_code
            )
        chunk = args.chunked_prefill_size
        sched_cfg = SchedulerConfig(
            chunked_prefill_size=chunk if chunk > 0 else -1,
            max_running_requests=args.max_running_requests,
            eos_token_ids=cfg.eos_token_ids,
            vocab_size=cfg.vocab_size,
            overlap_schedule=not args.disable_overlap_schedule,
        )
        sched_parts = (sched_cfg, self.runner.req_pool, self.runner.allocator, self.executor)
        ps = get_parallel_state()
        if ps.is_single:
            self.scheduler = Scheduler(*sched_parts)
        else:  # rank 0 broadcasts every step's inputs; the others replay them
            self.scheduler = ReplicatedScheduler(*sched_parts, ps.world, self.tokenizer)
        self._ids = itertools.count()
        self._grammars: Grammars | None = None
        self._return_text_in_logprobs = False
        torch.manual_seed(args.random_seed)

    def init_graphs(
        self, max_bs: int, prefill_max_tokens: int = 0, graph_factory: GraphFactory | None = None
    ) -> None:
        """Register and capture every CUDA graph (at startup; tests call it with `EagerGraph`)."""
        assert self.graphs is None, "graphs are captured once"
        self.graphs = init_cuda_graphs(
            self.executor, self.runner, max_bs, prefill_max_tokens, graph_factory
        )

    @property
    def spec(self) -> DSparkExecutor | None:
        """The DSpark executor, or None without speculative decoding."""
        return self.executor if isinstance(self.executor, DSparkExecutor) else None

    # ---- public API --------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts).

        With `return_logprob`, `meta_info` carries SGLang's logprob keys
        (`srt/entrypoints/logprob_format.py`): output logprobs, prompt logprobs from
        `logprob_start_len` (-1: none), the `top_logprobs_num` most probable tokens per
        position and the logprobs of `token_ids_logprob`, with token texts when
        `return_text_in_logprobs`."""
        prompts, single = self._normalise_inputs(prompt, input_ids)
        params_list = (
            sampling_params
            if isinstance(sampling_params, list)
            else ([sampling_params] * len(prompts))
        )
        if len(params_list) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
            )
        options = LogprobOptions.parse(
            return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob
        )
        self._return_text_in_logprobs = return_text_in_logprobs
        reqs = [self._make_req(p, sp or {}, options) for p, sp in zip(prompts, params_list)]
        self.scheduler.add_group(reqs)
        while any(not r.finished for r in reqs):
            self.scheduler.step()
        failed = [(i, r.error) for i, r in enumerate(reqs) if r.error is not None]
        if failed:
            raise RuntimeError(f"request {failed[0][0]} failed: {failed[0][1]}")
        outs = [self._output(r) for r in reqs]
        return outs[0] if single else outs

    def shutdown(self, scheduler_stuck: bool = False) -> None:
        """Release the executor and the other ranks. `scheduler_stuck`: a thread still runs a
        step (the server's scheduler hung), so the ranks cannot be released in step with it:
        they are killed instead of told to stop."""
        if self.scheduler is not None and not scheduler_stuck:
            self.executor.close()
        self._stop_ranks(release=not scheduler_stuck)
        self.scheduler = None  # type: ignore[assignment]
        self.runner = None  # type: ignore[assignment]

    def _stop_ranks(self, release: bool = True) -> None:
        """Rank 0: release the other ranks and wait for them, or kill them when `release` is
        False (no-op on one rank)."""
        if self.ranks is None:
            return
        scheduler = getattr(self, "scheduler", None)
        if release and isinstance(scheduler, ReplicatedScheduler):
            scheduler.close()
        self.ranks.close(kill=not release)
        self.ranks = None
        _set_parallel_state(single_process_state())

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- helpers -----------------------------------------------------------------------
    def _normalise_inputs(self, prompt: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt= or input_ids=")
        if input_ids is not None:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            batch = [input_ids] if single else list(input_ids)
            for ids in batch:
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("input_ids must be a list of ints or a list of lists of ints")
            return batch, single
        if self.tokenizer is None:
            raise ValueError("prompt= needs a tokenizer; pass input_ids= with skip_tokenizer_init")
        single = isinstance(prompt, str)
        texts = [prompt] if single else list(prompt)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a str or a list of str")
        return [self.tokenizer.encode(t) for t in texts], single

    def _make_req(self, ids: list[int], sp: dict, options: LogprobOptions) -> Req:
        params = SamplingParams.from_dict(sp)
        if self._grammars is None:
            self._grammars = Grammars(
                self.tokenizer, self.runner.model_cfg.vocab_size, self.scheduler.cfg.eos_token_ids
            )
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                no_stop_trim=params.no_stop_trim,
                prompt_ids=ids,
            )
        return Req(
            rid=str(next(self._ids)),
            prompt_ids=list(ids),
            params=params,
            return_logprob=options.return_logprob,
            logprob_start_len=options.logprob_start_len,
            top_logprobs_num=options.top_logprobs_num,
            token_ids_logprob=options.token_ids_logprob,
            detok=detok,
            grammar=self._grammars.matcher_for(params.grammar),
        )

    def _output(self, req: Req) -> dict:
        text = ""
        if req.detok is not None:
            req.detok.finish()
            text = req.detok.text
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "finish_reason": req.finish_reason,
        }
        if self.spec is not None:
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = (
                req.spec_committed / req.spec_verify_ct if req.spec_verify_ct else 0.0
            )
            if self.args.speculative_dspark_simulate_accept_len is not None:
                meta["spec_simulated_accept_len"] = self.args.speculative_dspark_simulate_accept_len
        if req.return_logprob:
            tok = self.tokenizer if self._return_text_in_logprobs else None
            meta.update(req_logprob_meta(req, tok))
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
