"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls `register` in every process
that loads plugins (the CLI, ``launch_server``, ``Engine``, the scheduler, the detokenizer and
the data-parallel controller).

It always hooks SGLang's argument parser (the ``--enable-dspark-*`` flags), and hooks the kernel
targets named in ``DSPARK_PLUGIN_HOOKS``. Every target is checked against the contract first;
a mismatch stops the process (`SystemExit` with the reason) instead of serving without the hook.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sgl_dspark_plugin import flags
from sgl_dspark_plugin.contract import PluginContractError, is_hooked_by, resolve, resolve_ours
from sgl_dspark_plugin.hooks import BY_NAME

logger = logging.getLogger("sgl_dspark_plugin")

# Hook names registered with SGLang's HookRegistry in this process.
registered: set[str] = set()
_parser_hooked = False


def register() -> None:
    try:
        _hook_parser()
        install(flags.enabled_from_env(), apply_now=False)
    except PluginContractError as exc:
        logger.error("sglang-dspark plugin: %s", exc)
        # SystemExit is not an Exception: SGLang's plugin loader cannot swallow it.
        raise SystemExit(f"sglang-dspark plugin: {exc}") from exc


def _hook_parser() -> None:
    global _parser_hooked
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _parser_hooked:
        return
    resolve(flags.ADD_CLI_ARGS)
    resolve(flags.FROM_CLI_ARGS)
    HookRegistry.register(flags.ADD_CLI_ARGS.path, flags.after_add_cli_args, HookType.AFTER)
    HookRegistry.register(flags.FROM_CLI_ARGS.path, flags.after_from_cli_args, HookType.AFTER)
    _parser_hooked = True


def install(names: Iterable[str], *, apply_now: bool) -> None:
    """Check and register the named hooks. ``apply_now``: also patch them now and verify the
    patch (outside `load_plugins`, whose own ``apply_hooks`` call comes after `register`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    new = [BY_NAME[name] for name in names if name not in registered]
    for spec in new:
        resolve(spec.target)
        for name in spec.ours:
            resolve_ours(name)
    for spec in new:
        HookRegistry.register(spec.target.path, spec.around, HookType.AROUND)
        registered.add(spec.name)
        logger.info("sglang-dspark plugin: %s -> %s", spec.name, spec.target.path)
    if apply_now and new:
        HookRegistry.apply_hooks()
        for spec in new:
            if not is_hooked_by(spec.target, spec.around):
                raise PluginContractError(
                    f"{spec.target.path}: SGLang's HookRegistry did not apply the {spec.name} "
                    "hook (the target was patched before this hook was registered)"
                )
