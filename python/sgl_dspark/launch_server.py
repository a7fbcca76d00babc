"""`python -m sgl_dspark.launch_server` / `sgl-dspark-server`: the SGLang-compatible server CLI.

    python -m sgl_dspark.launch_server --model-path tiny --port 30000

Once the server accepts requests, a ready line with a ready-to-paste `curl` command is printed to
stdout. Bad flags exit with status 2 and a message naming the flag; a model or port that cannot
be used exits with status 1; a SIGTERM/SIGINT shutdown exits with status 0.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from collections.abc import Sequence

from sgl_dspark.srt.server_args import ServerArgs

logger = logging.getLogger("sgl_dspark.launch_server")

READY_MARKER = "The server is ready."
# A grade-school word problem: what the shipped demo model was trained to answer.
EXAMPLE_QUESTION = "A baker makes 24 rolls and sells 9 of them. How many rolls are left?"


def curl_example(base_url: str, args: ServerArgs) -> str:
    """A chat request against `base_url` that can be pasted into a shell."""
    body = {
        "model": args.served_model_name,
        "messages": [{"role": "user", "content": EXAMPLE_QUESTION}],
        "max_tokens": 128,
    }
    parts = ["curl", f"{base_url}/v1/chat/completions", "-H", "Content-Type: application/json"]
    if args.api_key is not None:
        parts = parts[:2] + ["-H", "Authorization: Bearer $SGL_DSPARK_API_KEY"] + parts[2:]
    line = " ".join(shlex.quote(p) for p in parts)
    # Double quotes around the auth header so the shell expands the variable.
    line = line.replace(
        "'Authorization: Bearer $SGL_DSPARK_API_KEY'", '"Authorization: Bearer $SGL_DSPARK_API_KEY"'
    )
    return f"{line} -d {shlex.quote(json.dumps(body))}"


def ready_message(base_url: str, args: ServerArgs) -> str:
    lines = [
        f"{READY_MARKER} Serving {args.served_model_name!r} at {base_url}",
        "Try:",
        "",
        "  " + curl_example(base_url, args),
        "",
    ]
    if args.api_key is not None:
        lines.insert(2, "(first: export SGL_DSPARK_API_KEY=<the --api-key value>)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = ServerArgs.from_cli_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    shown = {
        k: ("<redacted>" if k == "api_key" and v is not None else v) for k, v in vars(args).items()
    }
    logger.info("server args: %s", shown)

    from sgl_dspark.srt.entrypoints.http_server import run_server

    def announce(base_url: str) -> None:
        # The CLI's own output (not a log record): it must show whatever the log level.
        sys.stdout.write(ready_message(base_url, args) + "\n")
        sys.stdout.flush()

    try:
        return run_server(args, on_ready=announce)
    except (ValueError, RuntimeError, OSError) as exc:
        logger.debug("launch failed", exc_info=True)
        logger.error("launch failed: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
