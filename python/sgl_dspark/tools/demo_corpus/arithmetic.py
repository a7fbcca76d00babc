"""Generated arithmetic word problems with worked answers in GSM8K's format (calculations as
`<<expression=result>>`, the answer after `####`)."""

from __future__ import annotations

import random
from collections.abc import Callable

from sgl_dspark.tools.demo_corpus.variants import Problem

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
_ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "stamps", "shells")


def _sum_problem(r: random.Random) -> Problem:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b = r.randint(2, 500), r.randint(2, 500)
    return Problem(
        f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        f"{name} has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}",
    )


def _difference_problem(r: random.Random) -> Problem:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    a = r.randint(20, 900)
    b = r.randint(1, a - 1)
    return Problem(
        f"{name} had {a} {item} and gave away {b}. How many {item} are left?",
        f"{name} has {a}-{b} = <<{a}-{b}={a - b}>>{a - b} {item} left.\n#### {a - b}",
    )


def _price_problem(r: random.Random) -> Problem:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    n, price, paid_extra = r.randint(2, 30), r.randint(1, 40), r.randint(1, 50)
    cost = n * price
    paid = cost + paid_extra
    return Problem(
        f"{name} buys {n} {item} at ${price} each and pays with ${paid}. How much change does "
        f"{name} get?",
        f"The {item} cost {n}*{price} = $<<{n}*{price}={cost}>>{cost}.\n"
        f"The change is {paid}-{cost} = $<<{paid}-{cost}={paid_extra}>>{paid_extra}.\n"
        f"#### {paid_extra}",
    )


def _share_problem(r: random.Random) -> Problem:
    item = r.choice(_ITEMS)
    people, each, extra = r.randint(2, 12), r.randint(2, 40), r.randint(2, 60)
    total = people * each
    return Problem(
        f"A box holds {total} {item}, shared equally by {people} friends. Each friend then finds "
        f"{extra} more. How many {item} does each friend have?",
        f"Each friend gets {total}/{people} = <<{total}/{people}={each}>>{each} {item}.\n"
        f"With the ones found, each has {each}+{extra} = <<{each}+{extra}={each + extra}>>"
        f"{each + extra} {item}.\n#### {each + extra}",
    )


def _percent_problem(r: random.Random) -> Problem:
    name = r.choice(_NAMES)
    price = r.randint(1, 40) * 20
    pct = r.choice((5, 10, 15, 20, 25, 30, 40, 50))
    off = price * pct // 100
    return Problem(
        f"A bike costs ${price}. {name} gets a {pct}% discount. How much does {name} pay?",
        f"The discount is {price}*{pct}/100 = $<<{price}*{pct}/100={off}>>{off}.\n"
        f"{name} pays {price}-{off} = $<<{price}-{off}={price - off}>>{price - off}.\n"
        f"#### {price - off}",
    )


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    _sum_problem,
    _difference_problem,
    _price_problem,
    _share_problem,
    _percent_problem,
)


def arithmetic_problems(count: int, seed: int) -> list[Problem]:
    r = random.Random(seed)
    return [r.choice(TEMPLATES)(r) for _ in range(count)]
