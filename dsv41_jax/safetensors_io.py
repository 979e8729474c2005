"""Reading DeepSeek safetensors files as raw numpy arrays (every dtype, F8_E8M0 included).

The header is parsed directly and tensors are memory-mapped, so F8_E4M3 / F8_E8M0 / I8-packed
fp4 tensors come back as their raw bytes with an exact dtype (ml_dtypes for fp8, uint8 for
E8M0 scales), never through a numeric cast.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": np.uint8,
}


class SafetensorsError(ValueError):
    pass


def read_header(path: str) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise SafetensorsError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise SafetensorsError(f"no such file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsFile:
    """One .safetensors file: ``names``, ``info(name) -> (dtype_str, shape)``, ``get(name)``."""

    def __init__(self, path: str):
        self.path = path
        self.header, self.data_start = read_header(path)
        self._mm = None

    @property
    def names(self) -> list[str]:
        return list(self.header)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        h = self.header[name]
        return h["dtype"], tuple(h["shape"])

    def get(self, name: str) -> np.ndarray:
        h = self.header[name]
        if h["dtype"] not in DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {name} has unsupported dtype {h['dtype']}")
        dt = np.dtype(DTYPES[h["dtype"]])
        a, b = h["data_offsets"]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._mm[self.data_start + a:self.data_start + b]
        n = int(np.prod(h["shape"])) if h["shape"] else 1
        if buf.size != n * dt.itemsize:
            raise SafetensorsError(f"{self.path}: tensor {name} has {buf.size} bytes, expected {n * dt.itemsize}")
        return np.asarray(buf).view(dt).reshape(h["shape"])


class Checkpoint:
    """A checkpoint directory (model.safetensors.index.json + shards, or one model.safetensors)."""

    def __init__(self, directory: str):
        self.directory = directory
        idx = os.path.join(directory, "model.safetensors.index.json")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if os.path.exists(idx):
            with open(idx) as f:
                wm = json.load(f).get("weight_map", {})
            for name, fn in wm.items():
                self.where[name] = fn
            for fn in sorted(set(wm.values())):
                p = os.path.join(directory, fn)
                if not os.path.exists(p):
                    raise SafetensorsError(f"{idx} names shard {fn}, which does not exist")
                self.files[fn] = SafetensorsFile(p)
        else:
            files = sorted(x for x in os.listdir(directory) if x.endswith(".safetensors")) if os.path.isdir(directory) else []
            if not files:
                raise SafetensorsError(f"{directory}: no model.safetensors.index.json and no *.safetensors file")
            for fn in files:
                sf = SafetensorsFile(os.path.join(directory, fn))
                self.files[fn] = sf
                for name in sf.names:
                    self.where[name] = fn

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def info(self, name: str):
        return self.files[self.where[name]].info(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise KeyError(name)
        return self.files[self.where[name]].get(name)
