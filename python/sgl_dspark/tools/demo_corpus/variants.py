"""Number-varied re-computations of GSM8K-style worked solutions.

A solution marks every calculation as `<<expression=result>>`. Each number of an expression is
the question's number, an earlier calculation's result, or a constant of the wording ("half" is
2, an hour is 60 minutes): question numbers get new values, every calculation is recomputed in
exact rational arithmetic in order, and the question, the solution text and the final
`#### answer` are rewritten with the new values. A variant is kept only when it is unambiguous
and well formed: no value stands for two different quantities, whole-number results stay whole,
non-negative ones stay non-negative, and the final answer is a whole number that is a result of
the last calculation.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

NUMBER = re.compile(
    r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.])\d+(?:\.\d+)?(?![\w])"
)
CALC = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
FINAL = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)\s*$")
# Values that usually come from the wording or units (half, dozen, minutes, percent, weeks ...):
# a question number with one of these values is kept, so recomputed steps keep their meaning.
UNIT_VALUES = frozenset(Fraction(v) for v in (1, 2, 3, 4, 7, 10, 12, 24, 30, 52, 60, 100, 365))

_OPS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def parse_number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def format_number(value: Fraction, like: str) -> str:
    """`value` written like the original `like` (thousands commas, decimal places)."""
    decimals = len(like.split(".")[1]) if "." in like else 0
    if value.denominator != 1 and decimals == 0:
        decimals = 2
    text = f"{float(value):.{decimals}f}" if decimals else str(value.numerator)
    if "," in like:
        whole, _, frac = text.partition(".")
        text = f"{int(whole):,}" + (f".{frac}" if frac else "")
    return text


def evaluate(expression: str, values: dict[str, Fraction]) -> Fraction:
    """Exact value of an arithmetic expression whose number literals are renamed by `values`
    (literal text -> value); only + - * / and parentheses."""
    renamed: dict[str, Fraction] = {}

    def repl(m: re.Match[str]) -> str:
        name = f"v{len(renamed)}"
        renamed[name] = values.get(m.group(0), parse_number(m.group(0)))
        return name

    text = NUMBER.sub(repl, expression.replace("x", "*").replace("×", "*"))
    tree = ast.parse(text.strip(), mode="eval")

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Name) and node.id in renamed:
            return renamed[node.id]
        raise ValueError(f"unsupported expression {expression!r}")

    return ev(tree)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


def _well_formed(old: Fraction, new: Fraction) -> bool:
    if old.denominator == 1 and new.denominator != 1:
        return False
    if old >= 0 > new:
        return False
    # at most two decimal places, like money
    return (new * 100).denominator == 1


def vary(problem: Problem, rng: random.Random, attempts: int = 20) -> Problem | None:
    """A number-varied re-computation of `problem`, or None when it cannot be varied safely."""
    calcs = list(CALC.finditer(problem.answer))
    final = FINAL.search(problem.answer)
    if not calcs or final is None:
        return None
    q_numbers = {parse_number(m.group(0)): m.group(0) for m in NUMBER.finditer(problem.question)}
    variable = [v for v in q_numbers if v not in UNIT_VALUES and v > 0]
    if not variable:
        return None
    try:
        results = [parse_number(c.group(2).strip()) for c in calcs]
        final_value = parse_number(final.group(1))
    except (ValueError, ZeroDivisionError):
        return None
    if final_value != results[-1] or final_value.denominator != 1:
        return None
    # Every value stands for one quantity: a result equal to a varied question number, or two
    # results with one value, would make the rewrite ambiguous.
    if len(set(results)) != len(results) or set(results) & set(variable):
        return None
    for _ in range(attempts):
        new_q = {}
        for v in variable:
            whole = v.denominator == 1
            span = max(1, int(v) // 2) if whole else v / 2
            if whole:
                new = v + rng.randint(-int(span), int(span))
            else:
                new = Fraction(
                    round(float(v + (rng.random() * 2 - 1) * span), 2)
                ).limit_denominator(100)
            new_q[v] = new if new > 0 else v
        if all(new_q[v] == v for v in variable):
            continue
        mapping: dict[Fraction, Fraction] = dict(new_q)
        try:
            new_results = []
            for c, old in zip(calcs, results):
                literals = {
                    m.group(0): mapping.get(parse_number(m.group(0)), parse_number(m.group(0)))
                    for m in NUMBER.finditer(c.group(1))
                }
                value = evaluate(c.group(1), literals)
                if not _well_formed(old, value):
                    raise ValueError("ill-formed result")
                mapping[old] = value
                new_results.append(value)
        except (ValueError, ZeroDivisionError, SyntaxError):
            continue
        if len(set(new_results)) != len(new_results):
            continue
        return Problem(
            _rewrite(problem.question, mapping), _rewrite_answer(problem.answer, mapping)
        )
    return None


def _rewrite(text: str, mapping: dict[Fraction, Fraction]) -> str:
    def repl(m: re.Match[str]) -> str:
        value = parse_number(m.group(0))
        return format_number(mapping[value], m.group(0)) if value in mapping else m.group(0)

    return NUMBER.sub(repl, text)


def _rewrite_answer(answer: str, mapping: dict[Fraction, Fraction]) -> str:
    def calc(m: re.Match[str]) -> str:
        return f"<<{_rewrite(m.group(1), mapping)}={_rewrite(m.group(2), mapping)}>>"

    # Calculations first (their inner text), then the prose around them.
    parts = []
    last = 0
    for m in CALC.finditer(answer):
        parts.append(_rewrite(answer[last : m.start()], mapping))
        parts.append(calc(m))
        last = m.end()
    parts.append(_rewrite(answer[last:], mapping))
    return "".join(parts)


def check_solution(problem: Problem) -> bool:
    """Every calculation's result equals its expression's value and the final answer is the
    last result (what a variant must satisfy)."""
    calcs = list(CALC.finditer(problem.answer))
    final = FINAL.search(problem.answer)
    if not calcs or final is None:
        return False
    try:
        for c in calcs:
            if evaluate(c.group(1), {}) != parse_number(c.group(2).strip()):
                return False
        return parse_number(final.group(1)) == parse_number(calcs[-1].group(2).strip())
    except (ValueError, ZeroDivisionError, SyntaxError):
        return False
