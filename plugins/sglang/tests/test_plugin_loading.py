"""The plugin loads in every kind of SGLang process, and its flags reach SGLang's CLI.

SGLang calls ``load_plugins()`` at the start of each process kind; the first test pins that
contract (the call is in the entry function's body). The others run each process kind's module
in a fresh interpreter, load the plugins the way that module does, and check the hooks named in
``DSPARK_PLUGIN_HOOKS`` (inherited from the launching process) are in place."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from _util import ALL_HOOKS, run_python
from sgl_dspark_plugin import flags
from sgl_dspark_plugin.hooks import HOOKS

# (module, entry function or method that starts the process kind)
PROCESS_ENTRIES = [
    ("sglang.cli.serve", "serve"),
    ("sglang.launch_server", None),  # `python -m sglang.launch_server`: the __main__ block
    ("sglang.srt.entrypoints.engine", "Engine.__init__"),
    ("sglang.srt.entrypoints.engine", "Engine._launch_subprocesses"),
    ("sglang.srt.managers.scheduler", "run_scheduler_process"),
    ("sglang.srt.managers.detokenizer_manager", "run_detokenizer_process"),
    ("sglang.srt.managers.data_parallel_controller", "run_data_parallel_controller_process"),
]


def _calls_load_plugins(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "load_plugins"
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize("module, entry", PROCESS_ENTRIES, ids=lambda v: str(v))
def test_each_process_entry_loads_plugins(module, entry):
    import importlib

    mod = importlib.import_module(module)
    if entry is None:
        tree = ast.parse(inspect.getsource(mod))
        main_blocks = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.dump(n)]
        assert main_blocks and _calls_load_plugins(main_blocks[0])
        return
    obj = mod
    for part in entry.split("."):
        obj = getattr(obj, part)
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(obj))))
    assert _calls_load_plugins(tree), f"{module}.{entry} no longer calls load_plugins()"


@pytest.mark.parametrize(
    "module", sorted({m for m, _ in PROCESS_ENTRIES}), ids=lambda m: m.rsplit(".", 1)[-1]
)
def test_hooks_apply_in_each_process_kind(module):
    code = (
        f"import {module} as entry\n"
        # The name the process entry calls: sglang.srt.plugins.load_plugins.
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sgl_dspark_plugin.contract import is_hooked_by\n"
        "from sgl_dspark_plugin.hooks import HOOKS\n"
        "print(sorted(s.name for s in HOOKS if is_hooked_by(s.target, s.around)))\n"
    )
    out = run_python(code, env={flags.ENV: ALL_HOOKS})
    assert out.strip().splitlines()[-1] == str(sorted(spec.name for spec in HOOKS))


def test_flags_parse_and_install_in_the_launching_process():
    code = (
        "import os\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "args = prepare_server_args(['--model-path', 'x', '--enable-dspark-greedy-argmax',"
        " '--enable-dspark-mhc-post-combine'])\n"
        "from sgl_dspark_plugin.contract import is_hooked_by\n"
        "from sgl_dspark_plugin.hooks import HOOKS\n"
        "print(os.environ['DSPARK_PLUGIN_HOOKS'])\n"
        "print(sorted(args._sgl_dspark_hooks))\n"
        "print(sorted(s.name for s in HOOKS if is_hooked_by(s.target, s.around)))\n"
    )
    env_line, record, hooked = run_python(code, env={flags.ENV: ""}).strip().splitlines()[-3:]
    assert sorted(env_line.split(",")) == ["greedy_argmax", "mhc_post_combine"]
    assert record == hooked == str(["greedy_argmax", "mhc_post_combine"])


def test_without_flags_nothing_is_hooked():
    code = (
        "import os\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "args = prepare_server_args(['--model-path', 'x'])\n"
        "from sgl_dspark_plugin.contract import is_hooked_by\n"
        "from sgl_dspark_plugin.hooks import HOOKS\n"
        "print('env=' + os.environ.get('DSPARK_PLUGIN_HOOKS', '<unset>'))\n"
        "print([s.name for s in HOOKS if is_hooked_by(s.target, s.around)])\n"
        "print(getattr(args, '_sgl_dspark_hooks'))\n"
    )
    env = {flags.ENV: ""}
    env_line, hooked, record = run_python(code, env=env).strip().splitlines()[-3:]
    assert env_line == "env=" and hooked == "[]" and record == "()"


def test_flags_are_listed_by_sglangs_parser():
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "import argparse\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser()\n"
        "ServerArgs.add_cli_args(p)\n"
        "print(p.format_help())\n"
    )
    out = run_python(code)
    for spec in HOOKS:
        assert spec.flag in out
