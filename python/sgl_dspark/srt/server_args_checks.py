"""Validation of `ServerArgs` (each check names the flag to change) and the flags' choices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_dspark.srt.server_args import ServerArgs

SPECULATIVE_ALGORITHMS = ("DSpark",)

DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
KERNEL_BACKEND_CHOICES = ("auto", "torch", "triton")
VERIFY_POLICY_CHOICES = ("full", "static", "confidence")
CONFIDENCE_MODE_CHOICES = ("sync", "async")
LOG_LEVEL_CHOICES = ("debug", "info", "warning", "error", "critical")
WEIGHT_FORMAT_CHOICES = ("auto", "native", "bf16")
LOAD_FORMAT_CHOICES = ("auto", "dummy")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8_e4m3", "bfloat16")
ENGRAM_TABLE_LOCATION_CHOICES = ("device", "host")
FP8_ACTIVATION_CHOICES = ("auto", "on", "off")
EP_COMBINE_CHOICES = ("exact", "fast")
# SGLang's names of the DeepSeek reasoning and tool-call formats (srt/entrypoints/chat_parsers.py).
REASONING_PARSER_CHOICES = ("deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41")
TOOL_CALL_PARSER_CHOICES = ("deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4", "deepseekv41")


def attention_backend_choices() -> tuple[str, ...]:
    from sgl_dspark.srt.layers.attention import ATTENTION_BACKENDS

    return ("auto", *sorted(ATTENTION_BACKENDS))


def check_engram_table_location(location: str, device: str, engram_kernels: str) -> None:
    """`--engram-table-location host` needs a GPU (whose kernels read page-locked host memory
    through unified addressing) and the triton "engram" kernels (the torch gather cannot index
    a host tensor with device ids without a host sync); ValueError naming the flag otherwise."""
    if location != "host":
        return
    _require(
        device == "cuda",
        "--engram-table-location host needs --device cuda (on a CPU every table is already in "
        "host memory)",
    )
    _require(
        engram_kernels == "triton",
        "--engram-table-location host needs the triton engram kernels (--kernel-backend "
        f"triton, or engram=triton in --kernel-backend-overrides); got {engram_kernels}",
    )


def resolve_fp8_activations(mode: str, device: str, weight_format: str, linear: str) -> str:
    """--fp8-activations resolved to "on" or "off" for a resolved device, weight format and
    "linear" kernel backend. auto: on with native weights, the triton linear kernels and a GPU
    with native FP8 MMA. on: those are required (a CPU runs the kernels in the Triton
    interpreter, for tests); ValueError naming the flag otherwise."""
    if mode == "off":
        return "off"
    import torch

    from sgl_dspark.kernels.fp8.targets import native_fp8_mma

    native = device == "cuda" and native_fp8_mma(torch.device("cuda"))
    if mode == "auto":
        return "on" if native and weight_format == "native" and linear == "triton" else "off"
    _require(
        weight_format == "native",
        "--fp8-activations on needs --weight-format native (the FP8 weights kept as stored)",
    )
    _require(linear == "triton", "--fp8-activations on needs the triton 'linear' kernels")
    _require(
        device == "cpu" or native,
        "--fp8-activations on: this GPU has no native FP8 matrix instructions for E4M3FN "
        "(NVIDIA sm89+ or AMD gfx950 have them); use auto or off",
    )
    return "on"


def check_deterministic_inference(
    kernel_backend: str, overrides: str | None, attention_backend: str, fp8_activations: str
) -> None:
    """--enable-deterministic-inference with resolved backends: the batch-invariant shapes exist
    in the Triton kernels only (the torch path's BLAS and reductions pick their order by
    shape), and FP8 activations quantise wide GEMMs only. ValueError naming the flag."""
    from sgl_dspark.srt.core.kernel_choice import KERNEL_FAMILIES, KernelChoice

    kernels = KernelChoice.parse(kernel_backend, overrides)
    torch_families = [f for f in KERNEL_FAMILIES if kernels.of(f) != "triton"]
    _require(
        not torch_families,
        "--enable-deterministic-inference needs the triton kernels for every family "
        f"(--kernel-backend triton, no torch overrides); torch here: {', '.join(torch_families)}",
    )
    _require(
        attention_backend == "triton",
        "--enable-deterministic-inference needs --attention-backend triton, got "
        f"{attention_backend!r}",
    )
    _require(
        fp8_activations == "off",
        "--enable-deterministic-inference needs --fp8-activations off (FP8 activations are "
        "used above decode sizes only, so a row's rounding would depend on the batch)",
    )


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def validate(a: ServerArgs) -> None:
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
    for flag, value, low in (
        ("--graceful-shutdown-timeout", a.graceful_shutdown_timeout, 0.0),
        ("--queue-timeout", a.queue_timeout, 0.0),
    ):
        _require(value >= low, f"{flag} must be >= {low:g}, got {value}")
    for flag, value in (
        ("--keep-alive-timeout", a.keep_alive_timeout),
        ("--client-timeout", a.client_timeout),
        ("--watchdog-timeout", a.watchdog_timeout),
    ):
        _require(value > 0, f"{flag} must be > 0, got {value}")
    for flag, ivalue, ilow in (
        ("--max-connections", a.max_connections, 1),
        ("--max-request-body-bytes", a.max_request_body_bytes, 1),
        ("--max-header-bytes", a.max_header_bytes, 1024),
        ("--max-queued-requests", a.max_queued_requests, 1),
    ):
        _require(ivalue >= ilow, f"{flag} must be >= {ilow}, got {ivalue}")
    _check_choice("--log-level", a.log_level, LOG_LEVEL_CHOICES)
    _check_choice("--device", a.device, DEVICE_CHOICES)
    _check_choice("--dtype", a.dtype, DTYPE_CHOICES)
    _check_choice("--kernel-backend", a.kernel_backend, KERNEL_BACKEND_CHOICES)
    _check_choice("--weight-format", a.weight_format, WEIGHT_FORMAT_CHOICES)
    _check_choice("--load-format", a.load_format, LOAD_FORMAT_CHOICES)
    _check_choice("--kv-cache-dtype", a.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
    _check_choice("--engram-table-location", a.engram_table_location, ENGRAM_TABLE_LOCATION_CHOICES)
    _check_choice("--fp8-activations", a.fp8_activations, FP8_ACTIVATION_CHOICES)
    _check_choice("--attention-backend", a.attention_backend, attention_backend_choices())
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
