"""A small pure-Python/NumPy GGUF v3 writer (streaming) and reader (for inspection and tests).

Layout (MODEL.md §1.1): magic "GGUF", u32 version 3, u64 tensor_count, u64 kv_count, the KV pairs,
the tensor infos (name, n_dims, ne[], type, offset), then the data section starting at the end of the
infos rounded up to ``general.alignment``; every tensor offset is a multiple of the alignment.

Writer usage::

    w = GGUFWriter(path)
    w.add("general.architecture", "qwen35")            # type inferred: str
    w.add_typed("qwen35.block_count", U32, 64)
    w.add_tensor_info("token_embd.weight", (5120, 248320), 41, nbytes)
    w.write_header()
    for name in w.tensor_names():                       # in info order
        w.write_tensor_data(name, chunk1); w.write_tensor_data(name, chunk2) ...
    w.close()                                           # or w.close(sparse=True) to leave a hole
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)

_SCALAR_FMT = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<?",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}
_NP_DTYPE = {
    U8: "<u1",
    I8: "<i1",
    U16: "<u2",
    I16: "<i2",
    U32: "<u4",
    I32: "<i4",
    F32: "<f4",
    BOOL: "<u1",
    U64: "<u8",
    I64: "<i8",
    F64: "<f8",
}


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _enc_str(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def encode_value(vtype: int, value, elem_type: int | None = None) -> bytes:
    """Encode a value (without key and type tag)."""
    if vtype == STRING:
        return _enc_str(value)
    if vtype == ARRAY:
        assert elem_type is not None
        n = len(value)
        head = struct.pack("<IQ", elem_type, n)
        if elem_type == STRING:
            parts = []
            for s in value:
                b = s.encode("utf-8")
                parts.append(struct.pack("<Q", len(b)))
                parts.append(b)
            return head + b"".join(parts)
        if elem_type == ARRAY:
            raise ValueError("nested arrays are not supported")
        return head + np.asarray(value).astype(_NP_DTYPE[elem_type]).tobytes()
    return struct.pack(_SCALAR_FMT[vtype], value)


@dataclass
class TensorInfo:
    name: str
    shape: tuple  # ggml order (ne0, ne1, ...)
    ggml_type: int
    nbytes: int
    offset: int = 0  # relative to the data section


class GGUFWriter:
    """Streaming GGUF v3 writer. KVs and tensor infos first, then data tensor by tensor in info order."""

    def __init__(self, path, alignment: int = 32):
        self.path = Path(path)
        self.alignment = alignment
        self._kv: list[bytes] = []
        self._keys: set[str] = set()
        self._tensors: list[TensorInfo] = []
        self._by_name: dict[str, TensorInfo] = {}
        self._f = None
        self._cur = 0  # index of the tensor being written
        self._cur_written = 0
        self.data_start = 0
        self.total_size = 0

    # -- metadata ----------------------------------------------------------------------------
    def add_typed(self, key: str, vtype: int, value, elem_type: int | None = None) -> None:
        if key in self._keys:
            raise ValueError(f"duplicate key {key}")
        self._keys.add(key)
        self._kv.append(_enc_str(key) + struct.pack("<I", vtype) + encode_value(vtype, value, elem_type))

    def add(self, key: str, value) -> None:
        """Add with an inferred type: str -> string, bool -> bool, float -> f32, int -> u32 (i32 if < 0)."""
        if isinstance(value, str):
            self.add_typed(key, STRING, value)
        elif isinstance(value, bool):
            self.add_typed(key, BOOL, value)
        elif isinstance(value, float):
            self.add_typed(key, F32, value)
        elif isinstance(value, int):
            self.add_typed(key, I32 if value < 0 else U32, value)
        else:
            raise TypeError(f"{key}: cannot infer GGUF type for {type(value)}")

    def add_array(self, key: str, elem_type: int, values) -> None:
        self.add_typed(key, ARRAY, values, elem_type)

    def add_tensor_info(self, name: str, shape, ggml_type: int, nbytes: int) -> None:
        if name in self._by_name:
            raise ValueError(f"duplicate tensor {name}")
        ti = TensorInfo(name, tuple(int(s) for s in shape), int(ggml_type), int(nbytes))
        self._tensors.append(ti)
        self._by_name[name] = ti

    def tensor_names(self) -> list[str]:
        return [t.name for t in self._tensors]

    @property
    def tensors(self) -> list[TensorInfo]:
        return list(self._tensors)

    # -- writing -----------------------------------------------------------------------------
    def header_bytes(self) -> bytes:
        off = 0
        for t in self._tensors:
            t.offset = off
            off = _align(off + t.nbytes, self.alignment)
        parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._kv))]
        parts.extend(self._kv)
        for t in self._tensors:
            parts.append(_enc_str(t.name))
            parts.append(struct.pack("<I", len(t.shape)))
            parts.append(struct.pack(f"<{len(t.shape)}Q", *t.shape))
            parts.append(struct.pack("<IQ", t.ggml_type, t.offset))
        hdr = b"".join(parts)
        self.data_start = _align(len(hdr), self.alignment)
        last = self._tensors[-1] if self._tensors else None
        self.total_size = self.data_start + ((last.offset + last.nbytes) if last else 0)
        return hdr + b"\0" * (self.data_start - len(hdr))

    def write_header(self) -> None:
        hdr = self.header_bytes()
        self._f = open(self.path, "wb")
        self._f.write(hdr)

    def write_tensor_data(self, name: str, data) -> None:
        """Append bytes of tensor ``name`` (must be the current tensor; may be called repeatedly)."""
        t = self._tensors[self._cur]
        if self._cur_written == t.nbytes:
            self._cur += 1
            self._cur_written = 0
            t = self._tensors[self._cur]
        if t.name != name:
            raise ValueError(f"tensor data out of order: got {name}, expected {t.name}")
        mv = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        if self._cur_written == 0:
            pos = self.data_start + t.offset
            here = self._f.tell()
            if here != pos:
                self._f.write(b"\0" * (pos - here))
        if self._cur_written + len(mv) > t.nbytes:
            raise ValueError(f"{name}: too much data ({self._cur_written + len(mv)} > {t.nbytes})")
        self._f.write(mv)
        self._cur_written += len(mv)

    def close(self, sparse: bool = False) -> None:
        """Finish the file. ``sparse=True``: leave the whole data section as a hole (truncate to size)."""
        if self._f is None:
            self.write_header()
        if not sparse:
            done = self._cur + (1 if self._tensors and self._cur_written == self._tensors[self._cur].nbytes else 0)
            if done != len(self._tensors):
                self._f.close()
                raise ValueError(f"only {done} of {len(self._tensors)} tensors were written")
        self._f.truncate(self.total_size)
        self._f.close()
        self._f = None


# ------------------------------------------------------------------------------------------------
# Reader
# ------------------------------------------------------------------------------------------------


@dataclass
class ReadTensor:
    name: str
    shape: tuple
    ggml_type: int
    offset: int  # relative to the data section


@dataclass
class GGUFFile:
    path: Path
    version: int
    kv: dict = field(default_factory=dict)  # key -> python value (arrays as lists / numpy arrays)
    kv_types: dict = field(default_factory=dict)  # key -> (vtype, elem_type or None)
    tensors: list = field(default_factory=list)  # ReadTensor in file order
    alignment: int = 32
    data_start: int = 0
    file_size: int = 0

    def tensor(self, name: str) -> ReadTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def extents(self) -> dict:
        """name -> bytes from its offset to the next tensor's offset (or to the end of the file)."""
        order = sorted(self.tensors, key=lambda t: t.offset)
        data_len = self.file_size - self.data_start
        out = {}
        for i, t in enumerate(order):
            nxt = order[i + 1].offset if i + 1 < len(order) else data_len
            out[t.name] = nxt - t.offset
        return out

    def tensor_data(self, name: str, nbytes: int) -> np.ndarray:
        t = self.tensor(name)
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                start = self.data_start + t.offset
                return np.frombuffer(mm[start : start + nbytes], dtype=np.uint8).copy()
            finally:
                mm.close()


class _Buf:
    def __init__(self, b: bytes):
        self.b = b
        self.p = 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.b, self.p)
        self.p += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.b[self.p : self.p + n]
        self.p += n
        return s.decode("utf-8")


def _read_value(buf: _Buf, vtype: int):
    if vtype == STRING:
        return buf.string()
    if vtype == ARRAY:
        et, n = buf.take("<IQ")
        if et == STRING:
            return [buf.string() for _ in range(n)], et
        if et == ARRAY:
            raise ValueError("nested arrays are not supported")
        dt = np.dtype(_NP_DTYPE[et])
        arr = np.frombuffer(buf.b, dtype=dt, count=n, offset=buf.p).copy()
        buf.p += n * dt.itemsize
        if et == BOOL:
            arr = arr.astype(bool)
        return arr, et
    return buf.take(_SCALAR_FMT[vtype])


def read_gguf(path, max_header: int = 64 << 20) -> GGUFFile:
    """Parse the header (KVs and tensor infos) of a GGUF v3 file without reading tensor data."""
    path = Path(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(min(size, max_header))
    buf = _Buf(raw)
    if raw[:4] != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    buf.p = 4
    version, n_t, n_kv = buf.take("<IQQ")
    g = GGUFFile(path=path, version=version, file_size=size)
    for _ in range(n_kv):
        key = buf.string()
        vt = buf.take("<I")
        v = _read_value(buf, vt)
        if vt == ARRAY:
            v, et = v
            g.kv_types[key] = (vt, et)
        else:
            g.kv_types[key] = (vt, None)
        g.kv[key] = v
    for _ in range(n_t):
        name = buf.string()
        nd = buf.take("<I")
        shape = struct.unpack_from(f"<{nd}Q", raw, buf.p)
        buf.p += 8 * nd
        tt, off = buf.take("<IQ")
        g.tensors.append(ReadTensor(name, tuple(shape), tt, off))
    g.alignment = int(g.kv.get("general.alignment", 32))
    g.data_start = _align(buf.p, g.alignment)
    return g


def resolve_id42(g: GGUFFile) -> int | None:
    """MODEL.md §1.4: the block size (128 or 64) of every id-42 tensor, from extents; None if none.

    A tensor may fit both candidates (tiny tensors whose sizes differ by less than the alignment); the
    file resolves to the one candidate every id-42 tensor fits. Raises ValueError if a tensor fits
    neither candidate, or the tensors disagree, or the whole file stays ambiguous.
    """
    ext = g.extents()
    common = {128, 64}
    any42 = False
    for t in g.tensors:
        if t.ggml_type != 42:
            continue
        n = 1
        for s in t.shape:
            n *= s
        fits = []
        for be, bb in ((128, 34), (64, 18)):
            if t.shape[0] % be:
                continue
            s = n // be * bb
            if s <= ext[t.name] < s + g.alignment:
                fits.append(be)
        if not fits:
            raise ValueError(f"{t.name}: extent {ext[t.name]} fits no id-42 layout")
        any42 = True
        common &= set(fits)
        if not common:
            raise ValueError(f"id-42 tensors disagree on the block size ({t.name} fits only {fits})")
    if not any42:
        return None
    if len(common) != 1:
        raise ValueError("id-42 block size is ambiguous: every tensor fits both 128 and 64")
    return common.pop()


def id42_candidates(g: GGUFFile) -> dict:
    """name -> list of id-42 block sizes whose byte size fits the tensor's extent (for diagnostics)."""
    ext = g.extents()
    out = {}
    for t in g.tensors:
        if t.ggml_type != 42:
            continue
        n = 1
        for s in t.shape:
            n *= s
        out[t.name] = [
            be
            for be, bb in ((128, 34), (64, 18))
            if t.shape[0] % be == 0 and n // be * bb <= ext[t.name] < n // be * bb + g.alignment
        ]
    return out
