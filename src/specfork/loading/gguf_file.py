"""A GGUF file read once: the header, metadata and tensor directory parsed from a memory map.

The ``gguf`` package's reader builds a numpy memmap view for every field part (about half a
million views for a 49k-token vocabulary, ~5 s per open); this one walks the header with
``struct`` and hands out numpy views of the map only for tensor data. Arrays of strings (the
vocabulary and the merges) are only located while parsing and decoded on first use, so reading
the architecture alone never decodes them.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata
count u64; each metadata entry is a string key, a value type u32 and the value; then one entry
per tensor (name, dimension count u32, dimensions u64 innermost first, type u32, data offset
u64); tensor data starts at the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specfork.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types.
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}

# Tensor types read without the gguf package: name, values per block, bytes per block.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
              30: ("BF16", 1, 2)}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor's directory entry and a read-only view of its bytes in the map.

    ``shape`` is in PyTorch (row-major) order, outermost first. ``data`` is float32 / float16 in
    ``shape`` for F32 / F16, and [rows..., row_bytes] uint8 for every other type (BF16 and the
    block-quantised ones)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str
    data: np.ndarray


class _StringArray:
    """Where an array of strings lies in the map; decoded on first use."""

    __slots__ = ("buf", "offset", "count", "_values")

    def __init__(self, buf, offset: int, count: int) -> None:
        self.buf, self.offset, self.count, self._values = buf, offset, count, None

    def values(self) -> list[str]:
        if self._values is None:
            buf, off, out = self.buf, self.offset, []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(self.count):
                (n,) = unpack(buf, off)
                out.append(str(buf[off + 8 : off + 8 + n], "utf-8", "replace"))
                off += 8 + n
            self._values = out
        return self._values


def _plain(value):
    """A metadata value as plain Python: lists for arrays (of arrays too)."""
    if isinstance(value, _StringArray):
        return value.values()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class GGUFFile:
    """Parse ``path``'s header once; ``get(key)`` returns metadata values (lists for arrays),
    ``tensors`` the tensor directory with views of the data."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._pos = 0
        try:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e}") from None
        try:
            self._parse()
        except ModelLoadError:
            raise
        except struct.error:
            raise ModelLoadError(f"malformed GGUF file {self.path}: truncated or corrupt header (a read at "
                                 f"byte {self._pos} of {len(self._map)} runs past the end)") from None
        except (IndexError, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ModelLoadError(f"malformed GGUF file {self.path}: {type(e).__name__}: {e}") from None

    # ---- metadata ------------------------------------------------------------------------------

    def get(self, key: str, default=None):
        return _plain(self._fields.get(key, default))

    def array(self, key: str) -> np.ndarray | None:
        """A numeric array field as a numpy view (no per-element Python objects)."""
        value = self._fields.get(key)
        return value if isinstance(value, np.ndarray) else None

    def array_length(self, key: str) -> int | None:
        value = self._fields.get(key)
        if isinstance(value, _StringArray):
            return value.count
        if isinstance(value, (np.ndarray, list)):
            return len(value)
        return None

    def keys(self) -> list[str]:
        return list(self._fields)

    def tensor(self, name: str) -> GGUFTensor | None:
        return self._by_name.get(name)

    # ---- parsing -------------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = memoryview(self._map)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        self._pos = 4
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.version = version
        self._buf, self._pos = buf, 24
        self._fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self._fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            type_id, offset = self._unpack("<IQ")
            infos.append((name, dims, type_id, offset))
        alignment = self._fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]
        self._by_name = {t.name: t for t in self.tensors}

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = str(self._buf[self._pos : self._pos + n], "utf-8")
        self._pos += n
        return text

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            (value,) = self._unpack(_SCALARS[vtype])
            return value
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        item_type, count = self._unpack("<IQ")
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type])
            values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
            self._pos += dtype.itemsize * count
            return values.astype(bool) if item_type == 7 else values
        if item_type == _STRING:
            strings = _StringArray(self._buf, self._pos, count)
            unpack = struct.Struct("<Q").unpack_from
            pos, buf = self._pos, self._buf
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            self._pos = pos
            return strings
        return [self._value(item_type) for _ in range(count)]  # arrays of arrays (rare)

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
        shape = tuple(int(d) for d in reversed(dims))
        if type_id in GGML_TYPES:
            type_name, block, block_bytes = GGML_TYPES[type_id]
        else:
            import gguf  # every other type's sizes come from the gguf package

            qtype = gguf.GGMLQuantizationType(type_id)
            type_name = qtype.name
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        inner = shape[-1] if shape else 1
        if inner % block:
            raise ValueError(f"tensor {name}: {inner} values per row is not a multiple of the block size {block}")
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        row_bytes = inner // block * block_bytes
        start = data_start + offset
        if start + rows * row_bytes > len(self._buf):
            raise ValueError(f"tensor {name} extends past the end of the file")
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=rows * row_bytes, offset=start)
        if block == 1 and type_name in ("F32", "F16"):
            data = raw.view("<f4" if type_name == "F32" else "<f2").reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], row_bytes)
        return GGUFTensor(name, shape, type_id, type_name, data)
