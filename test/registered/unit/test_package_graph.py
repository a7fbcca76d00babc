"""The packages of `srt` import each other without a cycle (every import counts, those under
`TYPE_CHECKING` too), and the ground floor `srt/core` reaches only the leaf packages."""

from __future__ import annotations

import ast
import pathlib

SRT = pathlib.Path(__file__).resolve().parents[3] / "python" / "sgl_dspark" / "srt"


def package_edges() -> dict[str, set[str]]:
    """srt package -> the other srt packages its modules import (modules directly in srt/, such
    as server_args.py, are not packages and are left out)."""
    edges: dict[str, set[str]] = {}
    for path in SRT.rglob("*.py"):
        parts = path.relative_to(SRT).parts
        if len(parts) < 2:
            continue
        src = parts[0]
        edges.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                mod = name.split(".")
                if mod[:2] == ["sgl_dspark", "srt"] and len(mod) > 2 and mod[2] != src:
                    if (SRT / mod[2]).is_dir():
                        edges[src].add(mod[2])
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_srt_packages_form_no_cycle():
    edges = package_edges()
    assert {"core", "managers", "model_executor", "speculative", "layers"} <= set(edges)
    assert find_cycle(edges) is None, find_cycle(edges)


def test_core_reaches_only_leaf_packages():
    edges = package_edges()
    assert edges["core"] <= {"sampling", "tokenizer"}, edges["core"]
    for leaf in ("sampling", "tokenizer"):
        assert not edges[leaf], (leaf, edges[leaf])


def test_scheduler_depends_on_the_step_contract_only():
    """managers (the scheduler, its loop, the I/O records) never import an executor, a model or
    the speculative package: executors reach it through `srt/core/step.py` (the KV page pools
    are the scheduler's to manage)."""
    allowed = {"core", "constrained", "mem_cache", "sampling", "tokenizer"}
    assert package_edges()["managers"] <= allowed
