"""A small, fast GGUF reader: metadata as Python values, tensors as memory-mapped arrays.

The `gguf` package's reader builds a numpy view per metadata part (seconds for a
49k-token vocabulary); this one walks the header once with struct. Dequantisation
still uses `gguf.quants`, the reference implementation.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    qtype: int            # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order: (rows, ..., row length)
    data: np.ndarray      # raw bytes [rows, bytes per row] (uint8), or F32/F16 values


class GGUFReader:
    """Parse a GGUF file's header; tensor data stays in the memory map until read."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mm[:4] != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        try:
            self._parse()
        except (struct.error, IndexError) as e:
            raise ValueError(f"truncated or corrupt GGUF header ({e})") from e

    def _parse(self) -> None:
        self._pos = 4
        version, = self._unpack("I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self._unpack("QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            vtype, = self._unpack("I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims, = self._unpack("I")
            dims = self._unpack("Q" * n_dims)
            qtype, offset = self._unpack("IQ")
            infos.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, qtype, start + off)
                        for name, dims, qtype, off in infos]

    def _unpack(self, fmt: str) -> tuple:
        vals = struct.unpack_from("<" + fmt, self._mm, self._pos)
        self._pos += struct.calcsize("<" + fmt)
        return vals

    def _string(self) -> str:
        n, = struct.unpack_from("<Q", self._mm, self._pos)
        s = self._mm[self._pos + 8:self._pos + 8 + n].decode("utf-8", errors="replace")
        self._pos += 8 + n
        return s

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row: _string's loop with its lookups hoisted."""
        mm, pos, out = self._mm, self._pos, []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            n, = length(mm, pos)
            out.append(mm[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("IQ")
            if etype in _NUMPY:
                arr = np.frombuffer(self._mm, dtype=_NUMPY[etype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            if etype == _STRING:  # a tokenizer's vocabulary and merges: ~100k of them
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        raise ValueError(f"unknown GGUF metadata type {vtype}")

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: int, offset: int) -> GGUFTensor:
        import gguf

        t = gguf.GGMLQuantizationType(qtype)
        block, type_size = gguf.GGML_QUANT_SIZES[t]
        shape = tuple(reversed(dims))  # ggml lists the fastest-varying dimension first
        n_bytes = int(np.prod(dims)) // block * type_size
        if offset + n_bytes > len(self._mm):
            raise ValueError(f"tensor {name} runs past the end of the file")
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=n_bytes, offset=offset)
        if t == gguf.GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif t == gguf.GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], -1)
        return GGUFTensor(name, qtype, shape, data)
