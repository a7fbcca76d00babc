"""Safetensors discovery and lazy tensor access for a checkpoint directory."""

from __future__ import annotations

import glob
import json
import os
from contextlib import ExitStack
from types import TracebackType
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class TensorInfo(NamedTuple):
    """Header facts of one stored tensor (read without loading its data)."""

    file: str
    dtype: str  # safetensors dtype string: "BF16", "F32", "F8_E4M3", "F8_E8M0", "U8", "I8", ...
    shape: tuple[int, ...]


def find_safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's safetensors files, in a stable order.

    With `model.safetensors.index.json`, the shards named in its `weight_map`; otherwise the
    weight files by HF's naming (`model.safetensors`, or `model-*-of-*.safetensors` shards), and
    only when there are none every `*.safetensors` file in the directory (so other safetensors
    files beside the model's, e.g. test data, are not read as weights). Raises ValueError when
    there are none or a shard named by the index is missing.
    """
    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory")
    index_path = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                index = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{index_path}: malformed JSON ({e})") from e
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: field 'weight_map' is missing or empty")
        files = []
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(model_path, shard)
            if not os.path.isfile(path):
                raise ValueError(f"{index_path}: shard {shard!r} is listed but missing")
            files.append(path)
        return files
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_path, "model-*-of-*.safetensors")))
    files = files or sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model directory {model_path!r}")
    return files


class SafetensorsReader:
    """Open handles on every shard; tensors are read one at a time (memory-mapped).

    Use as a context manager. `infos` maps every tensor name to its `TensorInfo`; a name stored
    in two shards raises ValueError.
    """

    def __init__(self, model_path: str) -> None:
        self.files = find_safetensors_files(model_path)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self.infos: dict[str, TensorInfo] = {}

    def __enter__(self) -> SafetensorsReader:
        try:
            for path in self.files:
                handle = self._stack.enter_context(safe_open(path, framework="pt"))
                self._handles[path] = handle
                for name in handle.keys():
                    if name in self.infos:
                        raise ValueError(
                            f"tensor {name!r} is stored twice: in {self.infos[name].file!r} and "
                            f"{path!r}"
                        )
                    view = handle.get_slice(name)
                    self.infos[name] = TensorInfo(path, view.get_dtype(), tuple(view.get_shape()))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()
        self._handles.clear()

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (CPU) by its stored name."""
        info = self.infos[name]
        return self._handles[info.file].get_tensor(name)


__all__ = ["INDEX_FILE", "SafetensorsReader", "TensorInfo", "find_safetensors_files"]
