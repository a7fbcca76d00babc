"""Tokenizers (byte-level for the tiny model, HF `tokenizer.json` otherwise) and streaming
detokenisation with stop strings."""

from __future__ import annotations

from sgl_dspark.srt.tokenizer.base import TokenizerLike
from sgl_dspark.srt.tokenizer.byte_tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer
from sgl_dspark.srt.tokenizer.detokenizer import (
    IncrementalDetokenizer,
    StreamDelta,
    find_stop,
    stop_prefix_len,
)
from sgl_dspark.srt.tokenizer.hf_tokenizer import (
    MARKER_FILE,
    TINY_MODEL_NAME,
    HFTokenizer,
    TransformersTokenizer,
    get_tokenizer,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "MARKER_FILE",
    "TINY_MODEL_NAME",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "StreamDelta",
    "TokenizerLike",
    "TransformersTokenizer",
    "find_stop",
    "get_tokenizer",
    "stop_prefix_len",
]
