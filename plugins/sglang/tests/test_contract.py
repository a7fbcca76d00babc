"""Every hook names a target that exists in SGLang 0.5.23 with the parameters the hook passes
on, and a changed target stops the process instead of being skipped."""

from __future__ import annotations

import dataclasses

import pytest
import sglang
from _util import ALL_HOOKS, run_python
from sgl_dspark_plugin import flags, plugin
from sgl_dspark_plugin.contract import (
    SGLANG_VERSION,
    PluginContractError,
    Target,
    resolve,
    resolve_ours,
)
from sgl_dspark_plugin.hooks import BY_NAME, HOOKS


def test_installed_sglang_is_the_contract_version():
    assert sglang.__version__ == SGLANG_VERSION


@pytest.mark.parametrize("spec", HOOKS, ids=lambda s: s.name)
def test_kernel_hook_target_resolves(spec):
    target = resolve(spec.target)
    assert callable(target)


@pytest.mark.parametrize("spec", HOOKS, ids=lambda s: s.name)
def test_what_each_hook_runs_of_ours_resolves(spec):
    assert spec.ours and all(callable(resolve_ours(name)) for name in spec.ours)


def test_a_moved_implementation_of_ours_stops_the_process(monkeypatch):
    spec = BY_NAME["silu_mul_clamp"]
    moved = dataclasses.replace(spec, ours=("sgl_dspark.kernels:silu_mul_clamp_renamed",))
    monkeypatch.setitem(BY_NAME, spec.name, moved)
    monkeypatch.setenv(flags.ENV, spec.name)
    monkeypatch.setattr(plugin, "registered", set())
    with pytest.raises(SystemExit, match="silu_mul_clamp_renamed"):
        plugin.register()


@pytest.mark.parametrize("target", [flags.ADD_CLI_ARGS, flags.FROM_CLI_ARGS], ids=str)
def test_parser_hook_target_resolves(target):
    assert callable(resolve(target))


def test_flags_are_distinct_and_off_by_default():
    assert len({spec.flag for spec in HOOKS}) == len(HOOKS)
    assert all(spec.flag.startswith("--enable-dspark-") for spec in HOOKS)
    assert flags.enabled_from_env({}) == ()


@pytest.mark.parametrize(
    "target",
    [
        Target("sglang.srt.layers.moe.topk.no_such_gate", ("x",)),
        Target("sglang.srt.no_such_module.f", ("x",)),
        Target("sglang.kernels.ops.speculative.dspark.dspark_accept._row_argmax", ("logits",)),
    ],
    ids=["missing attribute", "missing module", "changed parameters"],
)
def test_a_changed_target_raises(target):
    with pytest.raises(PluginContractError, match="sglang 0.5.23|parameters changed"):
        resolve(target)


def test_register_stops_the_process_on_a_changed_target(monkeypatch):
    spec = BY_NAME["greedy_argmax"]
    broken = dataclasses.replace(spec, target=Target(spec.target.path, ("logits", "renamed")))
    monkeypatch.setitem(BY_NAME, spec.name, broken)
    monkeypatch.setenv(flags.ENV, spec.name)
    monkeypatch.setattr(plugin, "registered", set())
    # SystemExit, not Exception: SGLang's load_plugins catches Exception and would go on.
    with pytest.raises(SystemExit, match="parameters changed"):
        plugin.register()
    assert not issubclass(SystemExit, Exception)


def test_unknown_hook_name_stops_the_process(monkeypatch):
    monkeypatch.setenv(flags.ENV, "greedy_argmax,no_such_hook")
    with pytest.raises(SystemExit, match="no_such_hook"):
        plugin.register()


def test_load_plugins_propagates_the_stop():
    """Through SGLang's own loader, in a fresh process: the process exits with the reason."""
    code = (
        "import dataclasses, sgl_dspark_plugin.hooks as h\n"
        "from sgl_dspark_plugin.contract import Target\n"
        "s = h.BY_NAME['router_gate']\n"
        "h.BY_NAME['router_gate'] = dataclasses.replace("
        "s, target=Target('sglang.srt.layers.moe.topk.gone', ('x',)))\n"
        "from sglang.srt.plugins import load_plugins\n"
        "try:\n"
        "    load_plugins()\n"
        "except SystemExit as e:\n"
        "    print('EXIT', e)\n"
        "else:\n"
        "    print('NO EXIT')\n"
    )
    out = run_python(code, env={flags.ENV: "router_gate"})
    assert "EXIT sglang-dspark plugin:" in out and "gone" in out, out


def test_every_hook_applies_through_load_plugins():
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sgl_dspark_plugin.contract import is_hooked_by\n"
        "from sgl_dspark_plugin.hooks import HOOKS\n"
        "print(sorted(s.name for s in HOOKS if is_hooked_by(s.target, s.around)))\n"
    )
    out = run_python(code, env={flags.ENV: ALL_HOOKS})
    assert out.strip() == str(sorted(spec.name for spec in HOOKS))
