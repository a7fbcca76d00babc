"""What the plugin assumes about SGLang: every hook's target and the parameters it reads.

SGLang's `HookRegistry.apply_hooks` logs and skips a target it cannot resolve, and
`load_plugins` logs and skips a plugin that raises. A hook that silently stops applying would
leave a user who asked for it on SGLang's path without knowing. So every target is resolved
here, the same way the registry resolves it (``pkgutil.resolve_name`` on the owner, then the
attribute), and its parameter names are compared with the ones the hook passes on. A mismatch
raises `PluginContractError`, which `plugin.register` turns into `SystemExit`: that passes
through SGLang's ``except Exception`` and stops the process with the message.
"""

from __future__ import annotations

import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The SGLang release whose targets and signatures this file describes.
SGLANG_VERSION = "0.5.23"


class PluginContractError(RuntimeError):
    """SGLang no longer has a target (or its parameters) the way a hook expects it."""


@dataclass(frozen=True)
class Target:
    """A dotted path in SGLang and the parameter names its callable must have, in order."""

    path: str
    parameters: tuple[str, ...]


def resolve(target: Target) -> Any:
    """The object at ``target.path`` after checking its parameters; raises PluginContractError."""
    owner_path, _, attr = target.path.rpartition(".")
    if not owner_path:
        raise PluginContractError(f"{target.path}: not a dotted path to an attribute")
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PluginContractError(
            f"{target.path}: cannot import {owner_path} ({type(exc).__name__}: {exc}); "
            f"this plugin is written against sglang {SGLANG_VERSION}"
        ) from exc
    raw = inspect.getattr_static(owner, attr, None)
    if raw is None:
        raise PluginContractError(
            f"{target.path}: {owner_path} has no attribute {attr!r}; "
            f"this plugin is written against sglang {SGLANG_VERSION}"
        )
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if not callable(function):
        raise PluginContractError(f"{target.path}: is a {type(function).__name__}, not callable")
    found = tuple(inspect.signature(_unwrapped(function)).parameters)
    if found != target.parameters:
        raise PluginContractError(
            f"{target.path}: parameters changed: expected {list(target.parameters)}, "
            f"found {list(found)}; this plugin is written against sglang {SGLANG_VERSION}"
        )
    return getattr(owner, attr)


def resolve_ours(name: str) -> Any:
    """An sglang-dspark object a hook calls ("module:attribute"); raises PluginContractError, so
    a hook never discovers at its first call that this checkout moved or renamed it."""
    try:
        return pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PluginContractError(
            f"sglang-dspark has no {name} ({type(exc).__name__}: {exc}); reinstall the plugin "
            "from the same checkout as sglang-dspark"
        ) from exc


def _unwrapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """The original function under any hook wrappers already applied (``__wrapped__`` chain):
    the contract is about SGLang's definition, not about who patched it first."""
    return inspect.unwrap(function)


def is_hooked_by(target: Target, hook: Callable[..., Any]) -> bool:
    """True when the attribute at ``target.path`` is a registry wrapper chain containing
    ``hook`` (the registry keeps each wrapped function as ``__wrapped__``)."""
    owner_path, _, attr = target.path.rpartition(".")
    current = inspect.getattr_static(pkgutil.resolve_name(owner_path), attr)
    if isinstance(current, (staticmethod, classmethod)):
        current = current.__func__
    while current is not None:
        closure = getattr(current, "__closure__", None) or ()
        if any(cell.cell_contents is hook for cell in closure):
            return True
        current = getattr(current, "__wrapped__", None)
    return False
