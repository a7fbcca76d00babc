"""GSM8K files and the few-shot prompt format SGLang's GSM8K benchmark uses.

Prompt = k shots of "Question: {q}\\nAnswer: {a}\\n\\n" (train split, in file order) followed by
"Question: {q}\\nAnswer:" for the test question. Generation stops at STOP_STRINGS.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STOP_STRINGS = ("Question", "</s>", "<|im_end|>")
PUBLIC_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
DEFAULT_DATA_DIR = Path.home() / ".cache" / "sgl_dspark" / "gsm8k"


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; each GSM8K row has "question" and "answer" strings."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GSM8K data file not found: {p}")
    rows = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{p}:{lineno}: row needs 'question' and 'answer' fields")
            rows.append(row)
    return rows


def fewshot_prefix(train_rows: list[dict[str, Any]], num_shots: int) -> str:
    """The first `num_shots` training examples, formatted as solved questions."""
    if num_shots < 0 or num_shots > len(train_rows):
        raise ValueError(f"num_shots must be in [0, {len(train_rows)}], got {num_shots}")
    return "".join(
        f"Question: {row['question']}\nAnswer: {row['answer']}\n\n"
        for row in train_rows[:num_shots]
    )


def build_prompt(prefix: str, question: str) -> str:
    """Few-shot prefix + the open question, ending at "Answer:" for the model to continue."""
    return f"{prefix}Question: {question}\nAnswer:"


def download_default(data_dir: Path = DEFAULT_DATA_DIR) -> tuple[Path, Path]:
    """Fetches the public train/test files into `data_dir` once (like SGLang's script). Returns
    (train_path, test_path). Only the CLI default uses this; tests always pass local paths."""
    import requests  # imported here so the offline code paths never need it

    data_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in ("train", "test"):
        path = data_dir / f"{split}.jsonl"
        if not path.is_file():
            url = PUBLIC_URL.format(split=split)
            logger.info("downloading %s -> %s", url, path)
            resp = requests.get(url, timeout=60)
            resp.raise_for_status()
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(resp.content)
            tmp.replace(path)
        paths.append(path)
    return paths[0], paths[1]
