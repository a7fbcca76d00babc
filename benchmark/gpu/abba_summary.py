"""The rounds of an ABBA stage read together: each round's decode ms/token, each side's mean,
the head's speedup, and whether the rounds produced the same greedy tokens (within a side, a
repeat of one tree must; across sides, the same tokens say the change kept the bits).

    python benchmark/gpu/abba_summary.py ROUNDS_DIR [--out FILE]

ROUNDS_DIR holds one directory per round, named `<round>_<side>` (side `base` or `head`), each
with the `native_decode_<config>.json` of `bench_native.py decode` (one row: one system at one
batch size).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_rounds(rounds_dir: Path) -> list[dict]:
    """[{round, side, system, ms, ids}] in round order, from each round's one decode row."""
    rounds = []
    for path in sorted(rounds_dir.glob("*_*/native_decode_*.json")):
        number, side = path.parent.name.split("_", 1)
        rows = json.loads(path.read_text())["rows"]
        if len(rows) != 1:
            raise ValueError(f"{path}: expected one row, got {len(rows)}")
        row = rows[0]
        rounds.append(
            {
                "round": int(number),
                "side": side,
                "system": row["system"],
                "ms": float(row["decode_ms_per_token"]),
                "ids": row.get("ids"),
            }
        )
    return sorted(rounds, key=lambda r: r["round"])


def summary(rounds: list[dict]) -> str:
    """A markdown table of the rounds and the sides' means, the speedup and the token checks."""
    lines = ["| round | side | system | decode ms/token |", "|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['side']} | {r['system']} | {r['ms']:.3f} |" for r in rounds]
    sides = {s: [r for r in rounds if r["side"] == s] for s in ("base", "head")}
    if not all(sides.values()):
        return "\n".join(lines + ["", "(a side has no rounds: no comparison)"]) + "\n"
    mean = {s: statistics.fmean(r["ms"] for r in rs) for s, rs in sides.items()}
    lines += [
        "",
        f"base mean {mean['base']:.3f} ms/token, head mean {mean['head']:.3f}: head speedup "
        f"**{mean['base'] / mean['head']:.3f}x**",
    ]
    if all(r["ids"] is not None for r in rounds):
        repeat = all(r["ids"] == rs[0]["ids"] for rs in sides.values() for r in rs)
        across = sides["base"][0]["ids"] == sides["head"][0]["ids"]
        lines.append(
            f"greedy tokens: repeats of a side equal {repeat}; base and head equal {across}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rounds_dir", type=Path)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    text = summary(read_rounds(a.rounds_dir))
    if a.out:
        a.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
