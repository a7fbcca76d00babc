"""Build the demo models' training text and tokenizer.

    python -m sgl_dspark.tools.build_demo_corpus --gsm8k-train train.jsonl --output DIR \\
        [--variants 3] [--arithmetic 20000] [--vocab-size 8192] [--seed 0]

Sources, all usable for training a model that ships: GSM8K's train split (MIT license; the test
split is refused), number-varied re-computations of its worked solutions, and generated
arithmetic problems. Writes DIR/corpus.jsonl (one {"text", "source"} per line, shuffled),
DIR/prompts.jsonl (the train questions, for draft training), DIR/tokenizer.json +
tokenizer_config.json, DIR/corpus_stats.json and DIR/DATA_LICENSE.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random

from sgl_dspark.tools.demo_corpus.arithmetic import arithmetic_problems
from sgl_dspark.tools.demo_corpus.tokenizer import save_tokenizer, train_tokenizer
from sgl_dspark.tools.demo_corpus.variants import Problem, check_solution, vary

logger = logging.getLogger(__name__)

LICENSE_NOTE = """# Data sources of the demo models

- GSM8K, train split only (grade-school math word problems with worked solutions), MIT License,
  Copyright (c) 2021 OpenAI. The test split is never used for training.
- Number-varied re-computations of those train solutions: the same problems with other numbers,
  every calculation recomputed (derived from the MIT-licensed train split).
- Generated arithmetic word problems (produced by this repository's code).
"""


def problem_text(p: Problem) -> str:
    return f"Question: {p.question}\nAnswer: {p.answer}"


def load_gsm8k_train(path: str) -> list[Problem]:
    if "test" in os.path.basename(path).lower():
        raise ValueError(f"--gsm8k-train {path!r} looks like a test split; use the train split")
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if not isinstance(obj.get("question"), str) or not isinstance(obj.get("answer"), str):
                raise ValueError(f"{path}:{lineno}: needs 'question' and 'answer' strings")
            out.append(Problem(obj["question"], obj["answer"]))
    return out


def build(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    train = load_gsm8k_train(args.gsm8k_train)
    records = [{"text": problem_text(p), "source": "gsm8k_train"} for p in train]
    variants = 0
    for p in train:
        for _ in range(args.variants):
            v = vary(p, rng)
            if v is not None and check_solution(v):
                records.append({"text": problem_text(v), "source": "gsm8k_train_varied"})
                variants += 1
    for p in arithmetic_problems(args.arithmetic, args.seed + 1):
        records.append({"text": problem_text(p), "source": "arithmetic"})
    rng.shuffle(records)
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "corpus.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(args.output, "prompts.jsonl"), "w") as f:
        for p in train:
            f.write(json.dumps({"prompt": f"Question: {p.question}\nAnswer:"}) + "\n")
    tok = train_tokenizer((r["text"] for r in records), args.vocab_size)
    save_tokenizer(tok, args.output)
    n_tokens = sum(len(tok.encode(r["text"]).ids) for r in records)
    stats = {
        "records": len(records),
        "gsm8k_train": len(train),
        "gsm8k_train_varied": variants,
        "arithmetic": args.arithmetic,
        "tokens": n_tokens,
        "vocab_size": tok.get_vocab_size(),
        "seed": args.seed,
    }
    with open(os.path.join(args.output, "corpus_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    with open(os.path.join(args.output, "DATA_LICENSE.md"), "w") as f:
        f.write(LICENSE_NOTE)
    logger.info("demo corpus: %s", stats)
    return stats


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gsm8k-train", required=True, help="GSM8K train split (JSON lines)")
    p.add_argument("--output", required=True)
    p.add_argument("--variants", type=int, default=3, help="number-varied copies per problem")
    p.add_argument("--arithmetic", type=int, default=20000, help="generated problems")
    p.add_argument("--vocab-size", type=int, default=8192, help="a power of two")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    return build(args)


if __name__ == "__main__":
    main()
