"""The markdown fragment of a measurement, for `benchmark/results/acceptance.md`."""

from __future__ import annotations

from typing import Any


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _temperature(value: float) -> str:
    return "greedy" if value == 0 else f"T={value:g}"


def _run_row(run: dict[str, Any]) -> str:
    s = run["summary"]
    greedy = run.get("greedy_check")
    check = "-" if greedy is None else f"{greedy['outputs_differing']}/{s['questions']}"
    return (
        f"| {run['draft']} | {run['policy']} | {run['block_size'] or '-'} | "
        f"{_temperature(run['temperature'])} | {_num(s.get('accept_length'))} | "
        f"{_num(s.get('accept_length_no_loops'))} | {s['tokens']} | "
        f"{_pct(s['accuracy'])} ({s['correct']}/{s['questions']}) | {_pct(s['loop_rate'])} | "
        f"{_pct(s['hit_token_limit_rate'])} | {check} |"
    )


def markdown_fragment(result: dict[str, Any]) -> str:
    """Setup lines and one table row per run and per n-gram block size."""
    meta = result["meta"]
    lines = [
        f"### {meta['model_path']} with draft {meta['draft_path'] or '(default)'}: "
        f"{meta['date']}, commit {meta['commit']}, {meta['device']}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Data: {meta['questions']} GSM8K test questions from `{meta['data']}` (sha256 "
        f"{meta['data_sha256'][:12]}), zero-shot prompt `Question: {{q}}\\nAnswer:`, stop at "
        f"{', '.join(repr(s) for s in meta['stop'])} or EOS, at most {meta['max_new_tokens']} new "
        f"tokens; batch size {meta['batch_size']}; sampled runs seeded per question from "
        f"{meta['seed']}.",
        f"- Acceptance length: {meta['acceptance_definition']}",
        f"- Loop: {meta['loop_definition']}.",
        "- Greedy check: questions whose DSpark output token ids differ from no-spec's "
        "(must be 0: DSpark is lossless).",
        f"- N-gram lookup control: {meta['ngram_definition']}",
        "",
        "| draft | policy | block | sampling | accept len | accept len (no loops) | tokens | "
        "accuracy | loops | hit token limit | greedy outputs differing |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_run_row(run) for run in result["runs"]]
    for row in result["ngram_control"]:
        lines.append(
            f"| n-gram lookup (n={row['max_ngram']}..{row['min_ngram']}) | full | "
            f"{row['block_size']} | greedy | {_num(row['accept_length'])} | "
            f"{_num(row['accept_length_no_loops'])} | - | - | - | - | - |"
        )
    for skipped in result["skipped"]:
        lines.append(f"\nSkipped: {skipped['config']} ({skipped['reason']}).")
    if not meta.get("complete", True):
        lines.append("\nIncomplete: the measurement stopped before every configuration ran.")
    lines += ["", f"tok/s/user with and without DSpark: {meta['speed_command_note']}"]
    return "\n".join(lines) + "\n"
