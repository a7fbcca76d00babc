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

logger = logging.getLogger(__name__)

SPECULATIVE_ALGORITHMS = ("DSpark",)

DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
DEVICE_CHOICES = ("auto", "cpu", "cuda")
KERNEL_BACKEND_CHOICES = ("auto", "torch", "triton")
VERIFY_POLICY_CHOICES = ("full", "static", "confidence")
CONFIDENCE_MODE_CHOICES = ("sync", "async")
LOG_LEVEL_CHOICES = ("debug", "info", "warning", "error", "critical")
EP_COMBINE_CHOICES = ("exact", "fast")
DEFAULT_CHUNKED_PREFILL_SIZE = 512


def _attention_backend_choices() -> tuple[str, ...]:
    from sgl_dspark.srt.layers.attention import ATTENTION_BACKENDS

    return tuple(sorted(ATTENTION_BACKENDS))


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
            "help": "Model to serve: 'tiny' (the built-in tiny DeepSeek-V4) or a checkpoint directory "
            "holding config.json and *.safetensors."
        }
    )
    tokenizer_path: str | None = _arg(None, "Tokenizer directory (default: --model-path).")
    skip_tokenizer_init: bool = _arg(
        False, "Load no tokenizer: requests must send token ids and receive token ids only."
    )
    served_model_name: str | None = _arg(
        None, "Model name the OpenAI API reports and accepts in 'model' (default: --model-path)."
    )
    # ---- HTTP ----
    host: str = _arg("127.0.0.1", "Address to listen on.")
    port: int = _arg(30000, "Port to listen on (0 picks a free port, shown in the ready line).")
    api_key: str | None = _arg(
        None,
        "If set, every request except /health* and /metrics must send "
        "'Authorization: Bearer <key>'.",
    )
    graceful_shutdown_timeout: float = _arg(
        10.0, "Seconds that SIGTERM/SIGINT wait for in-flight requests before aborting them."
    )
    log_level: str = _arg("info", "Log level of the server and uvicorn.", LOG_LEVEL_CHOICES)
    # ---- runtime ----
    device: str = _arg(
        "auto", "Device to run on; auto = cuda when available, else cpu.", DEVICE_CHOICES
    )
    dtype: str = _arg(
        "auto",
        "Weight and activation dtype; auto = float32 on CPU, bfloat16 on GPU.",
        DTYPE_CHOICES,
    )
    random_seed: int = _arg(0, "Seed of the model initialisation (tiny) and of unseeded sampling.")
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
    attention_backend: str = _arg("torch", "Attention backend.", None)  # choices: the registry
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
        "DSpark draft: a directory, or 'tiny-dspark' (the built-in draft of 'tiny'). "
        "Default: the target when its config bundles dspark_* keys, else <model>/dspark/.",
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
        _validate(self)

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
        kernel_backend = self.kernel_backend
        if kernel_backend == "auto":
            kernel_backend = "torch" if device == "cpu" else "triton"
        algo = self.speculative_algorithm
        if algo is not None:
            algo = next(a for a in SPECULATIVE_ALGORITHMS if a.lower() == algo.lower())
        if device == "cpu" and (self.cuda_graph_max_bs or self.mem_fraction_static is not None):
            logger.warning("--cuda-graph-max-bs and --mem-fraction-static have no effect on CPU")
        return dataclasses.replace(
            self,
            device=device,
            dtype=dtype,
            kernel_backend=kernel_backend,
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
                    choices = _attention_backend_choices()
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


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _validate(a: ServerArgs) -> None:
    """Each check names the flag to change. Raises ValueError."""
    _require(
        isinstance(a.model_path, str) and bool(a.model_path),
        "--model-path must be a non-empty string",
    )
    _require(
        not (a.skip_tokenizer_init and a.tokenizer_path is not None),
        "--tokenizer-path conflicts with --skip-tokenizer-init (no tokenizer is loaded)",
    )
    _require(
        a.served_model_name is None or bool(a.served_model_name),
        "--served-model-name must not be empty",
    )
    _require(a.api_key is None or bool(a.api_key), "--api-key must not be empty")
    _require(0 <= a.port <= 65535, f"--port must be in [0, 65535], got {a.port}")
    _require(
        a.graceful_shutdown_timeout >= 0,
        f"--graceful-shutdown-timeout must be >= 0, got {a.graceful_shutdown_timeout}",
    )
    _check_choice("--log-level", a.log_level, LOG_LEVEL_CHOICES)
    _check_choice("--device", a.device, DEVICE_CHOICES)
    _check_choice("--dtype", a.dtype, DTYPE_CHOICES)
    _check_choice("--kernel-backend", a.kernel_backend, KERNEL_BACKEND_CHOICES)
    _check_choice("--attention-backend", a.attention_backend, _attention_backend_choices())
    from sgl_dspark.srt.core.kernel_choice import KernelChoice

    KernelChoice.parse("torch", a.kernel_backend_overrides)  # raises naming the flag
    for flag, value in (
        ("--context-length", a.context_length),
        ("--max-total-tokens", a.max_total_tokens),
        ("--max-running-requests", a.max_running_requests),
    ):
        _require(value >= 1, f"{flag} must be >= 1, got {value}")
    _require(
        a.chunked_prefill_size == -1 or a.chunked_prefill_size >= 1,
        f"--chunked-prefill-size must be -1 (off) or >= 1, got {a.chunked_prefill_size}",
    )
    _require(a.page_size >= 0, f"--page-size must be >= 0 (0 = auto), got {a.page_size}")
    _require(
        a.mem_fraction_static is None or 0.0 < a.mem_fraction_static < 1.0,
        f"--mem-fraction-static must be in (0, 1), got {a.mem_fraction_static}",
    )
    _require(
        a.cuda_graph_max_prefill_tokens is None or a.cuda_graph_max_prefill_tokens >= 0,
        "--cuda-graph-max-prefill-tokens must be >= 0 (0 = eager prefill), got "
        f"{a.cuda_graph_max_prefill_tokens}",
    )
    _require(
        a.cuda_graph_max_bs is None or a.cuda_graph_max_bs >= 0,
        f"--cuda-graph-max-bs must be >= 0, got {a.cuda_graph_max_bs}",
    )
    _require(
        a.programmatic_launch_max_bs >= 0,
        f"--programmatic-launch-max-bs must be >= 0, got {a.programmatic_launch_max_bs}",
    )
    _require(
        not (a.disable_cuda_graph and a.cuda_graph_max_bs),
        "--cuda-graph-max-bs conflicts with --disable-cuda-graph",
    )
    _require(
        not a.cuda_graph_max_bs or a.cuda_graph_max_bs <= a.max_running_requests,
        f"--cuda-graph-max-bs {a.cuda_graph_max_bs} exceeds --max-running-requests "
        f"{a.max_running_requests}",
    )
    _validate_parallel(a)
    _validate_speculative(a)


def _validate_parallel(a: ServerArgs) -> None:
    _require(a.nnodes >= 1, f"--nnodes must be >= 1, got {a.nnodes}")
    _require(
        a.nnodes == 1,
        f"--nnodes {a.nnodes}: several hosts are not supported; run --tp-size/--ep-size "
        "ranks on one host",
    )
    _require(a.node_rank == 0, f"--node-rank must be 0 with one host, got {a.node_rank}")
    _check_choice("--ep-combine", a.ep_combine, EP_COMBINE_CHOICES)
    from sgl_dspark.srt.distributed.parallel_state import ParallelLayout

    ParallelLayout(a.tp_size, a.ep_size)  # raises naming the flags
    if a.dist_init_addr is not None:
        host, _, port = a.dist_init_addr.rpartition(":")
        _require(
            bool(host) and port.isdigit() and 0 < int(port) <= 65535,
            f"--dist-init-addr must be host:port, got {a.dist_init_addr!r}",
        )


def _check_choice(flag: str, value: Any, choices: Sequence[str]) -> None:
    _require(value in choices, f"{flag} must be one of {list(choices)}, got {value!r}")


def _validate_speculative(a: ServerArgs) -> None:
    algo = a.speculative_algorithm
    set_flags = [
        "--" + f.name.replace("_", "-")
        for f in dataclasses.fields(a)
        if f.name.startswith("speculative_")
        and f.name != "speculative_algorithm"
        and getattr(a, f.name) != f.default
    ]
    if algo is None:
        _require(not set_flags, f"{', '.join(set_flags)} need(s) --speculative-algorithm DSpark")
        return
    _require(
        isinstance(algo, str) and algo.lower() in {s.lower() for s in SPECULATIVE_ALGORITHMS},
        f"--speculative-algorithm must be one of {list(SPECULATIVE_ALGORITHMS)} "
        f"(case-insensitive), got {algo!r}",
    )
    gamma = a.speculative_dspark_block_size
    _require(
        gamma is None or gamma >= 1, f"--speculative-dspark-block-size must be >= 1, got {gamma}"
    )
    bs1 = a.speculative_dspark_bs1_block_size
    _require(
        bs1 is None or 1 <= bs1 <= 15,
        f"--speculative-dspark-bs1-block-size must be in [1, 15], got {bs1}",
    )
    sim = a.speculative_dspark_simulate_accept_len
    _require(
        sim is None or sim >= 1.0,
        f"--speculative-dspark-simulate-accept-len must be >= 1, got {sim}",
    )
    if sim is not None and gamma is not None:
        _require(
            sim <= gamma + 1,
            f"--speculative-dspark-simulate-accept-len {sim} exceeds "
            f"--speculative-dspark-block-size + 1 ({gamma + 1})",
        )
    policy = a.speculative_dspark_verify_policy
    _check_choice("--speculative-dspark-verify-policy", policy, VERIFY_POLICY_CHOICES)
    _check_choice(
        "--speculative-dspark-confidence-mode",
        a.speculative_dspark_confidence_mode,
        CONFIDENCE_MODE_CHOICES,
    )
    online = a.speculative_dspark_online_width
    for flag, used, policies in (
        (
            "--speculative-dspark-width-table-path",
            a.speculative_dspark_width_table_path is not None,
            ("static",),
        ),
        ("--speculative-dspark-online-width", online, ("static",)),
        (
            "--speculative-dspark-confidence-mode",
            a.speculative_dspark_confidence_mode != "sync",
            ("confidence",),
        ),
        (
            "--speculative-dspark-confidence-sts-path",
            a.speculative_dspark_confidence_sts_path is not None,
            ("confidence",),
        ),
        (
            "--speculative-dspark-sps-table-path",
            a.speculative_dspark_sps_table_path is not None,
            ("static", "confidence"),
        ),
    ):
        _require(
            not used or policy in policies,
            f"{flag} is only used with --speculative-dspark-verify-policy "
            f"{' or '.join(policies)} (got {policy})",
        )
    _require(
        not (online and a.speculative_dspark_width_table_path is not None),
        "--speculative-dspark-width-table-path conflicts with "
        "--speculative-dspark-online-width (a fixed table or the online policy)",
    )
    _require(
        online or a.speculative_dspark_verify_widths == "2,3",
        "--speculative-dspark-verify-widths is only used with --speculative-dspark-online-width",
    )
    _require(
        not (policy == "static" and a.speculative_dspark_sps_table_path is not None and not online),
        "--speculative-dspark-sps-table-path is only used by the static policy with "
        "--speculative-dspark-online-width",
    )
    widths = a.speculative_dspark_verify_widths.split(",")
    _require(
        all(w.strip().isdigit() and int(w) >= 2 for w in widths),
        f"--speculative-dspark-verify-widths must be a comma list of ints >= 2, got "
        f"{a.speculative_dspark_verify_widths!r}",
    )
