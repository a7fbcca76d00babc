"""Repository guard-rails (the style guide's automated checks), run with the unit tests."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
PKG = ROOT / "python" / "sgl_dspark"
SOURCES = sorted(PKG.rglob("*.py"))


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(PKG))


def test_sources_exist():
    assert len(SOURCES) > 50


def test_files_under_600_lines_and_never_packed():
    """Split a file where its ideas part once it grows past 600 lines; `ruff format` owns the
    layout, so no `# fmt: skip` packs code to fit."""
    long = {_rel(p): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these files by responsibility: {long}"
    packed = [_rel(p) for p in SOURCES if "fmt: skip" in p.read_text()]
    assert not packed, f"`# fmt: skip` in {packed}"


def test_no_top_level_sglang_package():
    assert not (ROOT / "python" / "sglang").exists()


def _is_triton_jit(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return (
        isinstance(target, ast.Attribute)
        and target.attr in ("jit", "autotune")
        and isinstance(target.value, ast.Name)
        and target.value.id == "triton"
    )


def test_triton_kernels_only_in_kernels_package():
    bad = []
    for p in SOURCES:
        if _rel(p).startswith("kernels/"):
            continue
        for node in ast.walk(_tree(p)):
            if isinstance(node, ast.FunctionDef) and any(map(_is_triton_jit, node.decorator_list)):
                bad.append(f"{_rel(p)}:{node.name}")
    assert not bad, bad


def test_environment_read_only_in_env_module():
    bad = []
    for p in SOURCES:
        if _rel(p) == "env.py":
            continue
        text = p.read_text()
        if "os.environ" in text or "os.getenv" in text:
            bad.append(_rel(p))
    assert not bad, f"knobs are server args, not env vars (style R13): {bad}"


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _is_reference_module(module: str) -> bool:
    """A kernel family's pure-torch reference module: `sgl_dspark.kernels.<family>.reference`."""
    parts = module.split(".")
    return len(parts) == 4 and parts[:2] == ["sgl_dspark", "kernels"] and parts[3] == "reference"


def _module_name(path: pathlib.Path) -> str:
    return "sgl_dspark." + ".".join(path.relative_to(PKG).with_suffix("").parts)


def test_kernels_never_import_the_runtime():
    bad = [
        f"{_rel(p)} imports {module}"
        for p in SOURCES
        if _rel(p).startswith("kernels/")
        for module, _ in _imports(_tree(p))
        if module.startswith("sgl_dspark.srt")
    ]
    assert not bad, bad


def test_runtime_imports_references_only_from_reference_modules():
    """The torch backend of an op calls its one reference, which lives in the family's
    pure-torch `reference.py`; srt never takes a `*_ref` from a module that loads Triton."""
    bad = [
        f"{_rel(p)} imports {names} from {module}"
        for p in SOURCES
        if _rel(p).startswith("srt/")
        for module, names in _imports(_tree(p))
        if any(n.endswith("_ref") for n in names) and not _is_reference_module(module)
    ]
    assert not bad, bad


def test_reference_modules_never_import_triton():
    """Statically: a reference module imports torch, the standard library, `kernels/_checks.py`
    and other reference modules only. At run time: importing every reference module (and the
    `kernels` package on the way) leaves Triton unloaded, so the torch path never pulls it in."""
    references = [p for p in SOURCES if _is_reference_module(_module_name(p))]
    assert len(references) >= 9, [_rel(p) for p in references]
    allowed = {"sgl_dspark.kernels._checks"}
    bad = []
    for p in references:
        for module, _ in _imports(_tree(p)):
            if module.split(".")[0] == "triton":
                bad.append(f"{_rel(p)} imports {module}")
            elif module.startswith("sgl_dspark") and not (
                _is_reference_module(module) or module in allowed
            ):
                bad.append(f"{_rel(p)} imports {module}")
    assert not bad, bad
    code = "; ".join(
        [f"import {_module_name(p)}" for p in references]
        + ["import sys", "assert 'triton' not in sys.modules, 'triton was imported'"]
    )
    env = {**os.environ, "PYTHONPATH": str(PKG.parent)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_no_global_statements_in_runtime_or_kernels():
    bad = [
        f"{_rel(p)}:{node.lineno}"
        for p in SOURCES
        if _rel(p).startswith(("srt/", "kernels/"))
        for node in ast.walk(_tree(p))
        if isinstance(node, ast.Global)
    ]
    assert not bad, bad


def test_no_two_identical_triton_kernels():
    seen: dict[str, str] = {}
    dups = []
    for p in SOURCES:
        for node in ast.walk(_tree(p)):
            if isinstance(node, ast.FunctionDef) and any(map(_is_triton_jit, node.decorator_list)):
                body = ast.dump(ast.Module(body=node.body, type_ignores=[]))
                where = f"{_rel(p)}:{node.name}"
                if body in seen:
                    dups.append((seen[body], where))
                seen.setdefault(body, where)
    assert not dups, f"one kernel per computation (style R9): {dups}"
