"""ModelRunner: owns the model, its KV state and every device buffer; runs one ForwardBatch."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch

from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.distributed.sharding import shard_for
from sgl_dspark.srt.layers.attention import create_attention_backend
from sgl_dspark.srt.layers.engram import is_engram_table
from sgl_dspark.srt.layers.fp8_linear import resolve_fp8_paths
from sgl_dspark.srt.layers.fused_linear import fuse_after_placement
from sgl_dspark.srt.mem_cache.allocator import PagedTokenAllocator, ReqToTokenPool
from sgl_dspark.srt.model_executor.weights import (
    WEIGHT_FORMATS,
    WeightFactory,
    WeightSource,
    build_on_meta,
    keeps_fp32,
    load_report,
    materialise,
)
from sgl_dspark.srt.models.base import BaseCausalLM
from sgl_dspark.srt.models.deepseek_v4 import ModelOutput
from sgl_dspark.srt.models.registry import model_entry
from sgl_dspark.srt.server_args import ServerArgs
from sgl_dspark.srt.server_args_checks import check_engram_table_location

logger = logging.getLogger(__name__)


def _server_default(name: str) -> Any:
    return ServerArgs.__dataclass_fields__[name].default


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """What the runner needs of the server args (`from_server_args`), with their defaults;
    device, dtype, kernel backend, weight format and FP8 activations are resolved values
    (ServerArgs' "auto" on a CPU)."""

    device: str = "cpu"
    dtype: str = "float32"
    max_total_tokens: int = _server_default("max_total_tokens")
    max_running_requests: int = _server_default("max_running_requests")
    context_length: int = _server_default("context_length")
    page_size: int = _server_default("page_size")  # 0 = smallest page every compress rate divides
    max_verify_tokens: int = 16  # widest verify window a step may run
    attention_backend: str = "torch"
    kernel_backend: str = "torch"
    kernel_backend_overrides: str | None = _server_default("kernel_backend_overrides")
    mem_fraction_static: float | None = _server_default("mem_fraction_static")
    weight_format: str = "bf16"  # "native": quantised checkpoint weights stay as stored
    fp8_activations: str = "off"  # "on": W8A8 GEMMs on the FP8 weights (layers/fp8_linear.py)
    kv_cache_dtype: str = _server_default("kv_cache_dtype")
    engram_table_location: str = _server_default("engram_table_location")
    enable_deterministic_inference: bool = False  # batch-invariant kernels (KernelChoice)

    @classmethod
    def from_server_args(cls, args: ServerArgs, max_verify_tokens: int) -> RunnerConfig:
        """The runner's record of resolved server args (`ServerArgs.resolved`)."""
        fields = {f for f in cls.__dataclass_fields__ if f != "max_verify_tokens"}
        return cls(max_verify_tokens=max_verify_tokens, **{f: getattr(args, f) for f in fields})


class TapConsumer(NamedTuple):
    """Work that reads a forward's tap streams while the forward runs (DSpark writes its draft's
    context KV of every row here): `consume(batch, taps)` with `taps` layer -> [T, n, D], which it
    must not modify, once the last of `layers` has run."""

    layers: tuple[int, ...]
    consume: Callable[[ForwardBatch, dict[int, torch.Tensor]], None]


def resolve_dtype(name: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    if name not in table:
        raise ValueError(f"dtype {name!r} not supported; choose from {sorted(table)}")
    return table[name]


# --kv-cache-dtype -> the window KV's storage dtype (None: the runtime dtype).
_KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
}


def _window_kv_dtype(choice: str, fixed: str | None) -> torch.dtype | None:
    """The window KV dtype the pool is built with for `--kv-cache-dtype choice`; None where the
    pool decides (the runtime dtype, or a model whose window storage is `fixed`)."""
    if choice not in _KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {sorted(_KV_CACHE_DTYPES)}, got {choice!r}"
        )
    if fixed is not None:
        if choice not in ("auto", fixed):
            raise ValueError(
                f"--kv-cache-dtype {choice!r}: this model stores its window KV as {fixed} by "
                f"definition (use auto or {fixed})"
            )
        return None
    return _KV_CACHE_DTYPES[choice]


def default_page_size(cfg: ModelConfig) -> int:
    rates = [r for r in cfg.compress_ratios if r > 0]
    return math.lcm(1, *rates) if rates else 16


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        rc: RunnerConfig,
        weights: Iterable[tuple[str, WeightSource]] | WeightFactory | None = None,
        model: BaseCausalLM | None = None,
    ) -> None:
        """`weights`: the model's tensors by name (plain tensors or lazy sources read straight
        onto the device, `model_executor/weights.py`), or a factory of them for the meta-built
        model (random weights); the model is then built on the meta device. Without weights,
        `model` (or a zero-initialised model) is cast and moved to the device."""
        self.model_cfg = model_cfg
        self.rc = rc
        self.device = torch.device(rc.device)
        self.dtype = resolve_dtype(rc.dtype)
        page = rc.page_size or default_page_size(model_cfg)
        for i, ratio in enumerate(model_cfg.compress_ratios):
            if ratio > 0 and page % ratio:
                raise ValueError(
                    f"--page-size {page} must be a multiple of every compress rate "
                    f"(layer {i} has {ratio})"
                )
        self.page_size = page
        self.kernels = resolve_fp8_paths(
            KernelChoice.parse(
                rc.kernel_backend,
                rc.kernel_backend_overrides,
                batch_invariant=rc.enable_deterministic_inference,
            ),
            rc.fp8_activations if rc.weight_format == "native" else "off",
            model_cfg.quantization,
            self.device,
        )
        entry = model_entry(model_cfg)
        entry.check_runtime(model_cfg, self.kernels, rc.attention_backend)
        if rc.weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"weight_format must be one of {WEIGHT_FORMATS}, got {rc.weight_format!r}"
            )
        check_engram_table_location(
            rc.engram_table_location, self.device.type, self.kernels.of("engram")
        )
        host = is_engram_table if rc.engram_table_location == "host" else None
        if model is None and weights is not None:
            model = build_on_meta(lambda: entry.build_model(model_cfg, self.kernels))
            if isinstance(weights, WeightFactory):
                weights = weights.for_model(model)
            native = rc.weight_format == "native"
            self.model = materialise(
                model, weights, self.device, self.dtype, native, "model", host_resident=host
            )
        elif host is not None:
            raise ValueError(
                "--engram-table-location host places tables while loading a checkpoint; this "
                "model is given built (no checkpoint to load)"
            )
        else:
            model = model if model is not None else entry.build_model(model_cfg, self.kernels)
            self.model = cast_model(model, self.dtype).to(self.device).eval()
        fuse_after_placement(self.model)  # after placement (see fused_linear.py)
        window = _window_kv_dtype(rc.kv_cache_dtype, entry.fixed_kv_cache_dtype)
        self.window_kv_dtype = self.dtype if window is None else window
        kv_options = {} if window is None else {"window_dtype": window}
        self._kv_bytes_per_token = functools.partial(
            entry.kv_bytes_per_token, model_cfg, self.dtype, **kv_options
        )
        num_pages = max(2, self._kv_tokens() // page + 1)
        self.allocator = PagedTokenAllocator(num_pages, page)
        self.req_pool = ReqToTokenPool(
            rc.max_running_requests, rc.context_length, self.allocator, self.device
        )
        self.kv_pool = entry.build_kv_pool(
            model_cfg,
            num_pages * page,
            self.req_pool.size,
            rc.max_verify_tokens,
            self.dtype,
            self.device,
            **kv_options,
        )
        self.attn_backend = create_attention_backend(
            rc.attention_backend, self.kernels.batch_invariant
        )
        # cos/sin of every position a request can reach, built before any graph is captured.
        self.model.rope_tables(self.req_pool.max_context_len)
        # Side stream of a tap consumer forked inside a captured region (`run_model`); created
        # here because no stream may be created while a capture is under way.
        self._tap_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._tap_stream = torch.cuda.Stream(self.device)
        self._taps_pending: tuple[object, ...] | None = None
        kv_bytes = num_pages * page * self._kv_bytes_per_token()
        logger.info("KV pool: %d pages x %d tokens, %.1f MiB", num_pages, page, kv_bytes / 2**20)
        # What this device holds, by kind (weights as loaded: native or dequantised).
        self.memory_report = {**load_report(self.model), "kv": int(kv_bytes)}
        logger.info(
            "device memory on %s (%s weights; host_pinned: page-locked host tables): %s",
            self.device,
            rc.weight_format,
            ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in self.memory_report.items()),
        )

    def _kv_tokens(self) -> int:
        """KV pool size in tokens: --max-total-tokens, or on CUDA with --mem-fraction-static the
        tokens that fit in (fraction x total memory) minus what is in use after the weights."""
        frac = self.rc.mem_fraction_static
        if frac is None or self.device.type != "cuda":
            return self.rc.max_total_tokens
        free, total = torch.cuda.mem_get_info(self.device)
        budget = frac * total - (total - free)
        per_token = self._kv_bytes_per_token()
        tokens = int(budget // per_token)
        if tokens < 2 * self.page_size:
            raise RuntimeError(
                f"--mem-fraction-static {frac}: only {budget / 2**30:.2f} GiB left "
                "for the KV pool after the weights; raise the fraction"
            )
        logger.info(
            "KV pool sized from --mem-fraction-static %.2f: %d tokens (%.1f GiB)",
            frac,
            tokens,
            budget / 2**30,
        )
        return tokens

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        tap_layers: tuple[int, ...] = (),
        consumer: TapConsumer | None = None,
    ) -> ModelOutput:
        """One eager forward of `batch` (executors replay graphs instead where they have one).
        `tap_layers`: layers whose streams `ModelOutput.tap_streams` returns; `consumer` runs on
        the taps of its layers during the forward (see `run_model`)."""
        if batch.mode is ForwardMode.VERIFY:
            assert max(batch.extend_lens_cpu) <= self.rc.max_verify_tokens, (
                f"verify width {max(batch.extend_lens_cpu)} > max_verify_tokens "
                f"{self.rc.max_verify_tokens}"
            )
        if self.device.type == "cuda" and batch.mode is not ForwardMode.EXTEND:
            # Decode/verify gathers span the whole context capacity on CUDA, as in the captured
            # graphs, so an eager step (a batch larger than the graphs, --disable-cuda-graph)
            # computes the same shapes, hence the same bits, as a replay.
            batch = dataclasses.replace(batch, max_seq_len=self.req_pool.max_context_len)
        out = self.run_model(batch, tap_layers, consumer)
        self.join_taps()
        return out

    def run_model(
        self,
        batch: ForwardBatch,
        tap_layers: tuple[int, ...] = (),
        consumer: TapConsumer | None = None,
    ) -> ModelOutput:
        """The model's forward with `consumer` on its taps: the one place both happen, eagerly
        and inside every captured graph. Inside a capture the consumer is forked onto a side
        stream as soon as its taps exist, so it overlaps the rest of the forward; the captured
        region must end with `join_taps`."""
        if consumer is None:
            return self.model(batch, self.kv_pool, self.attn_backend, tap_layers)
        tap_layers = tuple(sorted({*tap_layers, *consumer.layers}))
        assert self._taps_pending is None, "a captured region did not call join_taps"
        fork = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

        def on_taps(taps: dict[int, torch.Tensor]) -> None:
            if not fork:
                consumer.consume(batch, taps)
                return
            side = self._tap_stream
            assert side is not None
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                consumer.consume(batch, taps)
            # The consumer's inputs stay referenced until the join, so the capture's allocator
            # cannot hand their memory to later work of the main stream while the side reads.
            self._taps_pending = (batch, taps)

        return self.model(batch, self.kv_pool, self.attn_backend, tap_layers, on_taps=on_taps)

    def join_taps(self) -> None:
        """End of a captured region: the main stream waits for a forked tap consumer."""
        if self._taps_pending is not None:
            assert self._tap_stream is not None
            torch.cuda.current_stream(self.device).wait_stream(self._tap_stream)
            self._taps_pending = None


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def cast_model(model: ModuleT, dtype: torch.dtype) -> ModuleT:
    for name, p in model.named_parameters():
        target = torch.float32 if keeps_fp32(name) else dtype
        if p.dtype != target:
            p.data = p.data.to(target)
    return model


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model; every parameter and buffer must be provided once
    with the right shape, and no unknown name may appear (errors name the tensor)."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expected = {k for k in model.state_dict()}
    seen: set[str] = set()
    for name, tensor in weights:
        if name not in expected:
            raise ValueError(f"checkpoint tensor {name!r} does not belong to the model")
        target = params[name]
        tensor = shard_for(target, tensor)  # this rank's slice of a parallel parameter
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        if name in seen:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]}{more}")
