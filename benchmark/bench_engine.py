"""End-to-end engine benchmark on one device:

1. HF transformers `DeepseekV4ForCausalLM.generate` (greedy, random weights seeded 0);
2. ours through `Engine.generate` on the same weights, eager (`--disable-cuda-graph`);
3. ours with CUDA graphs;
4. DSpark with simulated acceptance vs no speculation (CUDA graphs): full width, static widths and
   the confidence policy;

at the given batch sizes with random prompts of `--input-len` tokens and `--output-len` new
tokens (ignore_eos). DeepSeek-V4.1 configs (`v41_*`) have no HF baseline (transformers' wheel has
no V4.1) and no checkpoint on disk: every engine gets a seeded random model built on the device
(`use_random_v41_model`), and the draft has `--draft-experts` routed experts (default: the
config's). Also reports the decode-step time against its memory floor: the bytes of
weights (experts: the expected number of distinct experts a batch routes to) and KV a step reads,
over the device's measured copy bandwidth.

    python benchmark/bench_engine.py --config mid_910m --batch-sizes 1,8,32 --out-dir $OUT

Prints one JSON line per measurement and rewrites `engine.json` (+ `engine.md`) in `--out-dir`
after each one. `--systems` picks the engine configurations a process runs; a large model runs
one per process, the processes adding their rows to one table (`--append`):

    for s in graph dspark_full dspark_confidence; do
      python benchmark/bench_engine.py --config v41_flash_slice --systems $s --append \
        --sps-table $OUT/sps.json --out-dir $OUT; done
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_dspark.srt.core.kernel_choice import KernelChoice  # noqa: E402
from sgl_dspark.srt.model_loader.export import save_released_checkpoint  # noqa: E402
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS  # noqa: E402
from sgl_dspark.srt.speculative.dspark.sps import DiagonalSpsTable, save_sps_table  # noqa: E402
from sgl_dspark.tools.dspark_sps_profile import profile_batch  # noqa: E402
from sgl_dspark.tools.init_dspark_draft import init_dspark_draft  # noqa: E402

from benchmark.step_floor import copy_bandwidth, step_bytes  # noqa: E402
from benchmark.step_profile import profile_steps  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts_for(bs: int, input_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + bs)
    return [torch.randint(10, vocab, (input_len,), generator=g).tolist() for _ in range(bs)]


# ---- HF transformers -----------------------------------------------------------------------
def build_hf(raw: dict, device: str):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**raw))
    return model.to(torch.bfloat16).eval()


def time_hf(model, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, list]:
    ids = torch.tensor(prompts, device=device)
    kw = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": 0,
    }
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(device)
    return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()


# ---- ours ----------------------------------------------------------------------------------
def write_checkpoints(
    hf, cfg: ModelConfig, work: str, draft_layers: int, gamma: int, **draft_kw
) -> None:
    """The HF model's weights as our released checkpoint in `work`, and the benchmarks' seeded
    random DSpark draft (`draft_layers` stages, block `gamma`) in `work/dspark`."""
    save_released_checkpoint({k: v.detach().cpu() for k, v in hf.state_dict().items()}, cfg, work)
    init_dspark_draft(
        work,
        str(Path(work) / "dspark"),
        num_layers=draft_layers,
        block_size=gamma,
        seed=1,
        **draft_kw,
    )


def random_v41_model(cfg: ModelConfig, device: str, kernels: KernelChoice, seed: int = 0):
    """Seeded random DeepSeek-V4.1 weights generated on the device (as
    `bench_one_batch.random_model`): std 0.02 matrices and tables, unit norms, mHC scales and
    Engram q/k weights, zero biases and sinks, an Engram token map spread over the compressed
    vocabulary."""
    from sgl_dspark.srt.models.deepseek_v41 import DeepseekV41ForCausalLM

    with torch.device(device):
        model = DeepseekV41ForCausalLM(cfg, kernels)
    model = model.to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    engram = cfg.v41.engram if cfg.v41 is not None else None
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name == "model.engram_token_map":
                assert engram is not None
                ids = torch.arange(cfg.vocab_size, device=device)
                t.copy_(ids.remainder(engram.compressed_vocab_size))
            elif not t.is_floating_point() or name.startswith("model.inv_freq"):
                continue
            elif name.endswith(("norm.weight", ".scale", "q_weight", "k_weight")) or (
                "layernorm" in name
            ):
                t.fill_(1.0)
            elif name.endswith(("sinks", ".base", "e_score_correction_bias")):
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=g)
    return model


def use_random_v41_model(cfg: ModelConfig, work: str, device: str) -> None:
    """Every later `Engine(model_path=work)` of this process runs a fresh `random_v41_model`
    built with the engine's own kernel choice, instead of loading a checkpoint (the V4.1-Flash
    slice holds 21B parameters: writing and reading them would dominate the benchmark). The
    directory holds only config.json (the draft tool reads it)."""
    from sgl_dspark.srt.entrypoints import engine as engine_module

    real_resolve, real_runner = engine_module.resolve_model, engine_module.ModelRunner

    def resolve(path: str, dtype: torch.dtype, seed: int = 0, load_format: str = "auto"):
        if path == work:
            return cfg, None
        return real_resolve(path, dtype, seed=seed, load_format=load_format)

    def runner(model_cfg: ModelConfig, rc, weights=None):
        if model_cfg is not cfg:
            return real_runner(model_cfg, rc, weights=weights)
        kernels = KernelChoice.parse(rc.kernel_backend, rc.kernel_backend_overrides)
        # The previous engine's model: the fp32 build needs twice its bytes.
        release_device_memory(device)
        return real_runner(model_cfg, rc, model=random_v41_model(cfg, device, kernels))

    engine_module.resolve_model = resolve  # type: ignore[assignment]
    engine_module.ModelRunner = runner  # type: ignore[assignment,misc]


def time_engine(
    engine: Engine, prompts: list[list[int]], new_tokens: int, device: str, runs: int = 1
) -> tuple[float, float, list]:
    """(wall s for new_tokens, median wall s of three 1-token calls (prefill + first token),
    output ids). With `runs` > 1 the new_tokens call is timed that many times and the median
    wall is returned (and the first run's ids), so that one run disturbed by something
    outside the engine (a clock change, another process) does not move an A/B round."""

    def run(n: int) -> tuple[float, list]:
        params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
        sync(device)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        sync(device)
        return time.perf_counter() - t0, [o["output_ids"] for o in outs]

    run(min(8, new_tokens))  # warm-up (Triton compilation, allocator)
    t1 = statistics.median(run(1)[0] for _ in range(3))  # one sample is too noisy
    tn, ids = run(new_tokens)
    walls = [tn] + [run(new_tokens)[0] for _ in range(runs - 1)]
    return statistics.median(walls), t1, ids


def batch_capacity(device: str, sizes: list[int], context: int) -> dict:
    """Engine args that admit every batch of `sizes` requests of up to `context` tokens and, on
    a GPU, replay each from a CUDA graph (the engine's default graph limit stops at 32
    requests, past which a step would run eagerly and time the host's launches instead)."""
    kw = dict(
        max_running_requests=max(sizes),
        max_total_tokens=max(sizes) * context + 4096,
        chunked_prefill_size=4096,
    )
    if device.startswith("cuda"):
        kw["cuda_graph_max_bs"] = max(sizes)
    return kw


def release_device_memory(device: str) -> None:
    """Collect what the last engine left unreferenced and hand the allocator's cached blocks
    back to the device, before the next load."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_or_error_row(
    system: str,
    open_engine: Callable[[], Engine],
    body: Callable[[Engine], None],
    emit: Callable[[dict], None],
    device: str,
    extra: dict,
) -> None:
    """One engine configuration of a table: `body(open_engine())`. A failure, in the load or
    the body, becomes the row `{"system": system, "error": ..., **extra}` (traceback on stderr)
    so the next configuration still runs; either way the engine is shut down and its memory
    released."""
    engine = None
    try:
        engine = open_engine()
        body(engine)
    except Exception as exc:  # noqa: BLE001 - an error row per engine, the rest still runs
        traceback.print_exc()
        emit({"system": system, "error": f"{type(exc).__name__}: {exc}"[:400], **extra})
    finally:
        if engine is not None:
            engine.shutdown()
        del engine
        release_device_memory(device)


# Engine configurations a run can choose (`--systems`); each is one engine built in turn.
SYSTEMS = ("eager", "graph", "dspark_full", "dspark_static", "dspark_confidence")
SPS_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def profile_sps(engine: Engine, path: Path) -> None:
    """The diagonal SPS table of this engine's full-width DSpark steps (the measurement of
    `sgl_dspark.tools.dspark_sps_profile`: verify tokens bs * (gamma + 1) -> steps per second;
    the full width verifies the same tokens whatever the acceptance), for batch sizes up to the
    engine's limit."""
    gamma = engine.spec.worker.gamma
    limit = engine.args.max_running_requests
    tokens, sps = [], []
    for bs in (b for b in SPS_BATCH_SIZES if b <= limit):
        times = profile_batch(engine, bs, warmup=4, steps=12, tokens_per_step=gamma + 1)
        tokens.append(bs * (gamma + 1))
        sps.append(1.0 / statistics.median(times))
    save_sps_table(DiagonalSpsTable(tuple(tokens), tuple(sps), max(tokens)), path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="mid_910m", choices=sorted(BENCH_CONFIGS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--hf-batch-sizes", default=None, help="default: --batch-sizes")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--draft-layers", type=int, default=3)
    p.add_argument(
        "--draft-experts",
        type=int,
        default=None,
        help="routed experts of the random draft (dspark_n_routed_experts; default: the target's)",
    )
    p.add_argument(
        "--draft-top-k",
        type=int,
        default=None,
        help="experts per token of the random draft (default: the target's)",
    )
    p.add_argument("--accept-len", type=float, default=3.2)
    p.add_argument(
        "--systems",
        default="eager,graph,dspark_full,dspark_static",
        help="engine configurations this process runs, in this order (comma list of "
        f"{', '.join(SYSTEMS)}). graph includes the extra-backend / no-overlap / eager-prefill "
        "/ no-PDL rows; dspark_static the --static-cases and --static-widths engines; "
        "dspark_confidence one engine per --confidence-modes entry, reading --sps-table. Run "
        "one configuration per process (several invocations with --append into one --out-dir) "
        "so that no engine's CUDA graph pools hold memory the next one needs.",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="add this run's rows to --out-dir's engine.json (same --config) instead of "
        "starting a new table",
    )
    p.add_argument(
        "--static-cases",
        default="1:4,1:5,32:2,32:3",
        help="DSpark static-width runs as bs:width (comma list), one engine per case",
    )
    p.add_argument(
        "--static-widths",
        default="",
        help="one more static engine with this width per batch size (bs:width comma list, "
        "the largest bs key <= the batch applies), measured at every batch size",
    )
    p.add_argument(
        "--confidence-modes",
        default="async",
        help="dspark_confidence: the confidence policy's modes to run (comma list: sync, async)",
    )
    p.add_argument(
        "--sps-table",
        default=None,
        help="SPS table path: dspark_full profiles its steps into it, dspark_confidence reads "
        "it (a run of dspark_confidence alone needs one written earlier)",
    )
    p.add_argument(
        "--engine-args", default="{}", help="JSON of extra Engine arguments for every engine"
    )
    p.add_argument(
        "--alt-draft-top-k",
        type=int,
        default=None,
        help="repeat the static cases with a second draft routing this many experts "
        "per token (dspark_num_experts_per_tok; e.g. 3 against the target's top-6)",
    )
    p.add_argument(
        "--bs1-block-size",
        type=int,
        default=None,
        help="repeat the bs 1 static cases with --speculative-dspark-bs1-block-size "
        "set to this (a static width w verifies only w - 1 drafts, so a bs 1 "
        "runtime may draft fewer rows than the checkpoint's block)",
    )
    p.add_argument("--attention-backend", default="torch")
    p.add_argument(
        "--extra-attention-backends",
        default="",
        help="also time CUDA graphs with these attention backends (comma list)",
    )
    p.add_argument(
        "--no-overlap-row",
        action="store_true",
        help="also time CUDA graphs with --disable-overlap-schedule",
    )
    p.add_argument(
        "--no-pdl-row",
        action="store_true",
        help="also time graphs with --disable-programmatic-launch (A/B)",
    )
    p.add_argument(
        "--eager-prefill-row",
        action="store_true",
        help="also time graphs with --cuda-graph-max-prefill-tokens 0 (A/B)",
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-eager", action="store_true", help="leave eager out of --systems")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also write torch.profiler tables of "
        "bs 1 decode steps (eager, graphs, DSpark full and bs 1 static cases) to "
        "--out-dir",
    )
    p.add_argument("--out-dir", default=".")
    a = p.parse_args(argv)
    a.systems = [s for s in a.systems.split(",") if s]
    unknown = sorted(set(a.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if a.skip_eager:
        a.systems = [s for s in a.systems if s != "eager"]
    if "dspark_confidence" in a.systems and a.sps_table is None:
        p.error("--systems dspark_confidence needs --sps-table (dspark_full writes it)")
    return a


def main() -> None:
    a = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # capture logs
    dev = a.device
    raw = dict(BENCH_CONFIGS[a.config])
    cfg = ModelConfig.from_hf_dict(raw)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    hf_sizes = [int(x) for x in (a.hf_batch_sizes or a.batch_sizes).split(",") if x]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if a.append and (out / "engine.json").is_file():
        earlier = json.loads((out / "engine.json").read_text())
        if earlier["meta"]["config"] != a.config:
            raise SystemExit(
                f"--append: {out / 'engine.json'} holds config {earlier['meta']['config']!r}, "
                f"not {a.config!r}"
            )
        rows = earlier["rows"]
    meta = {
        "config": a.config,
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev,
        "torch": torch.__version__,
        "copy_bandwidth_Bps": copy_bandwidth(dev),
        "input_len": a.input_len,
        "output_len": a.output_len,
        "gamma": a.gamma,
        "draft_layers": a.draft_layers,
        "draft_experts": a.draft_experts,
        "alt_draft_top_k": a.alt_draft_top_k,
        "bs1_block_size": a.bs1_block_size,
    }
    failures = 0

    def emit(row: dict) -> None:
        """Print a row and rewrite engine.json / engine.md (a run cut short keeps its rows)."""
        nonlocal failures
        failures += "error" in row
        print(json.dumps(row), flush=True)
        rows.append(row)
        (out / "engine.json").write_text(json.dumps({"meta": meta, "rows": rows}))
        (out / "engine.md").write_text(render(meta, rows))

    work = tempfile.mkdtemp(prefix="bench_engine_")
    v41 = cfg.v41 is not None
    hf = None if v41 else build_hf(raw, dev)
    for bs in [] if a.skip_hf or v41 else hf_sizes:
        wall, ids = time_hf(hf, prompts_for(bs, a.input_len, cfg.vocab_size), a.output_len, dev)
        emit(
            {
                "system": "hf_generate",
                "bs": bs,
                "wall_s": wall,
                "tok_s_user": a.output_len / wall,
                "tok_s_total": bs * a.output_len / wall,
                "ids": ids,
            }
        )
    draft_kw = {"n_routed_experts": a.draft_experts, "num_experts_per_tok": a.draft_top_k}
    if v41:
        (Path(work) / "config.json").write_text(json.dumps(raw))
        use_random_v41_model(cfg, work, dev)
        init_dspark_draft(
            work,
            str(Path(work) / "dspark"),
            num_layers=a.draft_layers,
            block_size=a.gamma,
            seed=1,
            **draft_kw,
        )
    else:
        write_checkpoints(hf, cfg, work, a.draft_layers, a.gamma, **draft_kw)
    del hf
    release_device_memory(dev)
    ctx = a.input_len + a.output_len + 2 * (a.gamma + 1) + 64
    base = dict(
        model_path=work,
        device=dev,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        kernel_backend="triton" if dev.startswith("cuda") else "torch",
        attention_backend=a.attention_backend,
        context_length=ctx,
        **batch_capacity(dev, sizes, ctx),
        **json.loads(a.engine_args),
    )
    bw = meta["copy_bandwidth_Bps"]
    profiling = a.profile and dev.startswith("cuda")

    def measure(system: str, bs: int, engine: Engine, **extra) -> None:
        wall, t1, ids = time_engine(
            engine, prompts_for(bs, a.input_len, cfg.vocab_size), a.output_len, dev
        )
        step_ms = (wall - t1) / max(a.output_len - 1, 1) * 1e3
        floor_bytes = step_bytes(engine, bs, a.input_len + a.output_len // 2)
        floor_ms = floor_bytes / bw * 1e3
        emit(
            {
                "system": system,
                "bs": bs,
                "wall_s": wall,
                "prefill_s": t1,
                "tok_s_user": a.output_len / wall,
                "tok_s_total": bs * a.output_len / wall,
                "decode_ms_per_token": step_ms,
                "floor_ms_per_step": floor_ms,
                "floor_bytes_per_step": floor_bytes,
                **extra,
                "ids": ids,
            }
        )

    def run_system(
        system: str,
        kw: dict,
        batch_sizes: list[int],
        profile_name: str | None = None,
        after=None,
        **extra,
    ) -> None:
        """One engine: every batch size, the optional bs 1 profile, then `after(engine)`; a
        failure is an error row (`run_or_error_row`)."""

        def body(engine: Engine) -> None:
            for bs in batch_sizes:
                measure(system, bs, engine, **extra)
            if profiling and profile_name is not None:
                profile_steps(
                    engine,
                    prompts_for(1, a.input_len, cfg.vocab_size),
                    out / f"profile_{profile_name}_bs1.txt",
                )
            if after is not None:
                after(engine)

        run_or_error_row(system, lambda: Engine(**{**base, **kw}), body, emit, dev, extra)

    modes = []
    if "eager" in a.systems:
        modes.append(("ours_eager", {"disable_cuda_graph": True}))
    if "graph" in a.systems:
        modes.append(("ours_cuda_graph", {}))
        modes += [
            (f"ours_cuda_graph_attn_{b}", {"attention_backend": b})
            for b in a.extra_attention_backends.split(",")
            if b
        ]
        if a.no_overlap_row:
            modes.append(("ours_cuda_graph_no_overlap", {"disable_overlap_schedule": True}))
        if a.eager_prefill_row:
            modes.append(("ours_cuda_graph_eager_prefill", {"cuda_graph_max_prefill_tokens": 0}))
        if a.no_pdl_row:
            modes.append(("ours_cuda_graph_no_pdl", {"disable_programmatic_launch": True}))
    for system, kw in modes:
        run_system(system, kw, sizes, profile_name=system)

    spec = dict(
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=a.gamma,
        speculative_dspark_simulate_accept_len=a.accept_len,
    )
    sps_path = Path(a.sps_table) if a.sps_table else None
    if "dspark_full" in a.systems:
        run_system(
            "dspark_full",
            spec,
            sizes,
            profile_name="dspark_full",
            after=None if sps_path is None else lambda engine: profile_sps(engine, sps_path),
            accept_len=a.accept_len,
        )
    if "dspark_static" in a.systems:
        run_static(a, work, spec, sizes, run_system)
    if "dspark_confidence" in a.systems:
        assert sps_path is not None
        for mode in (m for m in a.confidence_modes.split(",") if m):
            system = f"dspark_confidence_{mode}"
            if not sps_path.is_file():
                emit(
                    {
                        "system": system,
                        "error": f"no SPS table at {sps_path} (dspark_full "
                        "with --sps-table writes it)",
                        "accept_len": a.accept_len,
                    }
                )
                continue
            confidence = {
                **spec,
                "speculative_dspark_verify_policy": "confidence",
                "speculative_dspark_confidence_mode": mode,
                "speculative_dspark_sps_table_path": str(sps_path),
            }
            run_system(system, confidence, sizes, accept_len=a.accept_len)

    print(render(meta, rows))
    if failures:
        raise SystemExit(f"{failures} engine configuration(s) failed (error rows in the table)")


def run_static(a: argparse.Namespace, work: str, spec: dict, sizes: list[int], run_system) -> None:
    """The static verify-width engines: one per --static-cases entry (a width for one batch
    size; with --alt-draft-top-k / --bs1-block-size also with that draft or bs 1 block), and one
    with the --static-widths table measured at every batch size."""
    drafts = [("", {})]
    if a.alt_draft_top_k is not None:
        alt = str(Path(work) / f"dspark_top{a.alt_draft_top_k}")
        init_dspark_draft(
            work,
            alt,
            num_layers=a.draft_layers,
            block_size=a.gamma,
            seed=1,
            num_experts_per_tok=a.alt_draft_top_k,
        )
        drafts.append((f"_draft_top{a.alt_draft_top_k}", {"speculative_draft_model_path": alt}))
    if a.bs1_block_size is not None:
        drafts.append(
            (
                f"_bs1_block{a.bs1_block_size}",
                {"speculative_dspark_bs1_block_size": a.bs1_block_size},
            )
        )
    for (suffix, draft), case in itertools.product(
        drafts, [c for c in a.static_cases.split(",") if c]
    ):
        bs, w = (int(x) for x in case.split(":"))
        if "speculative_dspark_bs1_block_size" in draft and bs != 1:
            continue  # the bs 1 runtime's block size changes nothing at other batch sizes
        table = Path(work) / f"widths_{w}.json"
        table.write_text(json.dumps({"widths_by_batch_size": {"1": w}}))
        static = {
            **spec,
            **draft,
            "speculative_dspark_verify_policy": "static",
            "speculative_dspark_width_table_path": str(table),
        }
        run_system(
            f"dspark_static_w{w}{suffix}",
            static,
            [bs],
            profile_name=f"dspark_static_w{w}" if bs == 1 else None,
            accept_len=a.accept_len,
        )
    if a.static_widths:
        widths = dict(case.split(":") for case in a.static_widths.split(",") if case)
        table = Path(work) / "widths_by_bs.json"
        table.write_text(json.dumps({"widths_by_batch_size": widths}))
        static = {
            **spec,
            "speculative_dspark_verify_policy": "static",
            "speculative_dspark_width_table_path": str(table),
        }
        run_system(f"dspark_static_{a.static_widths}", static, sizes, accept_len=a.accept_len)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (greedy runs agree until the first flip)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def render(meta: dict, rows: list[dict]) -> str:
    by = {(r["system"], r["bs"]): r for r in rows if "error" not in r}
    lines = [
        f"config {meta['config']}, {meta['device']}, torch {meta['torch']}, prompts "
        f"{meta['input_len']} + {meta['output_len']} new tokens, copy bandwidth "
        f"{meta['copy_bandwidth_Bps'] / 1e12:.2f} TB/s",
        "",
        "| system | bs | tok/s/user | tok/s total | x HF | decode ms/token | floor ms/step "
        "| same tokens as eager | mean prefix equal to HF |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r.get('bs', '-')} | error: {r['error']} |" + " |" * 6)
            continue
        hf = by.get(("hf_generate", r["bs"]))
        eager = by.get(("ours_eager", r["bs"]))
        ratio = f"{r['tok_s_total'] / hf['tok_s_total']:.1f}" if hf else "-"
        same = "-"
        if eager is not None and r["system"] == "ours_cuda_graph":
            same = f"{sum(x == y for x, y in zip(r['ids'], eager['ids']))}/{len(eager['ids'])}"
        prefix = "-"
        if hf is not None and r["system"].startswith("ours"):
            prefix = (
                f"{sum(common_prefix(x, y) for x, y in zip(r['ids'], hf['ids'])) / r['bs']:.1f}"
            )
        lines.append(
            f"| {r['system']} | {r['bs']} | {r['tok_s_user']:.1f} | "
            f"{r['tok_s_total']:.1f} | {ratio} | "
            f"{r.get('decode_ms_per_token', float('nan')):.2f} | "
            f"{r.get('floor_ms_per_step', float('nan')):.3f} | {same} | {prefix} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
