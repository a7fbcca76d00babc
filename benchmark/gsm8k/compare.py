"""Paired comparison of GSM8K runs: the non-inferiority gate for a kernel or runtime change.

    python -m benchmark.gsm8k.compare --baseline runs/base_1 runs/base_2 \
        --candidate runs/cand_1 runs/cand_2 [--aa runs/base_1 runs/base_3] [--require-identical]

Runs are paired in the order given (baseline i with candidate i) and must hold the same questions.
Reports per pair and pooled: correct counts, answers that differ, raw outputs that differ, the
discordant counts (only baseline right / only candidate right), McNemar (exact and chi-square with
continuity), and a one-sided lower bound on the accuracy difference.

Gate: with --require-identical, pass iff no extracted answer differs (the right gate for bit-exact
changes under greedy decoding); otherwise pass iff the pooled lower bound exceeds -margin. An A/A pair
(--aa: two runs of the same build) is printed beside it as the disagreement reference.
Exit code 0 = pass, 1 = fail.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmark.gsm8k.run_eval import PER_QUESTION_FILE
from benchmark.stats import mcnemar, paired_proportion_lower_bound


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Per-question records from a run directory (or its per_question.jsonl), sorted by index."""
    p = Path(path)
    if p.is_dir():
        p = p / PER_QUESTION_FILE
    if not p.is_file():
        raise ValueError(f"no per-question file at {p}")
    with p.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return sorted(records, key=lambda r: r["index"])


def compare_records(
    baseline: Sequence[dict[str, Any]], candidate: Sequence[dict[str, Any]]
) -> dict[str, int]:
    """Counts for one baseline/candidate pair of runs over the same questions."""
    if [r["question"] for r in baseline] != [r["question"] for r in candidate]:
        raise ValueError("the two runs do not hold the same questions in the same order")
    only_base = sum(a["correct"] and not b["correct"] for a, b in zip(baseline, candidate))
    only_cand = sum(b["correct"] and not a["correct"] for a, b in zip(baseline, candidate))
    return {
        "n": len(baseline),
        "correct_baseline": sum(bool(r["correct"]) for r in baseline),
        "correct_candidate": sum(bool(r["correct"]) for r in candidate),
        "differing_answers": sum(a["pred"] != b["pred"] for a, b in zip(baseline, candidate)),
        "differing_outputs": sum(a["output"] != b["output"] for a, b in zip(baseline, candidate)),
        "only_baseline_correct": only_base,
        "only_candidate_correct": only_cand,
    }


def pooled_verdict(
    pairs: Sequence[dict[str, int]],
    margin: float = 0.01,
    alpha: float = 0.05,
    require_identical: bool = False,
) -> dict[str, Any]:
    """Pools pair counts and applies the gate described in the module docstring."""
    if not pairs:
        raise ValueError("need at least one baseline/candidate pair")
    pooled = {k: sum(p[k] for p in pairs) for k in pairs[0]}
    test = mcnemar(pooled["only_baseline_correct"], pooled["only_candidate_correct"])
    diff, lower = paired_proportion_lower_bound(
        pooled["only_baseline_correct"], pooled["only_candidate_correct"], pooled["n"], alpha
    )
    passed = pooled["differing_answers"] == 0 if require_identical else lower > -margin
    return {
        **pooled,
        "correct_delta": pooled["correct_candidate"] - pooled["correct_baseline"],
        "mcnemar_p_exact": test.p_exact,
        "mcnemar_chi2": test.chi2,
        "mcnemar_p_chi2": test.p_chi2,
        "accuracy_diff": diff,
        "accuracy_diff_lower_bound": lower,
        "margin": margin,
        "alpha": alpha,
        "gate": "identical answers" if require_identical else f"lower bound > -{margin}",
        "passed": passed,
    }


def format_report(
    pairs: Sequence[dict[str, int]], verdict: dict[str, Any], aa: dict[str, int] | None
) -> str:
    lines = [
        "pair  n     correct(base)  correct(cand)  diff-answers  diff-outputs  only-base  only-cand"
    ]
    for i, p in enumerate(pairs):
        lines.append(
            f"{i:<5} {p['n']:<5} {p['correct_baseline']:<14} {p['correct_candidate']:<14} "
            f"{p['differing_answers']:<13} {p['differing_outputs']:<13} "
            f"{p['only_baseline_correct']:<10} {p['only_candidate_correct']}"
        )
    v = verdict
    lines += [
        f"pooled: candidate - baseline correct = {v['correct_delta']:+d} of {v['n']}; "
        f"{v['differing_answers']} answers differ",
        f"McNemar: exact p = {v['mcnemar_p_exact']:.4g}, chi2 = {v['mcnemar_chi2']:.3f} "
        f"(p = {v['mcnemar_p_chi2']:.4g})",
        f"accuracy diff = {100 * v['accuracy_diff']:+.2f} pt, one-sided {100 * (1 - v['alpha']):.0f}% "
        f"lower bound {100 * v['accuracy_diff_lower_bound']:+.2f} pt",
    ]
    if aa is not None:
        lines.append(
            f"A/A reference: {aa['differing_answers']} of {aa['n']} answers differ, "
            f"{aa['differing_outputs']} outputs differ"
        )
    lines.append(f"gate ({v['gate']}): {'PASS' if v['passed'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--baseline", nargs="+", required=True, help="run dirs or per_question.jsonl files"
    )
    p.add_argument("--candidate", nargs="+", required=True)
    p.add_argument(
        "--aa", nargs=2, default=None, metavar=("RUN1", "RUN2"), help="two baseline runs"
    )
    p.add_argument("--margin", type=float, default=0.01, help="non-inferiority margin (fraction)")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--require-identical", action="store_true")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if len(args.baseline) != len(args.candidate):
        raise ValueError(
            "--baseline and --candidate need the same number of runs (paired in order)"
        )
    pairs = [
        compare_records(load_records(a), load_records(b))
        for a, b in zip(args.baseline, args.candidate)
    ]
    verdict = pooled_verdict(pairs, args.margin, args.alpha, args.require_identical)
    aa = compare_records(load_records(args.aa[0]), load_records(args.aa[1])) if args.aa else None
    print(format_report(pairs, verdict, aa), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({"pairs": pairs, "pooled": verdict, "aa": aa}, indent=2)
        )
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
