"""Request sets for the serving benchmark: random token prompts and GSM8K questions."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from benchmark.gsm8k.data import STOP_STRINGS, build_prompt, fewshot_prefix, load_jsonl
from benchmark.serving.client import RequestSpec

logger = logging.getLogger(__name__)


def _lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """n lengths drawn uniformly from [ceil(range_ratio * length), length] (all equal at ratio 1)."""
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in (0, 1], got {range_ratio}")
    low = max(1, int(np.ceil(range_ratio * length)))
    return rng.integers(low, length + 1, size=n)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    seed: int = 0,
    range_ratio: float = 1.0,
    token_range: tuple[int, int] = (10, 1000),
    as_text: bool = False,
    tokenizer: Any = None,
    ignore_eos: bool = True,
) -> list[RequestSpec]:
    """`num_prompts` prompts of uniformly random token ids in `token_range` (half-open).

    Prompts are sent as token ids (exact input length) unless `as_text`; text comes from
    `tokenizer.decode` when one is given, else from placeholder words, whose token count on a
    real tokenizer only approximates `input_len`.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    low, high = token_range
    if not 0 <= low < high:
        raise ValueError(f"token_range must satisfy 0 <= low < high, got {token_range}")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    if as_text and tokenizer is None:
        logger.warning("text prompts without a tokenizer: input lengths are approximate")
    specs = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = rng.integers(low, high, size=int(n_in)).tolist()
        prompt: str | list[int] = ids
        if as_text:
            prompt = (
                tokenizer.decode(ids) if tokenizer is not None else " ".join(f"w{i}" for i in ids)
            )
        specs.append(RequestSpec(prompt, int(n_out), ignore_eos=ignore_eos, prompt_len=int(n_in)))
    return specs


def gsm8k_requests(
    test_path: str,
    num_prompts: int,
    output_len: int,
    *,
    train_path: str | None = None,
    num_shots: int = 0,
    ignore_eos: bool = False,
    offset: int = 0,
) -> list[RequestSpec]:
    """`num_prompts` test questions from index `offset` on, in SGLang's few-shot format (cycling
    through the file), stopping at STOP_STRINGS unless `ignore_eos` forces the full `output_len`."""
    rows = load_jsonl(test_path)
    if not rows:
        raise ValueError(f"no questions in {test_path}")
    prefix = ""
    if num_shots:
        if train_path is None:
            raise ValueError("num_shots > 0 needs train_path")
        prefix = fewshot_prefix(load_jsonl(train_path), num_shots)
    stop = () if ignore_eos else STOP_STRINGS
    return [
        RequestSpec(
            build_prompt(prefix, rows[(offset + i) % len(rows)]["question"]),
            output_len,
            ignore_eos=ignore_eos,
            stop=stop,
        )
        for i in range(num_prompts)
    ]
