"""Safetensors discovery and lazy tensor access for a checkpoint directory."""

from __future__ import annotations

import glob
import io
import json
import os
import struct
from contextlib import ExitStack
from types import TracebackType
from typing import Any, NamedTuple

import torch

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


# safetensors dtype strings -> torch dtypes.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_MAX_HEADER = 100 * 2**20


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """(the JSON header, the offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        size = struct.unpack("<Q", prefix)[0]
        if size > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {size} bytes is implausible")
        try:
            header = json.loads(f.read(size))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed safetensors header ({e})") from e
    header.pop("__metadata__", None)
    return header, 8 + size


class SafetensorsReader:
    """The tensors of every shard, read one at a time by plain file reads (no memory map), so
    the host holds only the tensor being read: a checkpoint larger than the host's memory loads
    as well as a small one. `get(name, rows)` reads a row range of a tensor (a slice of its
    bytes), e.g. one rank's share.

    Use as a context manager. `infos` maps every tensor name to its `TensorInfo`; a name stored
    in two shards raises ValueError.
    """

    def __init__(self, model_path: str) -> None:
        self.files = find_safetensors_files(model_path)
        self._stack = ExitStack()
        self._handles: dict[str, io.BufferedReader] = {}
        self._offsets: dict[str, tuple[int, int]] = {}  # name -> (absolute start, end)
        self.infos: dict[str, TensorInfo] = {}

    def __enter__(self) -> SafetensorsReader:
        try:
            for path in self.files:
                header, data_start = _read_header(path)
                self._handles[path] = self._stack.enter_context(open(path, "rb"))  # noqa: SIM115
                for name, entry in header.items():
                    if name in self.infos:
                        raise ValueError(
                            f"tensor {name!r} is stored twice: in {self.infos[name].file!r} and "
                            f"{path!r}"
                        )
                    begin, end = entry["data_offsets"]
                    self.infos[name] = TensorInfo(path, entry["dtype"], tuple(entry["shape"]))
                    self._offsets[name] = (data_start + begin, data_start + end)
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

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """One tensor (CPU) by its stored name; `rows`: only rows [start, stop) of its first
        dim (read as one byte range)."""
        info = self.infos[name]
        dtype = _DTYPES.get(info.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: unsupported stored dtype {info.dtype}")
        begin, end = self._offsets[name]
        shape = list(info.shape)
        if rows is not None and shape:
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"tensor {name!r}: row slices must be contiguous")
            row_bytes = (end - begin) // max(shape[0], 1)
            begin, end = begin + start * row_bytes, begin + max(stop, start) * row_bytes
            shape[0] = max(stop - start, 0)
        out = torch.empty(end - begin, dtype=torch.uint8)
        handle = self._handles[info.file]
        handle.seek(begin)
        if end > begin and handle.readinto(out.numpy().data) != end - begin:
            raise ValueError(f"tensor {name!r}: {info.file} is truncated")
        return out.view(dtype).reshape(shape)


__all__ = ["INDEX_FILE", "SafetensorsReader", "TensorInfo", "find_safetensors_files"]
