"""``sglang serve`` arguments -> ``python -m sgl_dspark.launch_server`` arguments.

sglang-dspark's CLI uses SGLang's flag names, so most flags pass through unchanged. Of the
flags only SGLang has: a few are mapped (`MAPPED`), a few are accepted only at the value that
sglang-dspark always runs with (`SINGLE_VALUE`: no data or pipeline parallelism), a few mean
nothing to it and are dropped (`DROPPED`), and every other SGLang flag is refused by name.
Tensor and expert parallelism on one host (`--tp-size`, `--ep-size`, `--nnodes 1`) are
sglang-dspark's own flags and pass through. A flag neither knows is left for
sglang-dspark's parser, which names it and suggests the closest flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class ArgvError(ValueError):
    """A flag of the ``sglang serve`` command line that sglang-dspark cannot honour."""


# Parallelism sglang-dspark does not have: one model replica, no pipeline stages.
SINGLE_VALUE = {
    "--dp-size": "1",
    "--data-parallel-size": "1",
    "--pp-size": "1",
    "--pipeline-parallel-size": "1",
}
# Flags whose meaning sglang-dspark always satisfies or that only concern SGLang's own kernels.
DROPPED = {
    "--trust-remote-code": "sglang-dspark reads config.json and safetensors only, no remote code",
    "--skip-server-warmup": "sglang-dspark's server warms itself up before announcing ready",
}


def _num_draft_tokens(value: str, ours: dict[str, str]) -> list[str]:
    """SGLang's verify window (gamma + 1) -> sglang-dspark's block size gamma."""
    try:
        window = int(value)
    except ValueError as exc:
        raise ArgvError(
            f"--speculative-num-draft-tokens: expected an integer, got {value!r}"
        ) from exc
    if window < 2:
        raise ArgvError(f"--speculative-num-draft-tokens must be >= 2 (gamma + 1), got {window}")
    given = ours.get("--speculative-dspark-block-size")
    if given is not None and given != str(window - 1):
        raise ArgvError(
            f"--speculative-num-draft-tokens {window} disagrees with "
            f"--speculative-dspark-block-size {given} (the window is gamma + 1)"
        )
    return [] if given is not None else ["--speculative-dspark-block-size", str(window - 1)]


def _renamed(ours: str) -> Callable[[str, dict[str, str]], list[str]]:
    """SGLang's long name of one of sglang-dspark's flags."""
    return lambda value, given: [ours, value]


MAPPED: dict[str, Callable[[str, dict[str, str]], list[str]]] = {
    "--speculative-num-draft-tokens": _num_draft_tokens,
    "--tensor-parallel-size": _renamed("--tp-size"),
    "--expert-parallel-size": _renamed("--ep-size"),
}


@dataclass
class Translation:
    argv: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _arity(action: argparse.Action) -> int | str:
    """Values a flag takes: 0, 1, or '*' (until the next flag)."""
    if action.nargs == 0:
        return 0
    if action.nargs is None:
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    return "*"


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def translate(
    argv: Sequence[str],
    ours: argparse.ArgumentParser,
    sglang: argparse.ArgumentParser,
    plugin_flags: Sequence[str] = (),
) -> Translation:
    """Rewrite ``argv`` for sglang-dspark's parser ``ours``; ``sglang`` is SGLang's server parser
    (it tells which flags are SGLang's and how many values they take). ``plugin_flags``: this
    plugin's ``--enable-dspark-*`` switches, which sglang-dspark's own server does not need."""
    our_opts, sglang_opts = _options(ours), _options(sglang)
    out = Translation()
    given = _given_values(argv, our_opts)
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            out.argv.append(token)
            i += 1
            continue
        flag, eq, inline = token.partition("=")
        if flag in our_opts:
            count = _arity(our_opts[flag])
            values, i = _take(tokens, i, inline if eq else None, count)
            out.argv += [flag, *values]
            continue
        if flag in plugin_flags:
            out.notes.append(f"{flag}: dropped (sglang-dspark's server always runs its kernels)")
            i += 1
            continue
        action = sglang_opts.get(flag)
        if action is None:  # unknown to both: sglang-dspark's parser names it
            out.argv.append(token)
            i += 1
            continue
        values, i = _take(tokens, i, inline if eq else None, _arity(action))
        out.argv += _sglang_only(flag, values, given, out)
    return out


def _sglang_only(
    flag: str, values: list[str], given: dict[str, str], out: Translation
) -> list[str]:
    if flag in MAPPED:
        if len(values) != 1:
            raise ArgvError(f"{flag}: expected one value")
        mapped = MAPPED[flag](values[0], given)
        out.notes.append(
            f"{flag} {values[0]}: mapped to {' '.join(mapped) or 'the given block size'}"
        )
        return mapped
    if flag in SINGLE_VALUE:
        if values != [SINGLE_VALUE[flag]]:
            raise ArgvError(
                f"{flag} {' '.join(values)}: sglang-dspark has no data or pipeline "
                "parallelism (it runs --tp-size/--ep-size ranks on one host); for those run "
                "SGLang's own server with this plugin's --enable-dspark-* kernel hooks"
            )
        out.notes.append(f"{flag} {values[0]}: accepted (the only value sglang-dspark runs)")
        return []
    if flag in DROPPED:
        out.notes.append(f"{flag}: dropped ({DROPPED[flag]})")
        return []
    raise ArgvError(
        f"{flag}: an SGLang server option that sglang-dspark does not implement "
        "(see `sglang serve --model-type dspark --help` for the options it takes)"
    )


def _take(tokens: list[str], i: int, inline: str | None, count: int | str) -> tuple[list[str], int]:
    """The values of the flag at ``tokens[i]`` and the index after them."""
    if inline is not None:
        return [inline], i + 1
    j = i + 1
    if count == "*":
        while j < len(tokens) and not tokens[j].startswith("--"):
            j += 1
        return tokens[i + 1 : j], j
    assert isinstance(count, int)
    values = tokens[j : j + count]
    if len(values) < count:
        raise ArgvError(f"{tokens[i]}: expected {count} value(s)")
    return values, j + count


def _given_values(argv: Sequence[str], our_opts: dict[str, argparse.Action]) -> dict[str, str]:
    """Single values of sglang-dspark's own flags as given (for cross-flag checks)."""
    given: dict[str, str] = {}
    tokens = list(argv)
    for i, token in enumerate(tokens):
        flag, eq, inline = token.partition("=")
        if flag in our_opts and _arity(our_opts[flag]) == 1:
            if eq:
                given[flag] = inline
            elif i + 1 < len(tokens):
                given[flag] = tokens[i + 1]
    return given
