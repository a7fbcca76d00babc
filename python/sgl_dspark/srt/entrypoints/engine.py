"""Offline engine, SGLang-style: `Engine(model_path=...).generate(prompt=..., sampling_params=...)`.

Runs the scheduler in-process; the HTTP server drives the same scheduler from its own loop.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.managers.scheduler import Scheduler, SchedulerConfig
from sgl_dspark.srt.model_executor.model_runner import ModelRunner, RunnerConfig, resolve_dtype
from sgl_dspark.srt.model_loader.model_source import resolve_model
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.speculative.dspark.factory import create_dspark_worker
from sgl_dspark.srt.speculative.dspark.policy import PolicyArgs
from sgl_dspark.srt.speculative.dspark.worker import DSparkArgs, DSparkWorker
from sgl_dspark.srt.tokenizer import IncrementalDetokenizer, TokenizerLike, get_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    model_path: str = "tiny"
    tokenizer_path: str | None = None
    skip_tokenizer_init: bool = False
    device: str = "cpu"
    dtype: str = "auto"
    max_total_tokens: int = 32768
    mem_fraction_static: float | None = None  # CUDA: KV pool from free memory
    max_running_requests: int = 32
    context_length: int = 4096
    chunked_prefill_size: int = 512
    page_size: int = 0
    attention_backend: str = "torch"
    kernel_backend: str = "torch"  # torch | triton
    kernel_backend_overrides: str | None = None  # e.g. "moe=torch,rope=triton"
    random_seed: int = 0
    cuda_graph_max_bs: int | None = None  # None: min(max_running_requests, 32)
    cuda_graph_max_prefill_tokens: int | None = None  # None: min(chunked_prefill_size, 4096)
    disable_cuda_graph: bool = False
    disable_programmatic_launch: bool = False  # CUDA sm90+: plain kernel launches
    programmatic_launch_max_bs: int = 24  # larger graphs: plain launches
    disable_overlap_schedule: bool = False
    speculative_algorithm: str | None = None  # None | "DSpark" (case-insensitive)
    speculative_draft_model_path: str | None = None
    speculative_dspark_block_size: int | None = None
    speculative_dspark_bs1_block_size: int | None = None
    speculative_dspark_verify_policy: str = "full"  # full | static | confidence
    speculative_dspark_width_table_path: str | None = None
    speculative_dspark_online_width: bool = False
    speculative_dspark_verify_widths: str = "2,3"
    speculative_dspark_sps_table_path: str | None = None
    speculative_dspark_confidence_mode: str = "sync"  # sync (Algorithm 1) | async (top-K)
    speculative_dspark_confidence_sts_path: str | None = None
    speculative_dspark_simulate_accept_len: float | None = None
    speculative_dspark_sts_collect_path: str | None = None


def create_spec_worker(args: EngineArgs, runner: ModelRunner) -> DSparkWorker | None:
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo.lower() != "dspark":
        raise ValueError(f"--speculative-algorithm {algo!r}: only DSpark is supported")
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
        seed=args.random_seed,
    )
    return create_dspark_worker(
        runner,
        args.model_path,
        args.speculative_draft_model_path,
        args.speculative_dspark_block_size,
        dargs,
    )


def init_cuda_graphs(args: EngineArgs, runner: ModelRunner, spec: DSparkWorker | None) -> None:
    """Capture the target's decode/verify graphs (and the DSpark draft's) on CUDA unless
    disabled. Graphs need the sync-free MoE path; with the torch MoE backend they are only an
    error when asked for explicitly (--cuda-graph-max-bs), otherwise the engine runs eagerly."""
    if runner.device.type != "cuda" or args.disable_cuda_graph or args.cuda_graph_max_bs == 0:
        return
    if runner.kernels.of("moe") != "triton" and args.cuda_graph_max_bs is None:
        logger.warning(
            "CUDA graphs off: the torch MoE backend synchronises with the host; use "
            "--kernel-backend triton for graphs"
        )
        return
    max_bs = args.cuda_graph_max_bs or min(args.max_running_requests, 32)
    prefill_tokens = args.cuda_graph_max_prefill_tokens
    if prefill_tokens is None:
        chunk = args.chunked_prefill_size
        prefill_tokens = min(chunk if chunk > 0 else args.context_length, 4096)
    if spec is None:
        runner.init_cuda_graphs(max_bs, prefill_max_tokens=prefill_tokens)
        return
    runner.init_cuda_graphs(
        max_bs, spec.graph_verify_widths(), spec.tap_layers, prefill_max_tokens=prefill_tokens
    )
    spec.init_cuda_graphs(max_bs)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


class Engine:
    """Args as `EngineArgs` (keyword arguments). `dtype="auto"` is float32 on CPU, the
    checkpoint's dtype otherwise."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown Engine arguments: {sorted(unknown)}")
        args = EngineArgs(**kwargs)
        dtype = args.dtype
        if dtype == "auto":
            dtype = "float32" if args.device == "cpu" else "bfloat16"
        self.args = args
        cfg, weights = resolve_model(args.model_path, resolve_dtype(dtype), seed=args.random_seed)
        gamma = args.speculative_dspark_block_size or 7
        rc = RunnerConfig(
            device=args.device,
            dtype=dtype,
            max_total_tokens=args.max_total_tokens,
            max_verify_tokens=max(16, gamma + 1, (args.speculative_dspark_bs1_block_size or 0) + 1),
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            page_size=args.page_size,
            attention_backend=args.attention_backend,
            kernel_backend=args.kernel_backend,
            kernel_backend_overrides=args.kernel_backend_overrides,
            mem_fraction_static=args.mem_fraction_static,
        )
        # Process-wide (the launchers read it at every launch and at graph capture): the last
        # engine built in a process decides. It moves timing only, never a result bit.
        if args.device != "cpu":
            from sgl_dspark.kernels._triton_utils import set_programmatic_launch

            set_programmatic_launch(
                not args.disable_programmatic_launch,
                max_graph_batch=args.programmatic_launch_max_bs,
            )
        self.runner = ModelRunner(cfg, rc, weights=weights)
        spec = create_spec_worker(args, self.runner)
        init_cuda_graphs(args, self.runner, spec)
        self.tokenizer: TokenizerLike | None = None
        if not args.skip_tokenizer_init:
            self.tokenizer = get_tokenizer(args.model_path, args.tokenizer_path)
        self.scheduler = Scheduler(
            self.runner,
            SchedulerConfig(
                chunked_prefill_size=args.chunked_prefill_size,
                max_running_requests=args.max_running_requests,
                eos_token_ids=cfg.eos_token_ids,
                overlap_schedule=not args.disable_overlap_schedule,
            ),
            spec=spec,
        )
        self._ids = itertools.count()
        torch.manual_seed(args.random_seed)

    # ---- public API --------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
    ) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts)."""
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
        reqs = [self._make_req(p, sp or {}, return_logprob) for p, sp in zip(prompts, params_list)]
        for r in reqs:
            self.scheduler.add(r)
        while any(not r.finished for r in reqs):
            self.scheduler.step()
        outs = [self._output(r) for r in reqs]
        return outs[0] if single else outs

    def shutdown(self) -> None:
        if self.scheduler is not None and self.scheduler.spec is not None:
            self.scheduler.spec.close()
        self.scheduler = None  # type: ignore[assignment]
        self.runner = None  # type: ignore[assignment]

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

    def _make_req(self, ids: list[int], sp: dict, return_logprob: bool) -> Req:
        params = SamplingParams.from_dict(sp)
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
            return_logprob=return_logprob,
            detok=detok,
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
        if self.scheduler.spec is not None:
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = (
                req.spec_committed / req.spec_verify_ct if req.spec_verify_ct else 0.0
            )
            if self.args.speculative_dspark_simulate_accept_len is not None:
                meta["spec_simulated_accept_len"] = self.args.speculative_dspark_simulate_accept_len
        if req.return_logprob:
            tok = self.tokenizer
            meta["output_token_logprobs"] = [
                (lp, t, tok.decode([t], skip_special_tokens=False) if tok else None)
                for lp, t in zip(req.output_logprobs, req.output_ids)
            ]
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
