"""End-to-end engine benchmark, side by side in one process on one device:

1. HF transformers `DeepseekV4ForCausalLM.generate` (greedy, random weights seeded 0);
2. ours through `Engine.generate` on the same weights, eager (`--disable-cuda-graph`);
3. ours with CUDA graphs;
4. DSpark with simulated acceptance vs no speculation (CUDA graphs), full width and static widths;

at the given batch sizes with random prompts of `--input-len` tokens and `--output-len` new
tokens (ignore_eos). DeepSeek-V4.1 configs (`v41_*`) have no HF baseline (transformers' wheel has
no V4.1) and no checkpoint on disk: every engine gets a seeded random model built on the device
(`use_random_v41_model`), and the draft has `--draft-experts` routed experts (default: the
config's). Also reports the decode-step time against its memory floor: the bytes of
weights (experts: the expected number of distinct experts a batch routes to) and KV a step reads,
over the device's measured copy bandwidth.

    python benchmark/bench_engine.py --config mid_910m --batch-sizes 1,8,32 --out-dir $OUT

Prints one JSON line per measurement and writes `engine.json` (+ `engine.md`) to `--out-dir`.
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.srt.configs.deepseek_v41 import LayerRole  # noqa: E402
from sgl_dspark.srt.configs.model_config import CSA, HCA, ModelConfig  # noqa: E402
from sgl_dspark.srt.core.kernel_choice import KernelChoice  # noqa: E402
from sgl_dspark.srt.model_loader.export import save_released_checkpoint  # noqa: E402
from sgl_dspark.srt.models.bench_configs import BENCH_CONFIGS  # noqa: E402
from sgl_dspark.tools.init_dspark_draft import init_dspark_draft  # noqa: E402


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
        gc.collect()  # the previous engine's model: the fp32 build needs twice its bytes
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return real_runner(model_cfg, rc, model=random_v41_model(cfg, device, kernels))

    engine_module.resolve_model = resolve  # type: ignore[assignment]
    engine_module.ModelRunner = runner  # type: ignore[assignment,misc]


def time_engine(
    engine: Engine, prompts: list[list[int]], new_tokens: int, device: str
) -> tuple[float, float, list]:
    """(wall s for new_tokens, median wall s of three 1-token calls (prefill + first token),
    output ids)."""

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
    return tn, t1, ids


def profile_steps(engine: Engine, prompts: list[list[int]], path: Path, steps: int = 8) -> None:
    """torch.profiler table (CPU and CUDA time per op, kernel counts) over `steps` decode steps
    after prefill."""
    from torch.profiler import ProfilerActivity, profile

    sched = engine.scheduler
    reqs = [
        engine._make_req(
            p, {"max_new_tokens": 10 * steps, "temperature": 0.0, "ignore_eos": True}, False
        )
        for p in prompts
    ]
    for r in reqs:
        sched.add(r)
    while not all(r.prefill_done and r.output_ids for r in reqs):
        sched.step()
    for _ in range(3):
        sched.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            sched.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45)
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    path.write_text(
        f"{steps} steps, {wall * 1e3:.2f} ms/step wall (under the profiler)\n\n"
        f"{table}\n\n{cpu}\n\n{kernel_list(prof, steps)}\n"
    )
    while sched.has_work:
        sched.step()


def kernel_list(prof, steps: int) -> str:
    """Every device kernel of the profiled steps: launches and microseconds per step, by name
    (the key_averages table truncates and mixes CPU ops in)."""
    from torch.autograd import DeviceType

    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            a = agg.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.device_time_total
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    n = sum(v[0] for v in agg.values()) / steps
    t = sum(v[1] for v in agg.values()) / steps
    lines = [
        f"device kernels per step: {n:.1f} launches, {t:.1f} us",
        "",
        "| launches/step | us/step | kernel |",
        "|---|---|---|",
    ]
    lines += [f"| {c / steps:.2f} | {us / steps:.1f} | {name[:140]} |" for name, (c, us) in rows]
    return "\n".join(lines)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    if not device.startswith("cuda"):
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 20 / (time.perf_counter() - t0)


def _routed_bytes(p: torch.Tensor, experts: int, top_k: int, tokens: int) -> float:
    """Bytes of a routed-expert tensor that `tokens` tokens read: the expected number of
    distinct experts under uniform routing."""
    distinct = experts * (1 - (1 - top_k / experts) ** tokens)
    return p.numel() * p.element_size() * distinct / experts


def weight_bytes(model: torch.nn.Module, experts: int, top_k: int, tokens: int) -> float:
    """Weight bytes of one forward of `tokens` tokens: every non-expert weight, embedding and
    Engram table rows only, the expected distinct routed experts."""
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "experts." in name and "shared" not in name:
            nbytes = _routed_bytes(p, experts, top_k, tokens)
        elif name.endswith("embed_tokens.weight"):
            nbytes = tokens * p.shape[1] * p.element_size()
        elif name.endswith("engram.embed.weight"):
            nbytes = 0.0  # counted with the KV (rows per token)
        total += nbytes
    return total


def v41_kv_bytes(cfg: ModelConfig, context: int) -> float:
    """Cache bytes one V4.1 request's step reads: per layer its FP8 window rows, per compressed
    layer the packed FP4 latents of its top-k, per index source every packed index key, and the
    Engram rows of the token."""
    from sgl_dspark.srt.mem_cache.v41_pool import QuantizedRows

    v41 = cfg.v41
    assert v41 is not None
    act = torch.bfloat16
    window = QuantizedRows.bytes_per_row(cfg.head_dim, "fp8_window", act)
    latent = QuantizedRows.bytes_per_row(cfg.head_dim, "fp4_latent", act)
    key = QuantizedRows.bytes_per_row(cfg.index_head_dim, "fp4_index", act)
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        total += min(context, cfg.sliding_window) * window
        m = v41.compress_ratios[i]
        if m > 0:
            total += min(context // m, cfg.index_topk) * latent
        if v41.role(i) in (LayerRole.FULL, LayerRole.REINDEX):
            total += (context // m) * key
    if v41.engram is not None:
        rows = len(v41.engram.layer_ids) * v41.engram.ids_per_token
        total += rows * v41.engram.head_dim * 2
    return total


def step_bytes(engine: Engine, bs: int, context: int) -> float:
    """Bytes one step of bs requests reads. Plain decode: the target's weights for bs tokens
    (`weight_bytes`) and the attention KV (window + compressed entries + indexer keys) of each
    request. DSpark: the target verifies bs x (gamma + 1) tokens and the draft reads its own
    weights for bs x gamma tokens (its context KV is small and left out)."""
    cfg: ModelConfig = engine.runner.model_cfg
    spec = engine.spec
    width = 1 if spec is None else spec.worker.gamma + 1
    total = weight_bytes(
        engine.runner.model, cfg.n_routed_experts, cfg.num_experts_per_tok, bs * width
    )
    if spec is not None:
        d = spec.worker.draft.cfg
        total += weight_bytes(
            spec.worker.draft,
            d.n_routed_experts,
            d.num_experts_per_tok,
            bs * spec.worker.gamma,
        )
    if cfg.v41 is not None:
        return total + bs * v41_kv_bytes(cfg, context)
    el = torch.finfo(engine.runner.dtype).bits // 8
    for i, lt in enumerate(cfg.layer_types):
        kv = min(context, cfg.sliding_window) * cfg.head_dim
        if lt in (CSA, HCA):
            m = cfg.compress_ratio(i)
            kv += (min(context // m, cfg.index_topk) if lt == CSA else context // m) * cfg.head_dim
            if lt == CSA:
                kv += (context // m) * cfg.index_head_dim
        total += bs * kv * el
    return total


def main() -> None:
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
        "--static-cases",
        default="1:4,1:5,32:2,32:3",
        help="DSpark static-width runs as bs:width (comma list)",
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
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also write torch.profiler tables of "
        "bs 1 decode steps (eager, graphs, DSpark full and bs 1 static cases) to "
        "--out-dir",
    )
    p.add_argument("--out-dir", default=".")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # capture logs
    dev = a.device
    raw = dict(BENCH_CONFIGS[a.config])
    cfg = ModelConfig.from_hf_dict(raw)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    hf_sizes = [int(x) for x in (a.hf_batch_sizes or a.batch_sizes).split(",") if x]
    rows: list[dict] = []

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)

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
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    ctx = a.input_len + a.output_len + 2 * (a.gamma + 1) + 64
    base = dict(
        model_path=work,
        device=dev,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        kernel_backend="triton" if dev.startswith("cuda") else "torch",
        attention_backend=a.attention_backend,
        context_length=ctx,
        max_running_requests=max(sizes),
        max_total_tokens=max(sizes) * ctx + 4096,
        chunked_prefill_size=4096,
    )
    bw = copy_bandwidth(dev)

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

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profiling = a.profile and dev.startswith("cuda")
    modes = [("ours_eager", {"disable_cuda_graph": True}), ("ours_cuda_graph", {})]
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
    for system, kw in modes[1 if a.skip_eager else 0 :]:
        engine = Engine(**{**base, **kw})
        for bs in sizes:
            measure(system, bs, engine)
        if profiling:
            profile_steps(
                engine,
                prompts_for(1, a.input_len, cfg.vocab_size),
                out / f"profile_{system}_bs1.txt",
            )
        engine.shutdown()
        del engine
        gc.collect()

    spec = dict(
        speculative_algorithm="DSpark",
        speculative_dspark_block_size=a.gamma,
        speculative_dspark_simulate_accept_len=a.accept_len,
    )
    engine = Engine(**base, **spec)
    for bs in sizes:
        measure("dspark_full", bs, engine, accept_len=a.accept_len)
    if profiling:
        profile_steps(
            engine, prompts_for(1, a.input_len, cfg.vocab_size), out / "profile_dspark_full_bs1.txt"
        )
    engine.shutdown()
    del engine
    gc.collect()
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
        engine = Engine(
            **base,
            **spec,
            **draft,
            speculative_dspark_verify_policy="static",
            speculative_dspark_width_table_path=str(table),
        )
        measure(f"dspark_static_w{w}{suffix}", bs, engine, accept_len=a.accept_len)
        if profiling and bs == 1:
            profile_steps(
                engine,
                prompts_for(1, a.input_len, cfg.vocab_size),
                out / f"profile_dspark_static_w{w}_bs1.txt",
            )
        engine.shutdown()
        del engine
        gc.collect()

    meta = {
        "config": a.config,
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev,
        "torch": torch.__version__,
        "copy_bandwidth_Bps": bw,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "gamma": a.gamma,
        "draft_layers": a.draft_layers,
        "draft_experts": a.draft_experts,
        "alt_draft_top_k": a.alt_draft_top_k,
        "bs1_block_size": a.bs1_block_size,
    }
    (out / "engine.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    (out / "engine.md").write_text(render(meta, rows))
    print(render(meta, rows))


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (greedy runs agree until the first flip)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def render(meta: dict, rows: list[dict]) -> str:
    by = {(r["system"], r["bs"]): r for r in rows}
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
