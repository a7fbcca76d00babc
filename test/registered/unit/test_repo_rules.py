"""Guard-rails from style.md §6, checked on every run."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
PKG = ROOT / "python" / "sgl_dspark"
SOURCES = sorted(PKG.rglob("*.py"))


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(PKG))


def test_sources_exist():
    assert len(SOURCES) > 50


def test_files_under_500_lines():
    long = {_rel(p): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these files (style R18): {long}"


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


def test_kernels_do_not_import_runtime_and_runtime_never_imports_refs():
    bad = []
    for p in SOURCES:
        rel = _rel(p)
        for module, names in _imports(_tree(p)):
            if rel.startswith("kernels/") and module.startswith("sgl_dspark.srt"):
                bad.append(f"{rel} imports {module}")
            if rel.startswith("srt/") and any(n.endswith("_ref") for n in names):
                bad.append(f"{rel} imports a reference {names}")
    assert not bad, bad


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
