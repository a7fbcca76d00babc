"""Entry point of the ``sglang.serve_backends`` group: ``sglang serve --model-type dspark ...``
runs sglang-dspark's server (``python -m sgl_dspark.launch_server``) with the translated
command line (`argv_map`). The process becomes that server (``exec``), so signals, exit status
and stdout are the server's own.

The backend has no detector: a DeepSeek-V4 checkpoint keeps going to SGLang's own server unless
``--model-type dspark`` asks for this one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from sgl_dspark_plugin.argv_map import ArgvError, translate

logger = logging.getLogger("sgl_dspark_plugin")

PROG = "sglang serve --model-type dspark"
SERVER_MODULE = "sgl_dspark.launch_server"


def our_parser() -> argparse.ArgumentParser:
    """sglang-dspark's server parser (its flags are SGLang's names)."""
    from sgl_dspark.launch_server import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description="sglang-dspark's server for DeepSeek-V4 models with DSpark speculative "
        "decoding, started through SGLang's CLI. SGLang's parallelism flags are accepted at "
        "1; --speculative-num-draft-tokens N maps to --speculative-dspark-block-size N-1; "
        "other SGLang-only options are refused by name.",
    )
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def server_command(argv: Sequence[str]) -> list[str]:
    """The sglang-dspark server command for an ``sglang serve`` argv (raises ArgvError)."""
    from sgl_dspark_plugin.hooks import HOOKS

    translation = translate(
        argv, our_parser(), sglang_parser(), plugin_flags=[spec.flag for spec in HOOKS]
    )
    for note in translation.notes:
        logger.warning("%s: %s", PROG, note)
    return [sys.executable, "-m", SERVER_MODULE, *translation.argv]


def _exec(command: list[str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)


def run(request: Any) -> None:
    argv = list(request.argv)
    if "-h" in argv or "--help" in argv:
        our_parser().print_help()
        return
    try:
        command = server_command(argv)
    except ArgvError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        raise SystemExit(2) from exc
    _exec(command)


def make_backend() -> Any:
    from sglang.cli.serve_backends import SERVE_BACKEND_API_VERSION, ServeBackend

    return ServeBackend(api_version=SERVE_BACKEND_API_VERSION, run=run, requires_model_path=True)
