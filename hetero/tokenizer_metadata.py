"""Read the tokenizer metadata (`tokenizer.*` keys) of a GGUF file without touching its tensors.

`gguf.GGUFReader` builds a numpy view per array element, which costs seconds on a vocabulary of
50k tokens plus 50k merges. The tokenizer needs only the key/value section at the head of the
file, so this walks it directly:

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64 | n_kv x (key, type u32, value)
    string = len u64 | utf-8 bytes            array = elem_type u32 | count u64 | elements

All integers are little-endian unless the version word reads byte-swapped (a big-endian file).
An open `gguf.GGUFReader` is accepted too, so a loader that already parsed the file shares it.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import gguf
import numpy as np

# GGUF value type -> struct code for scalars (8 = string, 9 = array are handled apart).
_SCALAR_CODES = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def _wanted(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.architecture"


class _KVParser:
    """Cursor over the key/value section of a mapped GGUF file."""

    def __init__(self, buf: mmap.mmap | bytes, endian: str, path: str) -> None:
        self.buf, self.endian, self.path, self.off = buf, endian, path, 24

    def _unpack(self, code: str) -> Any:
        value = struct.unpack_from(self.endian + code, self.buf, self.off)[0]
        self.off += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self._unpack("Q")
        if self.off + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF string in the metadata")
        raw = bytes(self.buf[self.off : self.off + n])
        self.off += n
        # Token texts are UTF-8 by the format; a broken byte must not stop the whole load.
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALAR_CODES:
            return self._unpack(_SCALAR_CODES[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} in the metadata")
        etype, count = self._unpack("I"), self._unpack("Q")
        if etype in _SCALAR_CODES:
            dtype = np.dtype(self.endian + _SCALAR_CODES[etype])
            start, self.off = self.off, self.off + dtype.itemsize * count
            if not keep:
                return None
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
        items = [self.value(etype, keep) for _ in range(count)]
        return items if keep else None


def _read_path(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path}: not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
            version = struct.unpack_from("<I", buf, 4)[0]
            # A big-endian file reads its small version number byte-swapped.
            endian = ">" if version & 0xFFFF == 0 else "<"
            version = struct.unpack_from(endian + "I", buf, 4)[0]
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
            n_kv = struct.unpack_from(endian + "Q", buf, 16)[0]
            parser = _KVParser(buf, endian, path)
            out: dict[str, Any] = {}
            try:
                for _ in range(n_kv):
                    key = parser.string()
                    vtype = parser._unpack("I")
                    value = parser.value(vtype, _wanted(key))
                    if _wanted(key):
                        out[key] = value
            except struct.error as e:
                raise ValueError(f"{path}: truncated GGUF metadata ({e})") from e
            return out


def _read_reader(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items() if _wanted(key)}


def read_tokenizer_metadata(source: str | os.PathLike[str] | gguf.GGUFReader) -> dict[str, Any]:
    """Every `tokenizer.*` key (and `general.architecture`) of a GGUF file, arrays as lists."""
    if isinstance(source, gguf.GGUFReader):
        return _read_reader(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no GGUF file at {path}")
        return _read_path(path)
    raise TypeError(f"expected a path or a gguf.GGUFReader, got {type(source).__name__}")
