"""The hooks' switches on SGLang's command line, and how they reach every SGLang process.

An AFTER hook on ``ServerArgs.add_cli_args`` adds one ``--enable-dspark-*`` flag per hook (off
by default). An AFTER hook on ``ServerArgs.from_cli_args`` reads them, exports the chosen names
in ``DSPARK_PLUGIN_HOOKS`` (the scheduler, detokenizer and data-parallel processes that
SGLang starts inherit the environment, and `plugin.register` reads it when each one loads its
plugins) and installs them in the launching process. ``sglang.Engine`` users, who pass no CLI,
set ``DSPARK_PLUGIN_HOOKS`` themselves.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from sgl_dspark_plugin.contract import PluginContractError, Target
from sgl_dspark_plugin.hooks import BY_NAME, HOOKS

# Not SGL_*: SGLang rewrites every SGL_* variable to SGLANG_* with a deprecation warning.
ENV = "DSPARK_PLUGIN_HOOKS"
ADD_CLI_ARGS = Target("sglang.srt.server_args.ServerArgs.add_cli_args", ("parser",))
FROM_CLI_ARGS = Target("sglang.srt.server_args.ServerArgs.from_cli_args", ("cls", "args"))
_GROUP_TITLE = "sglang-dspark kernel hooks (plugin)"


def dest(name: str) -> str:
    return "sgl_dspark_hook_" + name


def enabled_from_env(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Hook names listed in DSPARK_PLUGIN_HOOKS; an unknown name is an error."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise PluginContractError(f"{ENV}: unknown hook(s) {unknown}; known: {sorted(BY_NAME)}")
    return names


def after_add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(_GROUP_TITLE)
    for spec in HOOKS:
        group.add_argument(spec.flag, dest=dest(spec.name), action="store_true", help=spec.help)
    return None


def after_from_cli_args(result: Any, cls: Any, args: argparse.Namespace) -> None:
    from sgl_dspark_plugin.plugin import install

    chosen = [spec.name for spec in HOOKS if getattr(args, dest(spec.name), False)]
    names = tuple(dict.fromkeys([*enabled_from_env(), *chosen]))
    if names:
        os.environ[ENV] = ",".join(names)
        install(names, apply_now=True)
    # Not a field: rides on the record (SGLang pickles bookkeeping to its child processes).
    result._sgl_dspark_hooks = names
    return None
