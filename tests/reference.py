"""Independent NumPy reference forward for the `qwen35` target (Bonsai-27B), written from MODEL.md only.

It is the whole-model oracle: slow, straight-line, float64.

* Weights are dequantized from the GGUF bytes with this file's own decoders (MODEL.md §1.2) and cached
  per tensor as float64.
* Every activation, the GDN recurrent state, the conv state and the KV cache are float64. The engine and
  llama.cpp keep f32 state (llama.cpp: f16 KV), so differences come from them, not from the reference.
* `act_quant="q8_0"` optionally rounds the input of every low-bit matmul to Q8_0 per 32 elements (scale
  `d = amax/127` stored as f16, `q = round(x/d)`), which is what llama.cpp's CPU backend does before its
  `vec_dot_q*_q8_0` kernels. It is used to measure the logit error that activation quantization causes.

Nothing about the model geometry is hard-coded: every size is read from the header.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np

# ---------------------------------------------------------------------------------------------------
# 1. GGUF container (MODEL.md §1.1)
# ---------------------------------------------------------------------------------------------------

GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 0, 1, 2, 3, 8
GGML_BF16, GGML_Q1_0, GGML_Q2_0, GGML_PQ2_0 = 30, 41, 42, 142

# resolved storage kinds -> (elements per block, bytes per block)
BLOCK = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q1_0": (128, 18),
    "Q2_0_G128": (128, 34),
    "Q2_0_G64": (64, 18),
    "PQ2_0": (128, 34),
}
_UNAMBIGUOUS = {
    GGML_F32: "F32",
    GGML_F16: "F16",
    GGML_BF16: "BF16",
    GGML_Q4_0: "Q4_0",
    GGML_Q4_1: "Q4_1",
    GGML_Q8_0: "Q8_0",
    GGML_Q1_0: "Q1_0",
    GGML_PQ2_0: "PQ2_0",
}
LOWBIT = {"Q4_0", "Q4_1", "Q8_0", "Q1_0", "Q2_0_G128", "Q2_0_G64", "PQ2_0"}

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order, ne[0] contiguous
    ggml_type: int
    offset: int  # relative to the data section
    kind: str = ""  # resolved storage kind (key of BLOCK)

    @property
    def n_elems(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64))


class _Cursor:
    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.buf[self.pos : self.pos + n]
        if len(s) != n:
            raise GGUFError("truncated string")
        self.pos += n
        return s.decode("utf-8")

    def value(self, vt: int):
        if vt in _SCALAR:
            return self.take(_SCALAR[vt])
        if vt == 8:
            return self.string()
        if vt == 9:
            et = self.take("<I")
            n = self.take("<Q")
            return [self.value(et) for _ in range(n)]
        raise GGUFError(f"unknown GGUF value type {vt}")


class GGUFFile:
    """Header, metadata and tensor table of a GGUF v3 file; tensor bytes are read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self.buf = f.read()
        c = _Cursor(self.buf)
        if self.buf[:4] != b"GGUF":
            raise GGUFError("bad magic")
        c.pos = 4
        self.version = c.take("<I")
        if self.version != 3:
            raise GGUFError(f"unsupported GGUF version {self.version}")
        n_tensors = c.take("<Q")
        n_kv = c.take("<Q")
        self.meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            self.meta[key] = c.value(c.take("<I"))
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = c.string()
            nd = c.take("<I")
            ne = tuple(c.take("<Q") for _ in range(nd))
            tt = c.take("<I")
            off = c.take("<Q")
            self.tensors[name] = TensorInfo(name, ne, tt, off)
        self.alignment = int(self.meta.get("general.alignment", 32))
        self.data_start = -(-c.pos // self.alignment) * self.alignment
        self._resolve_types()

    def _resolve_types(self) -> None:
        """Resolve every tensor's storage kind; id 42 by the extent test of MODEL.md §1.4."""
        data_len = len(self.buf) - self.data_start
        infos = sorted(self.tensors.values(), key=lambda t: t.offset)
        extents = {}
        for i, t in enumerate(infos):
            end = infos[i + 1].offset if i + 1 < len(infos) else data_len
            extents[t.name] = end - t.offset
        # id 42: candidate block sizes per tensor; one file uses one size, so intersect over tensors
        # (a tiny tensor can fit both candidates within the alignment slack).
        q2_candidates = {"Q2_0_G128", "Q2_0_G64"}
        q2_tensors = []
        for t in infos:
            if t.offset % self.alignment:
                raise GGUFError(f"tensor {t.name}: offset not aligned")
            if t.ggml_type == GGML_Q2_0:
                fits = set()
                for kind in ("Q2_0_G128", "Q2_0_G64"):
                    be, bb = BLOCK[kind]
                    if t.ne[0] % be:
                        continue
                    size = t.n_elems // be * bb
                    if size <= extents[t.name] < size + self.alignment:
                        fits.add(kind)
                if not fits:
                    raise GGUFError(f"tensor {t.name}: id 42 fits neither block size")
                q2_candidates &= fits
                q2_tensors.append(t)
            elif t.ggml_type in _UNAMBIGUOUS:
                t.kind = _UNAMBIGUOUS[t.ggml_type]
            else:
                raise GGUFError(f"tensor {t.name}: unsupported ggml type {t.ggml_type}")
        if q2_tensors:
            if len(q2_candidates) != 1:
                raise GGUFError(f"id-42 tensors resolve to {sorted(q2_candidates) or 'no common'} block size")
            for t in q2_tensors:
                t.kind = next(iter(q2_candidates))
        for t in infos:
            be, bb = BLOCK[t.kind]
            if t.ne[0] % be:
                raise GGUFError(f"tensor {t.name}: ne0 {t.ne[0]} not a multiple of {be}")
            if t.n_elems // be * bb > extents[t.name]:
                raise GGUFError(f"tensor {t.name}: data past its extent")

    def raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        be, bb = BLOCK[t.kind]
        n = t.n_elems // be * bb
        start = self.data_start + t.offset
        return np.frombuffer(self.buf, dtype=np.uint8, count=n, offset=start)

    def dequant(self, name: str) -> np.ndarray:
        """float32 array in numpy order (ne[-1], ..., ne[0])."""
        t = self.tensors[name]
        flat = dequantize(t.kind, self.raw(name), t.n_elems)
        return flat.reshape(tuple(reversed(t.ne)))


# ---------------------------------------------------------------------------------------------------
# 2. Block formats (MODEL.md §1.2)
# ---------------------------------------------------------------------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb, 1] float32."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def dequantize(kind: str, raw: np.ndarray, n: int) -> np.ndarray:
    """Decode `n` elements of storage kind `kind` from bytes `raw` into float32."""
    be, bb = BLOCK[kind]
    if kind == "F32":
        return raw.view("<f4")[:n].astype(np.float32)
    if kind == "F16":
        return raw.view("<f2")[:n].astype(np.float32)
    if kind == "BF16":
        return (raw.view("<u2")[:n].astype(np.uint32) << 16).view(np.float32)
    blk = raw[: n // be * bb].reshape(-1, bb)
    d = _f16(blk[:, 0:2])
    if kind == "Q4_0":
        qs = blk[:, 2:18]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) - 8.0
        out = q * d
    elif kind == "Q4_1":
        m = _f16(blk[:, 2:4])
        qs = blk[:, 4:20]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
        out = q * d + m
    elif kind == "Q8_0":
        out = blk[:, 2:34].view(np.int8).astype(np.float32) * d
    elif kind == "Q1_0":
        bits = np.unpackbits(blk[:, 2:18], axis=1, bitorder="little")  # [nb, 128], bit j of qs[j>>3]
        out = np.where(bits == 1, d, -d)
    elif kind in ("Q2_0_G128", "PQ2_0", "Q2_0_G64"):
        qs = blk[:, 2:bb]  # [nb, be/4]
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
        codes = (qs[:, :, None] >> shifts[None, None, :]) & 3  # element j = 4*byte + (j & 3)
        out = (codes.reshape(blk.shape[0], be).astype(np.float32) - 1.0) * d
    else:
        raise GGUFError(f"no dequantizer for {kind}")
    return out.reshape(-1).astype(np.float32)


def quantize_act_q8_0(x: np.ndarray) -> np.ndarray:
    """Round rows of x [n, k] the way llama.cpp quantizes activations to Q8_0 (per 32, f16 scale)."""
    return quantize_act_q8(x, 32, f16_scale=True)


def quantize_act_q8(x: np.ndarray, group: int, f16_scale: bool = False) -> np.ndarray:
    """Round rows of x [n, k] to int8 with one scale amax/127 per `group` elements (f16-rounded when
    `f16_scale`, as llama.cpp's Q8_0; f32 otherwise, as this engine's activation codes)."""
    n, k = x.shape
    xb = x.reshape(n, k // group, group)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    d = amax / 127.0
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.round(xb * inv)  # ggml uses roundf (half away from zero); ties are measure-zero here
    if f16_scale:
        d = d.astype(np.float16).astype(np.float64)
    return (q * d).reshape(n, k)


def quantize_act_q8_sub(x: np.ndarray, group: int = 128, sub: int = 32, levels: int = 16) -> np.ndarray:
    """Round rows of x [n, k] to int8 with one f32 scale per `group` elements and an integer
    sub-scale m_j in 1..levels per `sub`-element sub-block: the sub-block's step is
    (amax_group / 127)·m_j / levels with m_j = ceil(levels·amax_sub / amax_group), so its codes
    still span ±127 of its own range (to within 1 / m_j) while the sub-block dot products of a group
    add up exactly in int32 (Σ_j m_j·isum_j) before a single float rescale per group."""
    n, k = x.shape
    xg = x.reshape(n, k // group, group // sub, sub)
    a_sub = np.abs(xg).max(axis=3, keepdims=True)
    a_grp = a_sub.max(axis=2, keepdims=True)
    safe = np.where(a_grp > 0, a_grp, 1.0)
    m = np.clip(np.ceil(levels * a_sub / safe), 1, levels)
    d = a_grp / 127.0 * m / levels
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.clip(np.round(xg * inv), -127, 127)
    return (q * d).reshape(n, k)


# act_quant modes of Reference: None (exact) and these (name -> group, f16 scale, integer sub-scale
# levels per 32 elements or 0 for none)
ACT_QUANT = {
    "q8_0": (32, True, 0),
    "q8_g32": (32, False, 0),
    "q8_g64": (64, False, 0),
    "q8_g128": (128, False, 0),
    "q8_g128m8": (128, False, 8),
    "q8_g128m16": (128, False, 16),
}


# ---------------------------------------------------------------------------------------------------
# 3. Primitives (MODEL.md §3.0)
# ---------------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), eps)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def rope_neox(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """Partial NEOX RoPE. x: [n, heads, hd]; pos: [n]. Pairs (d, d + n_rot/2) for d < n_rot/2."""
    half = n_rot // 2
    d = np.arange(half, dtype=np.float64)
    theta = pos[:, None].astype(np.float64) * base ** (-2.0 * d / n_rot)  # [n, half]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    y = x.copy()
    x0, x1 = x[..., :half], x[..., half:n_rot]
    y[..., :half] = x0 * cos - x1 * sin
    y[..., half:n_rot] = x0 * sin + x1 * cos
    return y


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention.

    q: [n, n_head, hd]; k, v: [T, n_head_kv, hd] (cache rows 0..T-1 at positions 0..T-1);
    q_pos: [n] absolute positions (row t sees keys 0..q_pos[t]). Q head h uses kv head h // group.
    Returns [n, n_head, hd].
    """
    n, n_head, hd = q.shape
    group = n_head // k.shape[1]
    kk = np.repeat(k, group, axis=1)  # [T, n_head, hd], head h -> kv h // group
    vv = np.repeat(v, group, axis=1)
    s = np.einsum("nhd,thd->hnt", q, kk) / math.sqrt(hd)  # [n_head, n, T]
    mask = np.arange(k.shape[0])[None, :] > q_pos[:, None]  # [n, T]
    s = np.where(mask[None], -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", p, vv)


# ---------------------------------------------------------------------------------------------------
# 4. Gated delta rule: recurrent (§3.2 step 5) and chunked (§3.3)
# ---------------------------------------------------------------------------------------------------


def delta_rule_recurrent(q, k, v, beta, g, S):
    """Per-token delta rule for all v-heads.

    q, k: [n, H, d_k] already mapped to v-heads (tiled: v-head h uses k-head h % H_k), L2-normed, q
    already scaled by 1/sqrt(d_k); v: [n, H, d_v]; beta, g: [n, H]; S: [H, d_k, d_v] (modified copy).
    Returns (o [n, H, d_v], S).
    """
    S = S.copy()
    o = np.empty_like(v)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        u = np.einsum("hi,hij->hj", k[t], S)
        delta = beta[t][:, None] * (v[t] - u)
        S += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hi,hij->hj", q[t], S)
    return o, S


def delta_rule_chunked(q, k, v, beta, g, S, chunk: int = 64):
    """Chunked delta rule (MODEL.md §3.3, C = 64); same arguments and result as the recurrent form."""
    n, H, dk = q.shape
    dv = v.shape[2]
    n_pad = -(-n // chunk) * chunk
    pad = n_pad - n

    def padded(a):
        return np.concatenate([a, np.zeros((pad,) + a.shape[1:])], axis=0) if pad else a

    # head-major: [H, n_pad, ...]
    q, k, v = (padded(a).transpose(1, 0, 2) for a in (q, k, v))
    beta, g = (padded(a).T for a in (beta, g))
    S = S.copy()
    o = np.empty((H, n_pad, dv))
    eye = np.eye(chunk)
    tril_incl = np.tril(np.ones((chunk, chunk), dtype=bool))
    tril_strict = np.tril(np.ones((chunk, chunk), dtype=bool), -1)
    for c0 in range(0, n_pad, chunk):
        sl = slice(c0, c0 + chunk)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        gam = np.cumsum(g[:, sl], axis=1)  # [H, C]
        diff = gam[:, :, None] - gam[:, None, :]  # [H, C, C] gamma_t - gamma_s
        D = np.where(tril_incl, np.exp(np.where(tril_incl, diff, 0.0)), 0.0)
        kb = bc[:, :, None] * kc
        vb = bc[:, :, None] * vc
        A = np.where(tril_strict, np.einsum("hti,hsi->hts", kb, kc) * D, 0.0)
        IA = eye + A
        U = np.linalg.solve(IA, vb)
        W = np.linalg.solve(IA, kb * np.exp(gam)[:, :, None])
        Vp = U - W @ S  # [H, C, dv]
        qk = np.einsum("hti,hsi->hts", qc, kc) * D
        o[:, sl] = (qc * np.exp(gam)[:, :, None]) @ S + qk @ Vp
        last = gam[:, -1]
        S = np.exp(last)[:, None, None] * S + np.einsum(
            "hti,htj->hij", kc * np.exp(last[:, None] - gam)[:, :, None], Vp
        )
    return o[:, :n].transpose(1, 0, 2), S


# ---------------------------------------------------------------------------------------------------
# 5. The model
# ---------------------------------------------------------------------------------------------------


@dataclass
class Hparams:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    eps: float
    rope_base: float
    n_rot: int
    attn_interval: int
    conv_kernel: int
    d_k: int  # GDN key head dim (ssm.state_size)
    h_k: int  # GDN key heads (ssm.group_count)
    h_v: int  # GDN value heads (ssm.time_step_rank)
    inner: int  # GDN value dim total (ssm.inner_size)

    @property
    def d_v(self) -> int:
        return self.inner // self.h_v

    def is_attn(self, il: int) -> bool:
        return (il + 1) % self.attn_interval == 0

    @classmethod
    def from_meta(cls, meta: dict) -> Hparams:
        arch = str(meta["general.architecture"])

        def k(key, default=None):
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise GGUFError(f"missing metadata key {full}")
            return default

        hd_k = int(k("attention.key_length"))
        return cls(
            arch=arch,
            n_layer=int(k("block_count")),
            n_embd=int(k("embedding_length")),
            n_ff=int(k("feed_forward_length")),
            n_head=int(k("attention.head_count")),
            n_head_kv=int(k("attention.head_count_kv")),
            head_dim_k=hd_k,
            head_dim_v=int(k("attention.value_length", hd_k)),
            eps=float(k("attention.layer_norm_rms_epsilon")),
            rope_base=float(k("rope.freq_base")),
            n_rot=int(k("rope.dimension_count", hd_k)),
            attn_interval=int(k("full_attention_interval", 4)),
            conv_kernel=int(k("ssm.conv_kernel")),
            d_k=int(k("ssm.state_size")),
            h_k=int(k("ssm.group_count")),
            h_v=int(k("ssm.time_step_rank")),
            inner=int(k("ssm.inner_size")),
        )


class Reference:
    """float64 qwen35 forward over one sequence, with recurrent state.

    `act_quant`: None (exact), "q8_0" (round the input of each low-bit matmul like llama.cpp's CPU path),
    or "q8_g32" / "q8_g64" / "q8_g128" (int8 with an f32 scale per 32 / 64 / 128 elements), or
    "q8_g128m8" / "q8_g128m16" (per 128 with integer sub-scales per 32, `quantize_act_q8_sub`).
    """

    def __init__(self, path: str | os.PathLike, act_quant: str | None = None):
        self.gguf = GGUFFile(path)
        self.hp = Hparams.from_meta(self.gguf.meta)
        if self.hp.arch != "qwen35":
            raise GGUFError(f"architecture {self.hp.arch!r} is not qwen35")
        if act_quant is not None and act_quant not in ACT_QUANT:
            raise ValueError(act_quant)
        self.act_quant = act_quant
        self._w: dict[str, np.ndarray] = {}
        self.head_name = "output.weight" if "output.weight" in self.gguf.tensors else "token_embd.weight"
        self.n_vocab = self.gguf.tensors[self.head_name].ne[1]
        self.reset()

    # -- weights --------------------------------------------------------------------------------
    def w(self, name: str) -> np.ndarray:
        """Dequantized tensor as float64 (cached)."""
        a = self._w.get(name)
        if a is None:
            a = self.gguf.dequant(name).astype(np.float64)
            self._w[name] = a
        return a

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def matmul(self, name: str, x: np.ndarray) -> np.ndarray:
        """y = x · Wᵀ. x: [n, in]; W stored [in, out] (out rows of in). Returns [n, out]."""
        if self.act_quant is not None and self.gguf.tensors[name].kind in LOWBIT:
            group, f16, levels = ACT_QUANT[self.act_quant]
            if levels:
                x = quantize_act_q8_sub(x, group, 32, levels)
            else:
                x = quantize_act_q8(x, group, f16_scale=f16)
        return x @ self.w(name).T

    # -- state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        hp = self.hp
        self.pos = 0
        self.conv: dict[int, np.ndarray] = {}  # il -> [conv_kernel-1, conv_dim] pre-conv rows
        self.ssm: dict[int, np.ndarray] = {}  # il -> [h_v, d_k, d_v], S[i = key, j = value]
        self.k_cache: dict[int, np.ndarray] = {}  # il -> [T, n_head_kv, hd]
        self.v_cache: dict[int, np.ndarray] = {}
        conv_dim = 2 * hp.h_k * hp.d_k + hp.inner
        for il in range(hp.n_layer):
            if hp.is_attn(il):
                self.k_cache[il] = np.zeros((0, hp.n_head_kv, hp.head_dim_k))
                self.v_cache[il] = np.zeros((0, hp.n_head_kv, hp.head_dim_v))
            else:
                self.conv[il] = np.zeros((hp.conv_kernel - 1, conv_dim))
                self.ssm[il] = np.zeros((hp.h_v, hp.d_k, hp.d_v))

    @property
    def kv_len(self) -> int:
        return self.pos

    def gdn_state(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        """(conv state [conv_kernel-1, conv_dim], recurrent state [h_v, d_k, d_v] indexed [h, key, value])."""
        return self.conv[il].copy(), self.ssm[il].copy()

    # -- blocks ---------------------------------------------------------------------------------
    def _gdn(self, il: int, x: np.ndarray, chunked: bool) -> np.ndarray:
        """x: [n, n_embd] normed input -> [n, n_embd] mixer output."""
        hp = self.hp
        p = f"blk.{il}."
        n = x.shape[0]
        key_dim = hp.h_k * hp.d_k
        mixed = self.matmul(p + "attn_qkv.weight", x)  # [n, conv_dim]
        z = self.matmul(p + "attn_gate.weight", x).reshape(n, hp.h_v, hp.d_v)
        b = self.matmul(p + "ssm_beta.weight", x)  # [n, h_v]
        a = self.matmul(p + "ssm_alpha.weight", x)  # [n, h_v]
        # causal depthwise conv, tap K-1 = current token
        cw = self.w(p + "ssm_conv1d.weight")  # [conv_dim, K]
        K = hp.conv_kernel
        X = np.concatenate([self.conv[il], mixed], axis=0)  # [K-1+n, conv_dim]
        c = np.zeros_like(mixed)
        for kk in range(K):
            c += cw[:, kk][None, :] * X[kk : kk + n]
        self.conv[il] = X[n:].copy()
        c = silu(c)
        q = l2_norm(c[:, :key_dim].reshape(n, hp.h_k, hp.d_k), hp.eps)
        k = l2_norm(c[:, key_dim : 2 * key_dim].reshape(n, hp.h_k, hp.d_k), hp.eps)
        v = c[:, 2 * key_dim :].reshape(n, hp.h_v, hp.d_v)
        beta = sigmoid(b)
        g = self.w(p + "ssm_a")[None, :] * softplus(a + self.w(p + "ssm_dt.bias")[None, :])
        head_map = np.arange(hp.h_v) % hp.h_k  # tiled: v-head h uses k-head h % H_k
        qh = q[:, head_map] / math.sqrt(hp.d_k)
        kh = k[:, head_map]
        rule = delta_rule_chunked if chunked else delta_rule_recurrent
        o, self.ssm[il] = rule(qh, kh, v, beta, g, self.ssm[il])
        y = rms_norm(o, hp.eps) * self.w(p + "ssm_norm.weight") * silu(z)  # [n, h_v, d_v]
        return self.matmul(p + "ssm_out.weight", y.reshape(n, hp.inner))

    def _attn(self, il: int, x: np.ndarray) -> np.ndarray:
        hp = self.hp
        p = f"blk.{il}."
        n = x.shape[0]
        hdk, hdv = hp.head_dim_k, hp.head_dim_v
        if self.has(p + "attn_q.weight"):
            qf = self.matmul(p + "attn_q.weight", x)
            kf = self.matmul(p + "attn_k.weight", x)
            vf = self.matmul(p + "attn_v.weight", x)
        else:  # fused [q+gate ‖ k ‖ v]
            qkv = self.matmul(p + "attn_qkv.weight", x)
            nq = hp.n_head * (hdk + hdv)
            nk = hp.n_head_kv * hdk
            qf, kf, vf = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
        qf = qf.reshape(n, hp.n_head, hdk + hdv)  # per head [q ‖ gate]
        q, gate = qf[:, :, :hdk], qf[:, :, hdk:]
        q = rms_norm(q, hp.eps) * self.w(p + "attn_q_norm.weight")
        k = rms_norm(kf.reshape(n, hp.n_head_kv, hdk), hp.eps) * self.w(p + "attn_k_norm.weight")
        v = vf.reshape(n, hp.n_head_kv, hdv)
        pos = np.arange(self.pos, self.pos + n)
        q = rope_neox(q, pos, hp.n_rot, hp.rope_base)
        k = rope_neox(k, pos, hp.n_rot, hp.rope_base)
        self.k_cache[il] = np.concatenate([self.k_cache[il], k], axis=0)
        self.v_cache[il] = np.concatenate([self.v_cache[il], v], axis=0)
        att = attention(q, self.k_cache[il], self.v_cache[il], pos)  # [n, n_head, hdv]
        att = att * sigmoid(gate)
        return self.matmul(p + "attn_output.weight", att.reshape(n, hp.n_head * hdv))

    def _mlp(self, il: int, u: np.ndarray) -> np.ndarray:
        p = f"blk.{il}."
        return self.matmul(
            p + "ffn_down.weight", silu(self.matmul(p + "ffn_gate.weight", u)) * self.matmul(p + "ffn_up.weight", u)
        )

    # -- forward --------------------------------------------------------------------------------
    def prefill(self, ids, chunked: bool = True) -> np.ndarray:
        """Run `ids` after the current state; returns logits of every row, [n, n_vocab] float64."""
        hp = self.hp
        ids = np.asarray(ids, dtype=np.int64)
        x = self.w("token_embd.weight")[ids]  # [n, n_embd]
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            xn = rms_norm(x, hp.eps) * self.w(p + "attn_norm.weight")
            h = x + (self._attn(il, xn) if hp.is_attn(il) else self._gdn(il, xn, chunked))
            u = rms_norm(h, hp.eps) * self.w(p + "post_attention_norm.weight")
            x = h + self._mlp(il, u)
        self.pos += len(ids)
        xo = rms_norm(x, hp.eps) * self.w("output_norm.weight")
        return self.matmul(self.head_name, xo)

    def step(self, token_id: int) -> np.ndarray:
        """One recurrent decode step; returns logits [n_vocab]."""
        return self.prefill([int(token_id)], chunked=False)[0]

    def logits(self, ids, chunked: bool = True) -> np.ndarray:
        """Fresh sequence: logits of every row, [n, n_vocab]."""
        self.reset()
        if chunked:
            return self.prefill(ids, chunked=True)
        return np.stack([self.step(t) for t in ids])

    def generate(self, prompt_ids, n_tokens: int) -> list[int]:
        """Greedy continuation (fresh sequence)."""
        lg = self.logits(prompt_ids)[-1]
        out = []
        for _ in range(n_tokens):
            t = int(np.argmax(lg))
            out.append(t)
            lg = self.step(t)
        return out


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    """Normalized MSE of `a` against `ref`: Σ(a−ref)² / Σref²."""
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.sum((a - ref) ** 2) / np.sum(ref**2))


# ---------------------------------------------------------------------------------------------------
# 6. Comparison tolerances against activation-quantizing implementations (llama.cpp, the engine)
# ---------------------------------------------------------------------------------------------------

K_TIE = 5.0


def q8_logit_sigma(ref_exact: np.ndarray, ref_q8: np.ndarray) -> np.ndarray:
    """Per-row logit error scale σ_e caused by Q8_0 activation rounding, [n].

    Derivation. llama.cpp (CPU) rounds the input of every low-bit matmul to Q8_0: per 32 elements,
    `d = amax/127` (stored f16) and `q = round(x/d)`. The rounding error per element is uniform in ±d/2,
    rms `d/√12`. For roughly Gaussian activations the max of 32 |values| is ≈ 2.4σ, so the error is
    ≈ 2.4/(127·√12) ≈ 0.55 % of the activation rms, and a matmul output `y = W·x` receives noise of
    ≈ 0.55 % of rms(y) (the rounding is uncorrelated with W's rows). The head alone therefore gives a
    logit NMSE of ≈ 3e-5; every earlier matmul (5 per GDN layer, 4 per attention layer, 3 per MLP)
    injects the same relative noise into the residual stream, where the rest of the network may amplify
    it, so the analytic figure is only a lower bound. Instead of guessing the amplification we measure it:
    the reference runs once exactly and once with exactly this Q8_0 rounding (`act_quant="q8_0"`), and
    σ_e(row) is the rms over the vocabulary of their difference. llama.cpp's remaining differences (f16 KV
    cache, f32 arithmetic) are ≈ 10× smaller (checked in test_reference.py).

    Near-tie threshold. A top-1 flip between tokens a and b needs the error of `ℓ_a − ℓ_b` to exceed their
    margin. That error has std ≈ √2·σ_e (two roughly independent logit errors), so a flip is accepted only
    where the margin is below τ = K_TIE·√2·σ_e with K_TIE = 5 (a ≥ 5σ event otherwise: < 1e-6 per row).
    """
    d = np.asarray(ref_q8, np.float64) - np.asarray(ref_exact, np.float64)
    return np.sqrt(np.mean(d * d, axis=-1))


def tie_threshold(sigma_e: np.ndarray) -> np.ndarray:
    """τ per row; see `q8_logit_sigma`."""
    return K_TIE * math.sqrt(2.0) * np.asarray(sigma_e)


def choice_violations(chosen, logits: np.ndarray, tau: np.ndarray) -> list[tuple[int, float, float]]:
    """Rows where token `chosen[i]` trails the argmax of `logits[i]` by more than `tau[i]`.

    Returns [(row, gap, tau)]. gap ≥ the top1–top2 margin of `logits`, so this is at least as strict as
    "top-1 agrees unless the top1–top2 margin is below τ".
    """
    out = []
    logits = np.asarray(logits, np.float64)
    for i, c in enumerate(chosen):
        gap = float(logits[i].max() - logits[i, int(c)])
        if gap > tau[i]:
            out.append((i, gap, float(tau[i])))
    return out
