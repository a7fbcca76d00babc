"""Weights kept as stored (FP8 / MXFP4) at real sizes: model sizes, the bf16-vs-native A/B, and
the decode step of a benchmark model against its byte floor, with and without DSpark.

    # bytes of a model in bf16 and as stored, by kind (meta build: no memory, any machine)
    python benchmark/bench_native.py sizes --configs dsv41_flash_rank,dsv4_flash_rank --out sizes.md
    # the same random model loaded --weight-format bf16 and native (it must fit in bf16)
    python benchmark/bench_native.py ab --config dsv4_flash_slice --out-dir $OUT
    # one model natively: plain decode (CUDA graphs), DSpark with simulated acceptance at the
    # static widths and with the online width policy
    python benchmark/bench_native.py decode --config dsv41_flash_rank --dspark --out-dir $OUT
    # the same, one engine per process (a real-size model's graph pools and load dominate):
    for s in plain dspark_full dspark_static dspark_online; do
      python benchmark/bench_native.py decode --config dsv41_flash_rank --systems $s --append \
        --out-dir $OUT; done

Each run rewrites its table (`native_<mode>_<config>.json` / `.md`) after every row, so a run
cut short keeps what it measured; `--append` adds to the table an earlier process wrote.

Every model loads with `--load-format dummy`: seeded random weights generated on the device in
the formats its `quantization_config` declares (`model_loader/dummy.py`); nothing is written
to disk or built on the host. Configs without a `quantization_config` get the released formats
(FP8 128 x 128 dense projections, MXFP4 experts). The decode floor is the bytes a step reads
(every non-expert weight, the expected distinct routed experts of a batch under uniform
routing, embedding rows, the window + compressed KV as stored) over the measured copy
bandwidth.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_dspark import Engine  # noqa: E402
from sgl_dspark.srt.configs.dspark_config import DSparkConfig  # noqa: E402
from sgl_dspark.srt.configs.model_config import CSA, HCA, ModelConfig  # noqa: E402
from sgl_dspark.srt.core.kernel_choice import KernelChoice  # noqa: E402
from sgl_dspark.srt.layers.moe.experts import RoutedExperts  # noqa: E402
from sgl_dspark.srt.model_executor.weights import build_on_meta, keeps_fp32  # noqa: E402
from sgl_dspark.srt.model_loader.dummy import DummyWeights  # noqa: E402
from sgl_dspark.srt.models.bench_configs import (  # noqa: E402
    BENCH_CONFIGS,
    BENCH_DRAFT_KEYS,
    released_quantization,
)
from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel  # noqa: E402
from sgl_dspark.srt.models.registry import model_entry  # noqa: E402

from benchmark.bench_engine import (  # noqa: E402
    batch_capacity,
    profile_sps,
    prompts_for,
    release_device_memory,
    run_or_error_row,
    time_engine,
)
from benchmark.step_floor import copy_bandwidth, v41_kv_bytes  # noqa: E402
from benchmark.step_profile import profile_steps  # noqa: E402

EMBEDDING_NAMES = ("embed_tokens", "lm_head", "markov_head", "engram.embed")


def quantized_raw(name: str) -> dict:
    raw = dict(BENCH_CONFIGS[name])
    # Configs that declare no formats get the released V4 ones.
    raw.setdefault("quantization_config", released_quantization(128))
    return raw


def _kind(name: str) -> str:
    if ".experts." in name and "shared" not in name:
        return "experts"
    return "embeddings" if any(s in name for s in EMBEDDING_NAMES) else "dense"


# ---- sizes ---------------------------------------------------------------------------------
def _module_sizes(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {"bf16": {}, "native": {}}
    state = model.state_dict(keep_vars=True)
    for name, src in DummyWeights(cfg).for_model(model):
        numel = math.prod(src.shape)
        kind = _kind(name)
        if src.fmt is None:
            meta = state[name]
            if not meta.is_floating_point():
                dense = numel * meta.element_size()
            else:
                dense = numel * (4 if keeps_fp32(name) else 2)
            stored = dense
        else:
            rows, k = math.prod(src.shape[:-1]), src.shape[-1]
            codes = numel // 2 if src.fmt == "fp4" else numel
            stored = codes + rows * -(-k // src.group)
            dense = 2 * numel
        out["bf16"][kind] = out["bf16"].get(kind, 0) + dense
        out["native"][kind] = out["native"].get(kind, 0) + stored
    return out


def model_sizes(name: str, raw: dict) -> dict[str, dict[str, dict[str, int]]]:
    """Bytes by kind of the target model and of its DSpark draft (when the config has one) in
    bf16 (fp32 where HF keeps fp32) and as stored (quantised tensors: their codes plus one E8M0
    byte per row and scale group), from meta builds: nothing is allocated."""
    cfg = ModelConfig.from_hf_dict(raw)
    model = build_on_meta(lambda: model_entry(cfg).build_model(cfg, KernelChoice()))
    out = {f"{name} target ({cfg.num_hidden_layers} layers)": _module_sizes(model, cfg)}
    if name in BENCH_DRAFT_KEYS:
        dcfg = DSparkConfig.from_dict({**raw, **BENCH_DRAFT_KEYS[name]}, cfg)
        draft = build_on_meta(lambda: DSparkDraftModel(dcfg))
        stages = len(dcfg.target_layer_ids)
        out[f"{name} DSpark draft ({stages} stages)"] = _module_sizes(draft, dcfg.stage_config)
    return out


def render_sizes(rows: dict[str, dict[str, dict[str, int]]]) -> str:
    lines = [
        "| model | format | dense GB | experts GB | embeddings GB | total GB |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_format in rows.items():
        for fmt, kinds in by_format.items():
            total = sum(kinds.values())
            cells = " | ".join(f"{kinds.get(k, 0) / 1e9:.2f}" for k in EMBED_ORDER)
            lines.append(f"| {name} | {fmt} | {cells} | {total / 1e9:.2f} |")
    return "\n".join(lines) + "\n"


EMBED_ORDER = ("dense", "experts", "embeddings")


# ---- engines -------------------------------------------------------------------------------
def write_model_dir(name: str, raw: dict, work: Path) -> Path:
    """config.json of the model (+ dspark/config.json of its draft when it has one)."""
    path = work / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    if name in BENCH_DRAFT_KEYS:
        (path / "dspark").mkdir(exist_ok=True)
        (path / "dspark" / "config.json").write_text(json.dumps({**raw, **BENCH_DRAFT_KEYS[name]}))
    return path


def engine_args(a: argparse.Namespace, path: Path, sizes: list[int]) -> dict:
    ctx = a.input_len + a.output_len + 64
    kw = dict(
        model_path=str(path),
        device=a.device,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        load_format="dummy",
        weight_format=a.weight_format,
        kv_cache_dtype=a.kv_cache_dtype,
        kernel_backend="triton" if a.device.startswith("cuda") else "torch",
        attention_backend="triton" if a.device.startswith("cuda") else "torch",
        context_length=ctx,
        cuda_graph_max_prefill_tokens=0,  # decode is measured; prefill graphs cost capture time
        **batch_capacity(a.device, sizes, ctx),
    )
    return {**kw, **json.loads(a.engine_args)}


def step_bytes(engine: Engine, bs: int, context: int) -> float:
    """Bytes one decode step of `bs` requests reads (module doc); storage shared by fused views
    counts once."""
    runner = engine.runner
    cfg: ModelConfig = runner.model_cfg
    expert_ids = {
        id(t)
        for m in runner.model.modules()
        if isinstance(m, RoutedExperts)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    }
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = 1 - (1 - k / e) ** bs
    seen: set[int] = set()
    total = 0.0
    for name, t in (*runner.model.named_parameters(), *runner.model.named_buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        nbytes = t.untyped_storage().nbytes()
        if id(t) in expert_ids:
            nbytes *= distinct
        elif name.endswith("embed_tokens.weight") or "engram.embed" in name:
            nbytes = 0  # a few rows a token
        total += nbytes
    if cfg.v41 is not None:  # FP8 window, FP4 latents and index keys, Engram rows
        return total + bs * v41_kv_bytes(cfg, context)
    el = runner.dtype.itemsize
    window_el = runner.window_kv_dtype.itemsize
    for i, lt in enumerate(cfg.layer_types):
        kv = min(context, cfg.sliding_window) * cfg.head_dim * window_el
        if lt in (CSA, HCA):
            m = cfg.compress_ratio(i)
            entries = min(context // m, cfg.index_topk) if lt == CSA else context // m
            kv += entries * cfg.head_dim * el
            if lt == CSA:
                kv += (context // m) * cfg.index_head_dim * el
        total += bs * kv
    return total


def run_engine(
    a: argparse.Namespace,
    system: str,
    kw: dict,
    sizes: list[int],
    vocab: int,
    bw: float,
    emit,
    after=None,
    **extra,
) -> None:
    """One engine: load, then every batch size, then with `--profile` a profile at each batch
    size, then `after(engine)`; a failure is an error row (`run_or_error_row`)."""
    # Before the first engine too: the peak memory of the rows is this engine's alone.
    release_device_memory(a.device)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out_dir = Path(a.out_dir)

    def body(engine: Engine) -> None:
        load_s = time.perf_counter() - t0
        memory = dict(engine.runner.memory_report)
        for bs in sizes:
            prompts = prompts_for(bs, a.input_len, vocab)
            wall, t1, ids = time_engine(engine, prompts, a.output_len, a.device, a.timed_runs)
            step_ms = (wall - t1) / max(a.output_len - 1, 1) * 1e3
            floor_ms = step_bytes(engine, bs, a.input_len + a.output_len // 2) / bw * 1e3
            emit(
                {
                    "system": system,
                    "bs": bs,
                    "load_s": load_s,
                    "tok_s_user": a.output_len / wall,
                    "tok_s_total": bs * a.output_len / wall,
                    "decode_ms_per_token": step_ms,
                    "floor_ms_per_step": floor_ms,
                    "memory_gb": {k: v / 1e9 for k, v in memory.items()},
                    "peak_allocated_gb": (
                        torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0
                    ),
                    **extra,
                    "ids": ids,
                }
            )
        if a.profile:
            for bs in sizes:
                profile_steps(
                    engine,
                    prompts_for(bs, a.input_len, vocab),
                    out_dir / f"profile_{system}_bs{bs}.txt",
                )
        if after is not None:
            after(engine)

    run_or_error_row(system, lambda: Engine(**kw), body, emit, a.device, extra)


def render_rows(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"{meta['what']}: config {meta['config']}, {meta['device']}, torch {meta['torch']}, "
        f"prompts {meta['input_len']} + {meta['output_len']} new tokens, copy bandwidth "
        f"{meta['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, KV cache {meta['kv_cache_dtype']}",
        "",
        "| system | bs | tok/s/user | tok/s total | ms/token | floor ms/step | x floor "
        "| weights GB (dense/experts/emb/host) | KV GB | same tokens as first |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    first: dict[int, list] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | - | error: {r['error']} |  |  |  |  |  |  |  |")
            continue
        first.setdefault(r["bs"], r["ids"])
        same = sum(x == y for x, y in zip(r["ids"], first[r["bs"]]))
        mem = r["memory_gb"]
        lines.append(
            f"| {r['system']} | {r['bs']} | {r['tok_s_user']:.1f} | {r['tok_s_total']:.1f} | "
            f"{r['decode_ms_per_token']:.2f} | {r['floor_ms_per_step']:.2f} | "
            f"{r['decode_ms_per_token'] / r['floor_ms_per_step']:.2f} | "
            f"{mem['dense']:.1f}/{mem['experts']:.1f}/{mem['embeddings']:.1f}/"
            f"{mem.get('host_pinned', 0.0):.1f} | "
            f"{mem['kv']:.2f} | {same}/{len(r['ids'])} |"
        )
    lines.append("")
    lines.append(
        "x floor: ms/token over the floor of one plain decode step (for DSpark rows, tokens "
        "per step > 1 bring it below 1). Same tokens: greedy ids equal to the first row's at "
        "that bs (DSpark rows with simulated acceptance emit other tokens by design)."
    )
    return "\n".join(lines) + "\n"


DECODE_SYSTEMS = ("plain", "dspark_full", "dspark_static", "dspark_online")
FORMATS = ("bf16", "native")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("sizes", "ab", "decode"))
    p.add_argument("--config", default="dsv41_flash_rank", choices=sorted(BENCH_CONFIGS))
    p.add_argument("--configs", default="dsv41_flash_rank,dsv4_flash_rank", help="sizes mode")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--timed-runs",
        type=int,
        default=1,
        help="time each batch size's generation this many times and report the median",
    )
    p.add_argument("--weight-format", default="native", choices=FORMATS)
    p.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="ab mode: the weight formats this process loads, in this order (comma list)",
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--systems",
        default="plain",
        help=f"decode mode: the engines this process runs, in this order ({', '.join(DECODE_SYSTEMS)})",
    )
    p.add_argument("--dspark", action="store_true", help="decode mode: also every DSpark system")
    p.add_argument(
        "--append",
        action="store_true",
        help="add this run's rows to the --out-dir table of the same mode and config (one "
        "engine per process, several invocations)",
    )
    p.add_argument("--accept-len", type=float, default=3.2)
    p.add_argument(
        "--static-widths", default="1:4,8:3,32:2", help="DSpark static verify width per bs"
    )
    p.add_argument("--online-widths", default="2,3,4", help="widths the online policy picks")
    p.add_argument(
        "--sps-table",
        default=None,
        help="SPS table dspark_full profiles and dspark_online reads (default: "
        "<out-dir>/native_decode_<config>_sps.json)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="decode mode: after each engine's rows, a torch.profiler table of its decode steps "
        "at each batch size (device kernels by time, then host ops) in "
        "--out-dir/profile_<system>_bs<bs>.txt",
    )
    p.add_argument("--engine-args", default="{}", help="JSON of extra Engine arguments")
    p.add_argument("--out", default=None, help="sizes mode: markdown file")
    p.add_argument("--out-dir", default=".")
    a = p.parse_args()
    if a.timed_runs < 1:
        p.error(f"--timed-runs must be at least 1, got {a.timed_runs}")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    if a.mode == "sizes":
        table = {
            k: v
            for n in a.configs.split(",")
            if n
            for k, v in model_sizes(n, quantized_raw(n)).items()
        }
        text = render_sizes(table)
        print(text)
        if a.out:
            Path(a.out).write_text(text)
        return

    systems = [s for s in a.systems.split(",") if s]
    if a.dspark:
        systems += [s for s in DECODE_SYSTEMS if s.startswith("dspark") and s not in systems]
    formats = [f for f in a.formats.split(",") if f]
    for name, chosen, allowed in (
        ("--systems", systems, DECODE_SYSTEMS),
        ("--formats", formats, FORMATS),
    ):
        unknown = sorted(set(chosen) - set(allowed))
        if unknown:
            p.error(f"{name}: unknown {unknown}; choose from {', '.join(allowed)}")
    raw = quantized_raw(a.config)
    cfg = ModelConfig.from_hf_dict(raw)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_native_"))
    path = write_model_dir(a.config, raw, work)
    kw = engine_args(a, path, sizes)
    bw = copy_bandwidth(a.device)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"native_{a.mode}_{a.config}"
    rows: list[dict] = []
    if a.append and (out / f"{stem}.json").is_file():
        rows = json.loads((out / f"{stem}.json").read_text())["rows"]

    meta = {
        "what": "bf16 vs native weights" if a.mode == "ab" else "decode",
        "config": a.config,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
        "torch": torch.__version__,
        "copy_bandwidth_Bps": bw if bw == bw else 0.0,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "kv_cache_dtype": a.kv_cache_dtype,
        "engine_args": {k: v for k, v in kw.items() if k != "model_path"},
        "sizes": model_sizes(a.config, raw),
    }

    def write(rows: list[dict], final: bool = False) -> None:
        """The results so far (rewritten after every row, so a run cut short keeps them)."""
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}))
        text = render_rows(meta, rows) + "\n" + render_sizes(meta["sizes"])
        (out / f"{stem}.md").write_text(text)
        if final:
            print(text)

    def emit(row: dict) -> None:
        print(json.dumps({k: v for k, v in row.items() if k != "ids"}), flush=True)
        rows.append(row)
        write(rows)

    if a.mode == "ab":
        for fmt in formats:
            run_engine(
                a, f"weights_{fmt}", {**kw, "weight_format": fmt}, sizes, cfg.vocab_size, bw, emit
            )
        write(rows, final=True)
        return

    spec = dict(
        speculative_algorithm="DSpark",
        speculative_dspark_simulate_accept_len=a.accept_len,
    )
    sps_path = Path(a.sps_table) if a.sps_table else out / f"{stem}_sps.json"
    for system in systems:
        if system == "plain":
            run_engine(a, "plain", kw, sizes, cfg.vocab_size, bw, emit)
        elif system == "dspark_full":
            # Its engine also profiles the SPS table the online policy reads.
            run_engine(
                a,
                "dspark_full",
                {**kw, **spec},
                sizes,
                cfg.vocab_size,
                bw,
                emit,
                after=lambda engine: profile_sps(engine, sps_path),
                accept_len=a.accept_len,
            )
        elif system == "dspark_static":
            widths = dict(case.split(":") for case in a.static_widths.split(",") if case)
            table = work / "widths.json"
            table.write_text(json.dumps({"widths_by_batch_size": widths}))
            static = {
                **kw,
                **spec,
                "speculative_dspark_verify_policy": "static",
                "speculative_dspark_width_table_path": str(table),
            }
            run_engine(
                a,
                f"dspark_static_{a.static_widths}",
                static,
                sizes,
                cfg.vocab_size,
                bw,
                emit,
                accept_len=a.accept_len,
            )
        elif system == "dspark_online":
            name = f"dspark_online_{a.online_widths}"
            if not sps_path.is_file():
                emit(
                    {"system": name, "error": f"no SPS table at {sps_path} (dspark_full writes it)"}
                )
                continue
            online = {
                **kw,
                **spec,
                "speculative_dspark_verify_policy": "static",
                "speculative_dspark_online_width": True,
                "speculative_dspark_verify_widths": a.online_widths,
                "speculative_dspark_sps_table_path": str(sps_path),
            }
            run_engine(a, name, online, sizes, cfg.vocab_size, bw, emit, accept_len=a.accept_len)
    write(rows, final=True)


if __name__ == "__main__":
    main()
