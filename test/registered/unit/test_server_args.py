"""ServerArgs: the CLI is generated from the fields; bad, unknown and conflicting flags fail at
launch with a message naming the flag."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sgl_dspark import Engine
from sgl_dspark.launch_server import curl_example, ready_message
from sgl_dspark.srt.model_executor.model_runner import RunnerConfig
from sgl_dspark.srt.server_args import ServerArgs, make_parser


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        ServerArgs.from_cli_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_help_lists_every_field_with_help():
    text = make_parser().format_help()
    for f in dataclasses.fields(ServerArgs):
        assert _flag(f.name) in text, f.name
        assert len(f.metadata["help"]) > 15, f.name
    for flag in (
        "--model-path",
        "--tokenizer-path",
        "--skip-tokenizer-init",
        "--host",
        "--port",
        "--api-key",
        "--dtype",
        "--device",
        "--mem-fraction-static",
        "--max-total-tokens",
        "--max-running-requests",
        "--chunked-prefill-size",
        "--context-length",
        "--served-model-name",
        "--log-level",
        "--cuda-graph-max-bs",
        "--disable-cuda-graph",
        "--speculative-algorithm",
        "--kernel-backend",
        "--attention-backend",
        "--page-size",
        "--random-seed",
        "--speculative-dspark-verify-policy",
    ):
        assert flag in text, flag


def test_engine_arguments_are_server_args():
    """The Engine's arguments are the server's: the record it keeps is the resolved ServerArgs
    of its keyword arguments, an unknown argument is refused, and the runner's record takes its
    defaults from ServerArgs."""
    engine = Engine(model_path="tiny", device="cpu", skip_tokenizer_init=True, context_length=64)
    assert (
        engine.args
        == ServerArgs(
            model_path="tiny", device="cpu", skip_tokenizer_init=True, context_length=64
        ).resolved()
    )
    with pytest.raises(TypeError, match="not_a_flag"):
        Engine(model_path="tiny", not_a_flag=1)
    runner_defaults = RunnerConfig()
    for f in dataclasses.fields(RunnerConfig):
        if f.name in ServerArgs.__dataclass_fields__ and f.name not in (
            "device",
            "dtype",
            "kernel_backend",
            "attention_backend",
            "weight_format",
            "fp8_activations",
        ):
            assert (
                getattr(runner_defaults, f.name) == ServerArgs.__dataclass_fields__[f.name].default
            ), f.name
    rc = RunnerConfig.from_server_args(engine.args, max_verify_tokens=16)
    assert (rc.device, rc.dtype, rc.context_length) == ("cpu", "float32", 64)


def test_fp8_activations_resolution():
    """auto resolves to off without a GPU that has FP8 matrix instructions; on needs native
    weights and the triton linear kernels (a CPU runs them in the interpreter), else the error
    names the flag."""
    base = dict(model_path="tiny", device="cpu")
    assert ServerArgs(**base).resolved().fp8_activations == "off"
    on = ServerArgs(
        **base, fp8_activations="on", weight_format="native", kernel_backend="triton"
    ).resolved()
    assert on.fp8_activations == "on"
    with pytest.raises(ValueError, match="--fp8-activations on needs --weight-format native"):
        ServerArgs(**base, fp8_activations="on", kernel_backend="triton").resolved()
    with pytest.raises(ValueError, match="triton 'linear'"):
        ServerArgs(**base, fp8_activations="on", weight_format="native").resolved()
    with pytest.raises(ValueError, match="--fp8-activations"):
        ServerArgs(**base, fp8_activations="yes")
    off = ServerArgs(**base, fp8_activations="off", weight_format="native").resolved()
    assert off.fp8_activations == "off"


def test_parse_types_defaults_and_resolution():
    args = ServerArgs.from_cli_args(
        [
            "--model-path",
            "tiny",
            "--port",
            "8123",
            "--chunked-prefill-size",
            "-1",
            "--skip-tokenizer-init",
            "--dtype",
            "half",
            "--device",
            "cpu",
            "--mem-fraction-static",
            "0.5",
        ]
    )
    assert args.port == 8123 and args.skip_tokenizer_init is True
    assert args.dtype == "float16" and args.device == "cpu" and args.kernel_backend == "torch"
    assert args.served_model_name == "tiny" and args.mem_fraction_static == 0.5
    assert args.chunked_prefill_size == -1  # no chunking: the scheduler's prefill budget is off
    defaults = ServerArgs.from_cli_args(["--model-path", "m", "--device", "cpu"])
    for f in dataclasses.fields(ServerArgs):
        resolved = (
            "device",
            "dtype",
            "kernel_backend",
            "attention_backend",
            "weight_format",
            "fp8_activations",
            "served_model_name",
        )
        if f.name != "model_path" and f.name not in resolved:
            assert getattr(defaults, f.name) == f.default, f.name
    assert defaults.dtype == "float32" and defaults.served_model_name == "m"
    assert defaults.weight_format == "bf16"  # auto: dequantised on CPU
    assert defaults.attention_backend == "torch"  # auto: torch on CPU, triton on GPU


def test_unknown_flag_suggests_the_right_one(capsys):
    err = _parse_error(capsys, ["--model-path", "tiny", "--max-running-request", "4"])
    assert "unrecognized arguments" in err and "did you mean --max-running-requests" in err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--skip-tokenizer-init", "--tokenizer-path", "x"], "--tokenizer-path conflicts"),
        (["--disable-cuda-graph", "--cuda-graph-max-bs", "8"], "--cuda-graph-max-bs conflicts"),
        (
            ["--max-running-requests", "4", "--cuda-graph-max-bs", "8"],
            "--cuda-graph-max-bs 8 exceeds --max-running-requests 4",
        ),
        (["--speculative-dspark-block-size", "4"], "need(s) --speculative-algorithm"),
        (
            ["--speculative-algorithm", "DSpark", "--speculative-dspark-bs1-block-size", "0"],
            "--speculative-dspark-bs1-block-size must be in [1, 15]",
        ),
        (
            ["--speculative-algorithm", "DSpark", "--speculative-dspark-confidence-mode", "async"],
            "only used with --speculative-dspark-verify-policy confidence",
        ),
        (
            [
                "--speculative-algorithm",
                "DSpark",
                "--speculative-dspark-verify-policy",
                "static",
                "--speculative-dspark-online-width",
                "--speculative-dspark-width-table-path",
                "w.json",
            ],
            "--speculative-dspark-width-table-path conflicts with --speculative-dspark-online-width",
        ),
        (
            ["--speculative-algorithm", "DSpark", "--speculative-dspark-verify-widths", "2,4"],
            "only used with --speculative-dspark-online-width",
        ),
        (
            [
                "--speculative-algorithm",
                "dspark",
                "--speculative-dspark-verify-policy",
                "static",
                "--speculative-dspark-online-width",
                "--speculative-dspark-verify-widths",
                "1,x",
            ],
            "must be a comma list of ints >= 2",
        ),
        (
            [
                "--speculative-algorithm",
                "DSpark",
                "--speculative-dspark-verify-policy",
                "static",
                "--speculative-dspark-sps-table-path",
                "s.json",
            ],
            "with --speculative-dspark-online-width",
        ),
        (["--speculative-dspark-verify-policy", "static"], "need(s) --speculative-algorithm"),
        (["--speculative-algorithm", "eagle"], "--speculative-algorithm must be one of"),
        (["--port", "70000"], "--port must be in"),
        (["--programmatic-launch-max-bs", "-1"], "--programmatic-launch-max-bs must be >= 0"),
        (["--context-length", "0"], "--context-length must be >= 1"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be -1"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1)"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--attention-backend", "flash"], "invalid choice: 'flash'"),
        (["--port", "eighty"], "invalid int value"),
        (["--kernel-backend-overrides", "attention=triton"], "unknown family 'attention'"),
        (["--kernel-backend-overrides", "moe"], "expects family=impl"),
    ],
)
def test_bad_or_conflicting_flags_exit_2(capsys, argv, needle):
    err = _parse_error(capsys, ["--model-path", "tiny", *argv])
    assert needle in err


def test_dspark_flags_validated_in_server_args():
    args = ServerArgs(model_path="tiny", speculative_algorithm="dspark").resolved()
    assert args.speculative_algorithm == "DSpark"  # case-insensitive, canonical spelling
    with pytest.raises(ValueError, match="only used with --speculative-dspark-verify-policy"):
        ServerArgs(
            model_path="tiny",
            speculative_algorithm="DSPARK",
            speculative_dspark_sps_table_path="t.json",
        )
    with pytest.raises(ValueError, match="exceeds --speculative-dspark-block-size"):
        ServerArgs(
            model_path="tiny",
            speculative_algorithm="DSpark",
            speculative_dspark_block_size=3,
            speculative_dspark_simulate_accept_len=4.5,
        )
    with pytest.raises(ValueError, match="--speculative-dspark-block-size must be >= 1"):
        ServerArgs(
            model_path="tiny", speculative_algorithm="DSpark", speculative_dspark_block_size=0
        )
    ok = ServerArgs(
        model_path="tiny",
        speculative_algorithm="DSpark",
        speculative_dspark_verify_policy="confidence",
        speculative_dspark_confidence_mode="async",
        speculative_dspark_sps_table_path="sps.json",
        speculative_dspark_confidence_sts_path="sts.json",
    )
    assert ok.speculative_dspark_confidence_mode == "async"
    online = ServerArgs(
        model_path="tiny",
        speculative_algorithm="DSpark",
        speculative_dspark_verify_policy="static",
        speculative_dspark_online_width=True,
        speculative_dspark_verify_widths="2,3,4",
        speculative_dspark_sps_table_path="sps.json",
    )
    assert online.speculative_dspark_verify_widths == "2,3,4"


def test_ready_message_has_a_pasteable_curl_line():
    args = ServerArgs(model_path="tiny", api_key="secret").resolved()
    msg = ready_message("http://127.0.0.1:1234", args)
    assert "secret" not in msg
    line = curl_example("http://127.0.0.1:1234", args)
    words = shlex.split(line)
    assert words[:2] == ["curl", "http://127.0.0.1:1234/v1/chat/completions"]
    assert "Authorization: Bearer $SGL_DSPARK_API_KEY" in words  # expanded by the shell
    assert '"model": "tiny"' in words[-1]


def test_cli_entry_points():
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "sgl_dspark.launch_server",
            "--model-path",
            "tiny",
            "--speculative-dspark-block-size",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "need(s) --speculative-algorithm DSpark" in bad.stderr
    script = str(Path(sys.executable).with_name("sgl-dspark-server"))
    helped = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--speculative-dspark-block-size" in helped.stdout


def test_batches_past_the_default_graph_limit_are_warned_about(caplog):
    """With more running requests allowed than the default graph limit captures, the larger
    decode steps run eagerly: the engine says so at start and names the flag; not when the
    limit was chosen or covers every batch."""
    import logging
    from types import SimpleNamespace

    import torch
    from sgl_dspark.srt.entrypoints.engine import graph_limits

    # A runner as graph_limits reads it: on a GPU, the Triton MoE path.
    runner = SimpleNamespace(
        device=torch.device("cuda"), kernels=SimpleNamespace(of=lambda op: "triton")
    )
    base = dict(model_path="tiny", device="cpu")
    with caplog.at_level(logging.WARNING, logger="sgl_dspark.srt.entrypoints.engine"):
        assert graph_limits(ServerArgs(**base, max_running_requests=64), runner)[0] == 32
    assert "--cuda-graph-max-bs 64" in caplog.text
    for quiet in (
        dict(max_running_requests=32),
        dict(max_running_requests=64, cuda_graph_max_bs=48),
        dict(max_running_requests=64, cuda_graph_max_bs=64),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sgl_dspark.srt.entrypoints.engine"):
            limits = graph_limits(ServerArgs(**base, **quiet), runner)
        assert limits[0] == quiet.get("cuda_graph_max_bs", 32)
        assert "--cuda-graph-max-bs" not in caplog.text, quiet
