"""`ServerArgs`: the single list of server knobs, with SGLang's flag names.

The argparse parser is generated from the dataclass fields: the flag is `--` + the field name with
`-` for `_`, the default is the field default, help and `choices` come from the field metadata.
`ServerArgs(...)` validates (ValueError naming the flag); `resolved()` returns a new record with
every "auto" value replaced by what will actually run; `from_cli_args` does both.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.models.shipped import shipped_model_dir
from sgl_dspark.srt.server_args_checks import (
    CONFIDENCE_MODE_CHOICES,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    ENGRAM_TABLE_LOCATION_CHOICES,
    EP_COMBINE_CHOICES,
    FP8_ACTIVATION_CHOICES,
    KERNEL_BACKEND_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    LOAD_FORMAT_CHOICES,
    LOG_LEVEL_CHOICES,
    REASONING_PARSER_CHOICES,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSER_CHOICES,
    VERIFY_POLICY_CHOICES,
    WEIGHT_FORMAT_CHOICES,
    attention_backend_choices,
    check_deterministic_inference,
    resolve_fp8_activations,
    validate,
)

logger = logging.getLogger(__name__)
DEFAULT_CHUNKED_PREFILL_SIZE = 512
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def _arg(
    default: Any,
    help: str,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    aliases: Sequence[str] = (),
) -> Any:
    return field(
        default=default,
        metadata={"help": help, "choices": choices, "metavar": metavar, "aliases": aliases},
    )


@dataclass(frozen=True)
class ServerArgs:
    """Every knob of the server (and of the offline engine it builds). See `--help`."""

    # ---- model and tokenizer ----
    model_path: str = field(
        metadata={
            "help": "Model to serve: 'demo' (a small DeepSeek-V4.1 trained on math word "
            "problems, with its trained DSpark draft), 'tiny-v41' / 'tiny' (the built-in tiny "
            "DeepSeek-V4.1 / DeepSeek-V4 with random weights, for tests) or a checkpoint "
            "directory holding config.json and *.safetensors."
        }
    )
    tokenizer_path: str | None = _arg(None, "Tokenizer directory (default: --model-path).")
    skip_tokenizer_init: bool = _arg(
        False, "Load no tokenizer: requests must send token ids and receive token ids only."
    )
    served_model_name: str | None = _arg(
        None, "Model name the OpenAI API reports and accepts in 'model' (default: --model-path)."
    )
    trust_remote_code: bool = _arg(
        False,
        "Let transformers run a tokenizer's own code when it loads one that tokenizer.json "
        "cannot describe (the model itself never runs remote code).",
    )
    # ---- chat ----
    reasoning_parser: str | None = _arg(
        None,
        "Separate the reasoning of a thinking model into 'reasoning_content' in chat "
        "responses, as SGLang does for these DeepSeek formats.",
        REASONING_PARSER_CHOICES,
    )
    tool_call_parser: str | None = _arg(
        None,
        "Parse tool calls in chat output in this DeepSeek format into OpenAI 'tool_calls' "
        "(default: the format of the served model; the built-in model uses deepseekv4).",
        TOOL_CALL_PARSER_CHOICES,
    )
    # ---- HTTP ----
    host: str = _arg("127.0.0.1", "Address to listen on.")
    port: int = _arg(30000, "Port to listen on (0 picks a free port, shown in the ready line).")
    api_key: str | None = _arg(
        None,
        "If set, every route except /health and /metrics (including /health_generate, which "
        "runs the model) needs 'Authorization: Bearer <key>'.",
    )
    graceful_shutdown_timeout: float = _arg(
        10.0,
        "Seconds that SIGTERM/SIGINT let in-flight requests finish (new ones get 503) before "
        "ending the rest with an error.",
    )
    max_connections: int = _arg(
        4096,
        "Most open HTTP connections; more are answered 503 and closed. Capped below the "
        "open-file limit, which the server raises at start where the OS allows.",
    )
    max_request_body_bytes: int = _arg(
        32 * 2**20, "Largest request body in bytes (larger ones are answered 413)."
    )
    max_header_bytes: int = _arg(
        16384,
        "Largest request line + headers in bytes (larger ones are answered 431, or 400 when "
        "they arrive in pieces).",
    )
    keep_alive_timeout: float = _arg(
        5.0, "Seconds an idle keep-alive connection stays open after a response."
    )
    client_timeout: float = _arg(
        30.0,
        "Seconds a client may take to send a request's headers, and its body, and that a "
        "streamed response may wait for the client to read; then the connection is closed "
        "(408 for a late request).",
    )
    max_queued_requests: int = _arg(
        4096, "Most requests waiting to be scheduled; more are refused with 503 and Retry-After."
    )
    queue_timeout: float = _arg(
        600.0,
        "Seconds a request may wait to be scheduled before it is refused with 503 and "
        "Retry-After; 0: no limit.",
    )
    watchdog_timeout: float = _arg(
        300.0,
        "Seconds the scheduler may make no progress while it has requests before the server "
        "fails them and shuts down with an error (instead of hanging).",
    )
    log_level: str = _arg("info", "Log level of the server and uvicorn.", LOG_LEVEL_CHOICES)
    log_requests: bool = _arg(
        False, "Log every generation request (id, route, prompt and output token counts)."
    )
    log_requests_level: int = _arg(
        0,
        "With --log-requests: 0 logs ids and counts; 1 or more also the sampling parameters "
        "(SGLang's levels 2 and 3, which add texts, log what 1 logs: prompts stay private).",
    )
    enable_metrics: bool = _arg(
        False, "Accepted for SGLang compatibility: /metrics (Prometheus) is always served."
    )
    enable_cache_report: bool = _arg(
        False,
        "Accepted for SGLang compatibility: there is no cross-request prefix cache, so "
        "cached-token counts are always 0.",
    )
    disable_radix_cache: bool = _arg(
        False,
        "Accepted for SGLang compatibility: there is no cross-request prefix (radix) cache.",
    )
    skip_server_warmup: bool = _arg(
        False,
        "Accepted for SGLang compatibility: the server runs no warm-up request (CUDA graphs "
        "are captured at start either way).",
    )
    # ---- runtime ----
    device: str = _arg(
        "auto", "Device to run on; auto = cuda when available, else cpu.", DEVICE_CHOICES
    )
    dtype: str = _arg(
        "auto",
        "Weight and activation dtype; auto = float32 on CPU, bfloat16 on GPU.",
        DTYPE_CHOICES,
    )
    random_seed: int = _arg(
        0, "Seed of the built-in models' initialisation and of unseeded sampling."
    )
    weight_format: str = _arg(
        "auto",
        "How quantised checkpoint weights (FP8 block-scaled, MXFP4) live on the device: native "
        "= as stored, dequantised inside the GEMMs (the torch kernels dequantise per call); "
        "bf16 = dequantised once at load to --dtype; auto = native on GPU, bf16 on CPU.",
        WEIGHT_FORMAT_CHOICES,
    )
    fp8_activations: str = _arg(
        "off",
        "FP8 activations for the GEMMs on FP8 weights kept as stored (--weight-format native) "
        "above decode sizes: per-token-group E4M3 with the checkpoint's block and scale format, "
        "W8A8 block-scaled GEMMs on the FP8 matrix units (and on gfx950 / Blackwell the MXFP4 "
        "experts through MXFP8 scaled dots). Changes numerics: activations are rounded to "
        "E4M3 (docs/kernels.md). auto = on where the GPU has native FP8 MMA (NVIDIA sm89+, "
        "AMD gfx950) with the triton linear kernels and native weights, else off. Off by "
        "default: a DSpark verify wider than decode sizes would round its activations where "
        "the plain decode step does not, so greedy output with DSpark would no longer equal "
        "greedy output without it.",
        FP8_ACTIVATION_CHOICES,
    )
    enable_deterministic_inference: bool = _arg(
        False,
        "Batch-invariant kernels: every row of a forward gets the bits it would get alone, "
        "whatever the batch size and the other rows (the linear layers, the grouped output "
        "projection and the MoE run one kernel shape at every M; the attention never splits "
        "the key range by batch size). With it, greedy output with DSpark equals greedy output "
        "without it bit for bit on a GPU, and a request's output does not depend on what else "
        "runs. Needs the triton kernels and attention (auto on GPU) and --fp8-activations off; "
        "costs throughput at larger batches (docs/deterministic.md).",
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "Storage of the window KV cache: auto = --dtype; fp8_e4m3 = E4M3 (stored saturated, "
        "read back exactly and attended in --dtype); bfloat16. DeepSeek-V4.1 keeps its "
        "window FP8 by definition (auto or fp8_e4m3).",
        KV_CACHE_DTYPE_CHOICES,
    )
    engram_table_location: str = _arg(
        "device",
        "Where DeepSeek-V4.1's Engram hash tables live: device = GPU memory; host = page-locked "
        "host memory, whose rows the gather kernel reads over the bus through unified "
        "addressing (a decode token reads a few KB). The released tables are about 100 GB a "
        "layer as stored, more than a GPU holds beside the model. host needs a GPU and the "
        "triton engram kernels.",
        ENGRAM_TABLE_LOCATION_CHOICES,
    )
    load_format: str = _arg(
        "auto",
        "auto = the checkpoint's safetensors; dummy = seeded random weights generated on the "
        "device in the checkpoint's declared formats (config.json only; for benchmarks).",
        LOAD_FORMAT_CHOICES,
    )
    kernel_backend: str = _arg(
        "auto",
        "Implementation of the fused kernels; auto = triton on GPU, torch on CPU.",
        KERNEL_BACKEND_CHOICES,
    )
    kernel_backend_overrides: str | None = _arg(
        None,
        "Per op family exceptions to --kernel-backend, e.g. 'moe=torch,rope=triton' "
        "(families: rope, mhc, moe, sampling, spec, indexer, norm).",
    )
    attention_backend: str = _arg(
        "auto", "Attention backend; auto = triton on GPU, torch on CPU.", None
    )  # choices: auto and the registry
    debug_step_delay_ms: float = _arg(
        0.0,
        "Testing only: sleep this many ms after every scheduler step (used to check that "
        "the A/B harness detects a slower build). Never set it in production.",
    )
    # ---- memory and scheduling ----
    context_length: int = _arg(4096, "Longest sequence (prompt + output) a request may have.")
    max_total_tokens: int = _arg(32768, "Size of the KV pool in tokens.")
    mem_fraction_static: float | None = _arg(
        None,
        "CUDA: fraction of total GPU memory for weights and the KV pool; the pool takes "
        "what the weights leave of it (overrides --max-total-tokens). Not used on CPU.",
    )
    max_running_requests: int = _arg(32, "Most requests in the running batch.")
    chunked_prefill_size: int = _arg(
        DEFAULT_CHUNKED_PREFILL_SIZE,
        "Most prompt tokens prefilled per step (over all requests); -1 disables chunking.",
    )
    page_size: int = _arg(
        0, "KV page size in tokens; 0 = the smallest multiple of every compress rate."
    )
    cuda_graph_max_bs: int | None = _arg(
        None,
        "Largest batch size captured in CUDA graphs (decode, every DSpark verify width and "
        "the draft); default min(--max-running-requests, 32); 0 = run eagerly. Needs the "
        "Triton MoE path (--kernel-backend triton).",
    )
    cuda_graph_max_prefill_tokens: int | None = _arg(
        None,
        "Largest prefill forward (tokens over all its requests, at most --cuda-graph-max-bs "
        "requests) replayed from a CUDA graph; larger ones run eagerly. Default "
        "min(--chunked-prefill-size, 4096); 0 = every prefill eagerly.",
    )
    disable_cuda_graph: bool = _arg(False, "Run every step eagerly (no CUDA graphs).")
    disable_programmatic_launch: bool = _arg(
        False,
        "CUDA sm90+: launch every fused Triton kernel as a plain launch instead of a "
        "programmatic dependent launch (which overlaps a kernel's launch with the tail "
        "of the one before it). Changes timing only, never a result; process-wide.",
    )
    programmatic_launch_max_bs: int = _arg(
        24,
        "CUDA sm90+: capture graphs of at most this many requests with programmatic "
        "launches, larger ones with plain launches (programmatic launch pays off at small "
        "batches; see benchmark/results/kernels.md); 0: plain launches in every graph.",
    )
    disable_overlap_schedule: bool = _arg(
        False,
        "Run decode steps one at a time: read each step's tokens before launching the "
        "next (default: the next decode step is launched from the sampled tokens still "
        "on the device, and the host reads the previous step meanwhile; all-greedy DSpark "
        "steps chain the same way as fused step graphs). With this flag DSpark runs its "
        "eager step, the reference path.",
    )
    # ---- parallelism (one host) ----
    tp_size: int = _arg(
        1,
        "Tensor parallelism: ranks (GPUs) that split the attention heads and the vocabulary "
        "(embedding and head). The world has max(--tp-size, --ep-size) ranks, one process each.",
        aliases=("--tp",),
    )
    ep_size: int = _arg(
        1,
        "Expert parallelism: ranks that split the routed experts (each holds E/ep of them); "
        "equal to --tp-size, or with --tp-size 1 attention is replicated on every rank.",
        aliases=("--ep",),
    )
    ep_combine: str = _arg(
        "exact",
        "How expert-parallel ranks combine the routed experts: exact = all-reduce every "
        "route's product, then the slot-ordered sum (bit-identical to one rank); fast = each "
        "rank sums its own routes, then one all-reduce of [tokens, hidden] (within float "
        "rounding of one rank).",
        EP_COMBINE_CHOICES,
    )
    dist_init_addr: str | None = _arg(
        None,
        "host:port where rank 0 rendezvouses the ranks (default: 127.0.0.1 and a free port).",
    )
    nnodes: int = _arg(1, "Number of hosts (only 1 is supported).")
    node_rank: int = _arg(0, "This host's index among --nnodes hosts (only 0 is supported).")
    # ---- speculative decoding ----
    speculative_algorithm: str | None = _arg(
        None, "Speculative decoding algorithm (case-insensitive): DSpark.", None, "{DSpark}"
    )
    speculative_draft_model_path: str | None = _arg(
        None,
        "DSpark draft: a directory, or 'tiny-v41-dspark' / 'tiny-dspark' (the built-in drafts "
        "of 'tiny-v41' / 'tiny'). Default: the target when its config bundles dspark_* keys, "
        "else <model>/dspark/, else the built-in target's own draft.",
    )
    speculative_dspark_block_size: int | None = _arg(
        None, "Drafts per step (gamma); default: the draft checkpoint's block size."
    )
    speculative_dspark_bs1_block_size: int | None = _arg(
        None,
        "Drafts per step when exactly one request is decoding (the bs1 runtime, which "
        "verifies its full window); default: the block size.",
    )
    speculative_dspark_verify_policy: str = _arg(
        "full",
        "Verify length policy: full window, static per-step width, or confidence-driven budget.",
        VERIFY_POLICY_CHOICES,
    )
    speculative_dspark_width_table_path: str | None = _arg(
        None,
        'Static policy: verify width per batch size, JSON {"widths_by_batch_size": '
        "{...}} (width 1: no speculation at that size, plain overlapped decode steps); "
        "default: the packaged table of this device.",
    )
    speculative_dspark_online_width: bool = _arg(
        False,
        "Static policy: choose the width online from acceptance statistics and the SPS "
        "table instead of a width table.",
    )
    speculative_dspark_verify_widths: str = _arg(
        "2,3", "Online width policy: the narrow widths to choose from (comma list)."
    )
    speculative_dspark_sps_table_path: str | None = _arg(
        None,
        "SPS cost table JSON (steps/s vs verify tokens) for the online width and the "
        "confidence policies.",
    )
    speculative_dspark_confidence_mode: str = _arg(
        "sync",
        "Confidence policy: sync (Algorithm 1 on this step's confidences) or async "
        "(top-K with a budget from lagged confidences).",
        CONFIDENCE_MODE_CHOICES,
    )
    speculative_dspark_confidence_sts_path: str | None = _arg(
        None, "STS temperature JSON calibrating the confidence head (confidence policy)."
    )
    speculative_dspark_sts_collect_path: str | None = _arg(
        None,
        "Calibration runs: write raw confidence shards to <stem>.<i>.pt for "
        "python -m sgl_dspark.tools.dspark_sts_fit.",
    )
    speculative_dspark_simulate_accept_len: float | None = _arg(
        None, "Benchmarks only: force this mean accept length (>= 1) instead of verifying."
    )

    def __post_init__(self) -> None:
        validate(self)

    # ---- construction ------------------------------------------------------------------------
    def resolved(self) -> ServerArgs:
        """A new record with every "auto"/None default replaced by the value that will run."""
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        weight_format = self.weight_format
        if weight_format == "auto":
            weight_format = "bf16" if device == "cpu" else "native"
        kernel_backend = self.kernel_backend
        if kernel_backend == "auto":
            kernel_backend = "torch" if device == "cpu" else "triton"
        attention_backend = self.attention_backend
        if attention_backend == "auto":
            attention_backend = "torch" if device == "cpu" else "triton"
        fp8_activations = resolve_fp8_activations(
            self.fp8_activations,
            device,
            weight_format,
            KernelChoice.parse(kernel_backend, self.kernel_backend_overrides).of("linear"),
        )
        if self.enable_deterministic_inference:
            check_deterministic_inference(
                kernel_backend, self.kernel_backend_overrides, attention_backend, fp8_activations
            )
        algo = self.speculative_algorithm
        if algo is not None:
            algo = next(a for a in SPECULATIVE_ALGORITHMS if a.lower() == algo.lower())
        if device == "cpu" and (self.cuda_graph_max_bs or self.mem_fraction_static is not None):
            logger.warning("--cuda-graph-max-bs and --mem-fraction-static have no effect on CPU")
        model_path = self.model_path
        shipped = shipped_model_dir(model_path)
        if shipped is not None:  # a model shipped in the package, served under its name
            model_path = shipped
        return dataclasses.replace(
            self,
            model_path=model_path,
            device=device,
            dtype=dtype,
            kernel_backend=kernel_backend,
            attention_backend=attention_backend,
            weight_format=weight_format,
            fp8_activations=fp8_activations,
            served_model_name=self.served_model_name or self.model_path,
            speculative_algorithm=algo,
        )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (see the module doc)."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _FIELD_TYPES[str(f.type)]
            kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
            if kind is bool:
                kwargs["action"] = "store_true"
            else:
                kwargs["type"] = kind
                choices = f.metadata.get("choices")
                if f.name == "attention_backend":
                    choices = attention_backend_choices()
                if choices:
                    kwargs["choices"] = choices
                if f.metadata.get("metavar"):
                    kwargs["metavar"] = f.metadata["metavar"]
                elif not choices:
                    kwargs["metavar"] = _metavar(f.name, kind)
                if f.default is dataclasses.MISSING:
                    kwargs["required"] = True
                else:
                    kwargs["default"] = f.default
                    if f.default is not None:
                        kwargs["help"] += " (default: %(default)s)"
            parser.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)

    @classmethod
    def from_cli_args(
        cls, argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
    ) -> ServerArgs:
        """Parse `argv` (default: sys.argv[1:]) into a validated, resolved record.

        Unknown flags and invalid or conflicting values exit through `parser.error` (status 2)
        with a message naming the flag, and for a mistyped flag the closest known ones."""
        parser = parser or make_parser()
        ns, unknown = parser.parse_known_args(argv)
        if unknown:
            known = [a for action in parser._actions for a in action.option_strings]
            hints = []
            for arg in unknown:
                close = difflib.get_close_matches(arg.split("=")[0], known, n=2)
                hints.append(f"{arg} (did you mean {' or '.join(close)}?)" if close else arg)
            parser.error("unrecognized arguments: " + ", ".join(hints))
        try:
            return cls(**vars(ns)).resolved()
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: parser.error exits


_FIELD_TYPES: dict[str, type] = {
    "str": str,
    "str | None": str,
    "int": int,
    "int | None": int,
    "float": float,
    "float | None": float,
    "bool": bool,
}


def _metavar(name: str, kind: type) -> str:
    if name.endswith("_path"):
        return "PATH"
    return {int: "N", float: "X"}.get(kind, "STR")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_dspark.launch_server",
        usage="%(prog)s --model-path PATH [options]   (see --help)",
        allow_abbrev=False,  # a prefix of a flag is an unknown flag, not a silent match
        description="SGLang-compatible HTTP server for DeepSeek-V4 models with DSpark "
        "speculative decoding.",
    )
    ServerArgs.add_cli_args(parser)
    return parser
