"""Models shipped inside the package as Hugging Face directories, served by name.

`demo`: a small DeepSeek-V4.1 (about 19M parameters, every V4.1 layer role) trained on
grade-school math word problems, with its trained DSpark draft in `dspark/`
(`sgl_dspark/shipped_models/demo/`; how it was trained: its `README.md`). `--model-path demo`
serves that directory; the served model name stays `demo`.
"""

from __future__ import annotations

import os

SHIPPED_ROOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "shipped_models"
)
SHIPPED_MODELS = ("demo",)


def shipped_model_dir(model_path: str) -> str | None:
    """The directory of shipped model `model_path`, or None when it names no shipped model."""
    if model_path not in SHIPPED_MODELS:
        return None
    path = os.path.join(SHIPPED_ROOT, model_path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"--model-path {model_path!r}: the shipped model's files are missing from {path} "
            "(reinstall the package)"
        )
    return path


__all__ = ["SHIPPED_MODELS", "shipped_model_dir"]
