"""NumPy quantizers / dequantizers for the ggml block formats the Bonsai files use (MODEL.md §1.2).

Every function works on a 2-D float array ``x: [rows, n]`` (or 1-D, treated as one row) and returns
packed bytes ``[rows, row_bytes]`` as ``uint8``; dequantizers take that packed array (or flat bytes)
plus the row length ``n`` and return ``[rows, n] float32``.

Quantizers follow the ggml reference quantizers (``quantize_row_*_ref``):
- Q1_0: ``d = mean|x|`` per 128-block, bit = ``x >= 0``.
- Q2_0 (g128 / g64, PQ2_0): ``d = max|x|``, ``c = clamp(roundf(x/d) + 1, 0, 3)``.
- Q4_1: ``d = (max-min)/15``, ``m = min``, ``q = min(15, trunc((x-min)/d + 0.5))``; layout d, m, qs[16]
  with element j in the low nibble and j+16 in the high nibble of qs[j].
- Q8_0: ``d = max|x|/127``, ``q = roundf(x/d)``.
"""

from __future__ import annotations

import numpy as np

# ggml type ids
F32, F16, Q4_0, Q4_1, Q8_0, BF16, Q1_0, Q2_0, PQ2_0 = 0, 1, 2, 3, 8, 30, 41, 42, 142

# (elements per block, bytes per block) by *resolved* format name
BLOCK = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q1_0": (128, 18),
    "Q2_0G128": (128, 34),
    "PQ2_0": (128, 34),
    "Q2_0G64": (64, 18),
}

GGML_ID = {
    "F32": F32,
    "F16": F16,
    "BF16": BF16,
    "Q4_0": Q4_0,
    "Q4_1": Q4_1,
    "Q8_0": Q8_0,
    "Q1_0": Q1_0,
    "Q2_0G128": Q2_0,
    "Q2_0G64": Q2_0,
    "PQ2_0": PQ2_0,
}


def row_bytes(fmt: str, n: int) -> int:
    be, bb = BLOCK[fmt]
    if n % be:
        raise ValueError(f"{fmt}: row length {n} is not a multiple of {be}")
    return n // be * bb


def tensor_bytes(fmt: str, shape) -> int:
    n_rows = 1
    for s in shape[1:]:
        n_rows *= int(s)
    return row_bytes(fmt, int(shape[0])) * n_rows


def _rows(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x.reshape(1, -1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])


def _roundf(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves away from zero (NumPy's round is half-to-even)."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def f16_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def bf16_bits(x) -> np.ndarray:
    """f32 -> bf16 bits with round-to-nearest-even (ggml's ``GGML_FP32_TO_BF16``), NaN kept quiet."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        r = np.where(nan, ((u >> 16) | 64).astype(np.uint16), r)
    return r


def _pack_blocks(d_parts, qs: np.ndarray, rows: int) -> np.ndarray:
    """Concatenate per-block header fields (each [rows, nb] uint16) and qs [rows, nb, k] to bytes."""
    heads = [p.astype("<u2").view(np.uint8).reshape(p.shape[0], p.shape[1], 2) for p in d_parts]
    blk = np.concatenate(heads + [qs.astype(np.uint8)], axis=2)
    return blk.reshape(rows, -1)


def quantize(fmt: str, x) -> np.ndarray:
    """Quantize ``x: [rows, n] f32`` into packed ``[rows, row_bytes] uint8``."""
    x = _rows(x)
    rows, n = x.shape
    if fmt == "F32":
        return x.astype("<f4").view(np.uint8).reshape(rows, -1)
    if fmt == "F16":
        return f16_bits(x).astype("<u2").view(np.uint8).reshape(rows, -1)
    if fmt == "BF16":
        return bf16_bits(x).astype("<u2").view(np.uint8).reshape(rows, -1)
    be, _ = BLOCK[fmt]
    row_bytes(fmt, n)
    xb = x.reshape(rows, n // be, be)
    if fmt == "Q1_0":
        d = np.abs(xb).sum(axis=2, dtype=np.float32) / np.float32(be)
        bits = (xb >= 0).astype(np.uint8)
        qs = np.packbits(bits, axis=2, bitorder="little")  # [rows, nb, 16]
        return _pack_blocks([f16_bits(d)], qs, rows)
    if fmt in ("Q2_0G128", "PQ2_0", "Q2_0G64"):
        d = np.abs(xb).max(axis=2)
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0).astype(np.float32)
        c = np.clip(_roundf(xb * inv[..., None]) + 1, 0, 3).astype(np.uint8)
        return _pack_blocks([f16_bits(d)], pack_q2_codes(c), rows)
    if fmt == "Q8_0":
        amax = np.abs(xb).max(axis=2)
        d = (amax / 127.0).astype(np.float32)
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0).astype(np.float32)
        q = _roundf(xb * inv[..., None]).astype(np.int8).view(np.uint8)
        return _pack_blocks([f16_bits(d)], q, rows)
    if fmt in ("Q4_0", "Q4_1"):
        if fmt == "Q4_1":
            mn = xb.min(axis=2)
            mx = xb.max(axis=2)
            d = ((mx - mn) / 15.0).astype(np.float32)
            inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0).astype(np.float32)
            q = np.minimum(15, np.trunc((xb - mn[..., None]) * inv[..., None] + 0.5)).astype(np.uint8)
            heads = [f16_bits(d), f16_bits(mn)]
        else:
            # ggml: d = max / -8 where max is the signed value of largest magnitude
            idx = np.abs(xb).argmax(axis=2)
            mx = np.take_along_axis(xb, idx[..., None], axis=2)[..., 0]
            d = (mx / -8.0).astype(np.float32)
            inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0).astype(np.float32)
            q = np.minimum(15, np.trunc(xb * inv[..., None] + 8.5)).astype(np.uint8)
            heads = [f16_bits(d)]
        qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
        return _pack_blocks(heads, qs, rows)
    raise ValueError(f"unknown format {fmt}")


def pack_q2_codes(c: np.ndarray) -> np.ndarray:
    """codes [..., k] in 0..3 -> bytes [..., k/4], element j at bits 2*(j&3) of byte j>>2."""
    c = c.astype(np.uint8).reshape(*c.shape[:-1], c.shape[-1] // 4, 4)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(np.uint8)


def unpack_q2_codes(qs: np.ndarray) -> np.ndarray:
    qs = qs.astype(np.uint8)
    c = np.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    return c.reshape(*qs.shape[:-1], qs.shape[-1] * 4)


def dequantize(fmt: str, buf, n: int) -> np.ndarray:
    """Packed bytes (any shape, row-major) of rows of ``n`` elements -> ``[rows, n] f32``."""
    b = np.frombuffer(bytes(buf), dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    b = np.ascontiguousarray(b).reshape(-1)
    rb = row_bytes(fmt, n)
    if b.size % rb:
        raise ValueError(f"{fmt}: {b.size} bytes is not a whole number of {n}-element rows")
    rows = b.size // rb
    if fmt == "F32":
        return b.view("<f4").astype(np.float32).reshape(rows, n)
    if fmt == "F16":
        return b.view("<f2").astype(np.float32).reshape(rows, n)
    if fmt == "BF16":
        return (b.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(rows, n)
    be, bb = BLOCK[fmt]
    blk = b.reshape(rows, n // be, bb)
    d = blk[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)  # [rows, nb]
    if fmt == "Q1_0":
        bits = np.unpackbits(blk[..., 2:18], axis=2, bitorder="little").astype(np.float32)
        out = (2.0 * bits - 1.0) * d[..., None]
    elif fmt in ("Q2_0G128", "PQ2_0", "Q2_0G64"):
        c = unpack_q2_codes(blk[..., 2:]).astype(np.float32)
        out = (c - 1.0) * d[..., None]
    elif fmt == "Q8_0":
        out = blk[..., 2:].view(np.int8).astype(np.float32) * d[..., None]
    elif fmt == "Q4_0":
        qs = blk[..., 2:18]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.float32)
        out = (q - 8.0) * d[..., None]
    elif fmt == "Q4_1":
        m = blk[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
        qs = blk[..., 4:20]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.float32)
        out = q * d[..., None] + m[..., None]
    else:
        raise ValueError(f"unknown format {fmt}")
    return out.reshape(rows, n).astype(np.float32)


def q2_has_code3(buf, fmt: str = "Q2_0G128") -> bool:
    be, bb = BLOCK[fmt]
    b = np.frombuffer(bytes(buf), dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    qs = b.reshape(-1, bb)[:, 2:]
    return bool(((qs & (qs >> 1) & 0x55) != 0).any())
