"""sglang-dspark: DeepSeek-V4 serving with DSpark speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_dspark.srt.entrypoints.engine import Engine

__all__ = ["Engine"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: `import sgl_dspark` must stay cheap (no torch import) for tools and kernels.
    if name == "Engine":
        from sgl_dspark.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
