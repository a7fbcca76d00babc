"""Repository guard-rails, checked on every run."""

from __future__ import annotations

import ast
import os
import pathlib
import re
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
    assert not bad, f"knobs are server args, not env vars: {bad}"


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
    assert not dups, f"one kernel per computation: {dups}"


# ---- the repository speaks for itself -----------------------------------------------------------
# Comments, docstrings and documents refer to names and files in this repository, never to notes
# outside it, and say nothing about how the code was developed; result files are named by date
# and commit. This file spells the patterns, so it is exempt.

_TEXT_DIRS = ("python", "benchmark", "test", "docs")
_TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg", ".ini", ".txt", ".yaml", ".yml"}
_THIS_FILE = pathlib.Path(__file__).resolve()
_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
_SECTION_SIGN = "\u00a7"  # section references point into documents outside the repository
_HISTORY = re.compile(
    rf"\b(?:{_ORDINALS}|\d+(?:st|nd|rd|th)) sessions?\b|\bissue #?\d|\bthe seed\b", re.IGNORECASE
)
_DESIGN_NOTES = re.compile(r"\b(?:dspark|deepseek_v4_model|deepseek_v41|style)\.md\b")
_ROUND_NAMED_RESULT = re.compile(r"_s\d+_")

# Files whose clean-up is still under way elsewhere (repository-relative paths). Empty this set
# as they are cleaned: a listed file that no longer breaks a rule fails
# `test_pending_cleanup_list_is_current`.
PENDING_CLEANUP: frozenset[str] = frozenset()


def _text_files() -> list[pathlib.Path]:
    """Source and documentation files under python/, benchmark/, test/, docs/ and the README."""
    out = [ROOT / "README.md"]
    for top in _TEXT_DIRS:
        base = ROOT / top
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            parts = p.relative_to(ROOT).parts
            if any(s.startswith(".") or s == "__pycache__" for s in parts):
                continue
            if p.is_file() and p.suffix in _TEXT_SUFFIXES and p.resolve() != _THIS_FILE:
                out.append(p)
    return out


def _violations(text: str) -> list[str]:
    found = []
    if _SECTION_SIGN in text:
        found.append("section sign")
    found += [f"history: {m.group(0)!r}" for m in _HISTORY.finditer(text)]
    found += [f"design note: {m.group(0)!r}" for m in _DESIGN_NOTES.finditer(text)]
    return found


def _offenders() -> dict[str, list[str]]:
    out = {}
    for p in _text_files():
        if found := _violations(p.read_text(encoding="utf-8", errors="replace")):
            out[str(p.relative_to(ROOT))] = found
    return out


def test_rule_patterns_catch_what_they_should():
    assert _violations("see \u00a73.2 of the notes") == ["section sign"]
    assert len(_violations("as in the Eighth session, fixed in issue 7 (issue #12)")) == 3
    assert _violations("the 3rd session kept the seed's choice") == [
        "history: '3rd session'",
        "history: 'the seed'",
    ]
    assert _violations("per dspark.md and style.md") == [
        "design note: 'dspark.md'",
        "design note: 'style.md'",
    ]
    for clean in (
        "a seeded generator",
        "torch.manual_seed(0)",
        "seed = 0",
        "tissue 5",
        "a session",
    ):
        assert _violations(clean) == [], clean
    assert _ROUND_NAMED_RESULT.search("2026-11-30_s17_engine_eb28f8a.md")
    assert not _ROUND_NAMED_RESULT.search("2026-11-30_engine_eb28f8a.md")


def test_no_outside_references_or_development_history():
    bad = {f: v for f, v in _offenders().items() if f not in PENDING_CLEANUP}
    assert not bad, f"state the fact or name a repository file instead: {bad}"


def test_pending_cleanup_list_is_current():
    offenders = _offenders()
    done = sorted(f for f in PENDING_CLEANUP if f not in offenders)
    assert not done, f"clean now: remove them from PENDING_CLEANUP: {done}"


def test_result_files_named_by_date_and_commit():
    results = ROOT / "benchmark" / "results"
    bad = sorted(
        str(p.relative_to(results))
        for p in results.rglob("*")
        if p.is_file() and _ROUND_NAMED_RESULT.search(p.name)
    )
    assert not bad, f"name result files <date>_<what>_<commit>.md: {bad}"
