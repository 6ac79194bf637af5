#!/usr/bin/env python3
"""Feasibility run of bench/micro/b1plane.cu (Q1_0 mat-vec on the binary tensor cores with bit-plane
activations): checks every kernel against a float64 NumPy reference at the 27B shapes, checks that an
n = 5 launch's row 0 equals the n = 1 launch bit for bit, and times each kernel per launch with the
weights rotated past the L2, next to a streaming-read floor of the same bytes.

    python3 bench/micro/build.py --src b1plane.cu      # here (NVRTC), writes bench/micro/out/
    python3 bench/micro/b1plane.py [--out FILE]        # on the GPU machine (libcuda + numpy)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# (name, n_out, n_in, launches per Q1_0 27B token, dp4a µs per launch in the production decode
# profile of bench/results/cuda-decode-27b-q1.json: each launch alone, eager)
SHAPES = [
    ("gdn_in(qkv|z|b|a)", 16480, 5120, 48, 8.23),
    ("ssm_out", 5120, 6144, 48, 3.47),
    ("attn_in(q|k|v)", 14336, 5120, 16, 8.50),
    ("attn_out", 5120, 6144, 16, 3.82),
    ("ffn_gate|up", 34816, 5120, 64, 13.14),
    ("ffn_down", 5120, 17408, 64, 7.79),
    ("head", 248320, 5120, 1, 75.68),
]
KRE = re.compile(r"bp_(\d+)_k(\d+)_g(\d+)_r(\d+)_n(\d+)_u(\d+)")


def P(p: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(p)


class Cu:
    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.ok(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.ok(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "device")
        name = ctypes.create_string_buffer(256)
        self.cu.cuDeviceGetName(name, 256, dev)
        self.name = name.value.decode()
        sms = ctypes.c_int()
        self.cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)
        self.sms = sms.value
        ctx = ctypes.c_void_p()
        self.ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
        self.ok(self.cu.cuCtxSetCurrent(ctx), "ctx current")
        self.e0, self.e1 = ctypes.c_void_p(), ctypes.c_void_p()
        self.cu.cuEventCreate(ctypes.byref(self.e0), 0)
        self.cu.cuEventCreate(ctypes.byref(self.e1), 0)

    @staticmethod
    def ok(rc: int, what: str) -> None:
        if rc != 0:
            raise SystemExit(f"{what}: CUDA error {rc}")

    def load(self, path: Path) -> ctypes.c_void_p:
        mod = ctypes.c_void_p()
        self.ok(self.cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(path.read_bytes())), "module")
        return mod

    def func(self, mod: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
        f = ctypes.c_void_p()
        self.ok(self.cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
        return f

    def put(self, a: np.ndarray) -> int:
        p = ctypes.c_uint64()
        self.ok(self.cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(max(a.nbytes, 16))), "alloc")
        self.ok(self.cu.cuMemcpyHtoD_v2(p, a.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(a.nbytes)), "h2d")
        return p.value

    def zeros(self, nbytes: int) -> int:
        p = ctypes.c_uint64()
        self.ok(self.cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes)), "alloc")
        self.ok(self.cu.cuMemsetD8_v2(p, 0, ctypes.c_size_t(nbytes)), "memset")
        return p.value

    def get(self, p: int, shape: tuple, dtype) -> np.ndarray:
        a = np.empty(shape, dtype)
        dst = a.ctypes.data_as(ctypes.c_void_p)
        self.ok(self.cu.cuMemcpyDtoH_v2(dst, ctypes.c_uint64(p), ctypes.c_size_t(a.nbytes)), "d2h")
        return a

    def free(self, p: int) -> None:
        self.cu.cuMemFree_v2(ctypes.c_uint64(p))

    def launch(self, f, grid: int, block: int, args: list) -> None:
        holders = [x if isinstance(x, ctypes._SimpleCData) else ctypes.c_int(x) for x in args]
        arr = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        self.ok(self.cu.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, None, arr, None), "launch")

    def time(self, f, grid: int, block: int, arglists: list, reps: int) -> float:
        """µs per launch of f, launch i taking arglists[i % len(arglists)]."""
        for i in range(3):
            self.launch(f, grid, block, arglists[i % len(arglists)])
        self.ok(self.cu.cuCtxSynchronize(), "sync")
        # a spin kernel first, long enough for the host to queue every timed launch behind it
        self.launch(self.spin, 1, 1, [ctypes.c_uint64(int(reps * 40e3 + 2e6))])
        self.cu.cuEventRecord(self.e0, None)
        for i in range(reps):
            self.launch(f, grid, block, arglists[i % len(arglists)])
        self.cu.cuEventRecord(self.e1, None)
        self.ok(self.cu.cuEventSynchronize(self.e1), "event sync")
        ms = ctypes.c_float()
        self.cu.cuEventElapsedTime(ctypes.byref(ms), self.e0, self.e1)
        return ms.value * 1e3 / reps


def planes_of(a: np.ndarray, np_: int) -> np.ndarray:
    """a [t, nblk*128] int codes -> planes [t, nblk, np_, 4] u32 (bit i of word tg = element 32tg + i)."""
    t, k = a.shape
    u = (a.astype(np.int64) & ((1 << np_) - 1)).reshape(t, k // 128, 4, 32)
    out = np.zeros((t, k // 128, np_, 4), np.uint64)
    for p in range(np_):
        bits = ((u >> p) & 1).astype(np.uint64)
        out[:, :, p, :] = (bits << np.arange(32, dtype=np.uint64)).sum(axis=-1)
    return out.astype(np.uint32)


def layouts(w: np.ndarray, dw: np.ndarray, a: np.ndarray, u: np.ndarray, np_: int):
    n_out, nblk, _ = w.shape
    nt, npair = n_out // 16, nblk // 2
    wa = w.reshape(nt, 2, 8, npair, 2, 4).transpose(0, 3, 2, 5, 4, 1).copy()  # [tile,pair,g,tg,h,half]
    d16 = dw.astype(np.float16).view(np.uint16).reshape(nt, 2, 8, nblk).transpose(0, 3, 2, 1).copy()
    wd = d16.view(np.uint32).reshape(nt, nblk, 8)
    pl = planes_of(a, np_)
    t = a.shape[0]
    if np_ == 16:
        xp = pl.reshape(t, npair, 2, 2, 8, 4).transpose(0, 1, 4, 5, 2, 3).copy()  # [t,pair,g,tg,h,hi]
    else:
        xp = pl.reshape(t, npair, 2, 8, 4).transpose(0, 1, 3, 4, 2).copy()  # [t,pair,g,tg,h]
    xs = np.zeros((t, nblk, 4), np.int32)
    xs[:, :, 0] = a.reshape(t, nblk, 128).sum(axis=-1)
    return wa, wd, xp, u.astype(np.float32), xs


def reference(w, dw, a, u) -> np.ndarray:
    n_out, nblk, _ = w.shape
    av = a.astype(np.float64).reshape(a.shape[0], nblk, 128)
    out = np.empty((a.shape[0], n_out))
    for r0 in range(0, n_out, 2048):  # row chunks: the ±1 matrix of a chunk is ~80 MB
        wc = w[r0 : r0 + 2048]
        bits = (wc[..., None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        sgn = (2.0 * bits - 1.0).reshape(wc.shape[0], nblk, 128)
        isum = np.einsum("rbk,tbk->trb", sgn, av)  # exact in f64
        scale = dw[r0 : r0 + 2048].astype(np.float64)[None] * u.astype(np.float64)[:, None, :]
        out[:, r0 : r0 + 2048] = (isum * scale).sum(axis=-1)
    return out


def time_production(cu: Cu, pmod, rng, n_out: int, n_in: int, nbuf: int, reps: int) -> dict:
    """The engine's dp4a mat-vecs on the same shape (random codes; timing only): its decode plan
    (rows per warp R, K split KS as in bench/results/cuda-decode-27b-q1.json's kernel profile) and
    the 5-row verify kernel with the same K split."""
    ks = 2 if n_out <= 15000 else 1
    r1 = 4 if ks == 2 else 8
    nsb, nblk = n_in // 32, n_in // 128
    codes = [cu.put(rng.integers(0, 256, size=n_out * n_in // 8, dtype=np.uint8)) for _ in range(nbuf)]
    sc = [cu.put((rng.random(n_out * nblk) * 0.01).astype(np.float16)) for _ in range(nbuf)]
    q = cu.put(rng.integers(-127, 128, size=5 * n_in, dtype=np.int8))
    da = cu.put((rng.random(5 * nsb) * 0.01).astype(np.float32))
    sa = cu.put(rng.integers(-500, 500, size=5 * nsb, dtype=np.int32))
    y = cu.zeros(5 * n_out * 4)
    out = {}
    for name, r, n in ((f"mv_q1_n1_r{r1}_k{ks}", r1, 1), (f"mv_q1_n5r8_k{ks}", 8, 5)):
        f = cu.func(pmod, name)
        grid = -(-n_out // ((4 // ks) * r))
        null = [P(0), P(0), P(0), 0]
        args = [
            [P(codes[j]), P(sc[j]), P(y), n_out] + null * 3 + [P(q), P(da), P(sa), n_in, n, 0, 1] for j in range(nbuf)
        ]
        out[name] = cu.time(f, grid, 128, args, reps)
    for p_ in codes + sc + [q, da, sa, y]:
        cu.free(p_)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cubin", default=str(HERE / "out" / "b1plane_sm90.cubin"))
    ap.add_argument("--out", default=str(HERE / "out" / "b1plane.json"))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--only", default="", help="regex on the shape names")
    ap.add_argument("--kernels", default="", help="regex on the kernel names")
    ap.add_argument("--prod", default="", help="the engine's cubin: time its dp4a kernels in the same harness")
    a = ap.parse_args()
    cu = Cu()
    cubin = Path(a.cubin)
    mod = cu.load(cubin)
    src = (HERE / "b1plane.cu").read_text()
    names = [
        f"bp_{m[0]}_k{m[1]}_g{m[2]}_r{m[3]}_n{m[4]}_u{m[5]}"
        for m in re.findall(r"^BP\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", src, re.M)
    ]
    if a.kernels:
        names = [k for k in names if re.search(a.kernels, k)]
    pmod = cu.load(Path(a.prod)) if a.prod else None
    fstream = cu.func(mod, "stream_read")
    cu.spin = cu.func(mod, "spin_ns")
    sink = cu.zeros(4 * 65536)
    rng = np.random.default_rng(5)
    results = []
    bad = 0
    for sname, n_out, n_in, per_tok, dp4a_us in SHAPES:
        if a.only and not re.search(a.only, sname):
            continue
        nblk = n_in // 128
        w = rng.integers(0, 1 << 32, size=(n_out, nblk, 4), dtype=np.uint64).astype(np.uint32)
        dw = (rng.random((n_out, nblk)) * 0.02 + 0.001).astype(np.float16)
        wbytes = n_out * nblk * 18  # the Q1_0 bytes (16 B codes + f16 scale per block)
        nbuf = max(1, int(np.ceil(120e6 / wbytes)))
        row = {
            "shape": sname,
            "n_out": n_out,
            "n_in": n_in,
            "launches_per_token": per_tok,
            "weight_MB": wbytes / 1e6,
            "buffers_rotated": nbuf,
            "dp4a_profile_us": dp4a_us,
            "kernels": {},
        }
        # streaming floor over the same bytes (codes + scales), rotated like the kernels
        words = wbytes // 16
        sbufs = [cu.zeros(words * 16) for _ in range(nbuf)]
        sgrid = min(cu.sms * 16, max(1, words // 256))
        us = cu.time(fstream, sgrid, 256, [[P(b), ctypes.c_uint64(words), P(sink)] for b in sbufs], a.reps)
        row["stream_read_us"] = us
        row["stream_read_GBps"] = wbytes / us / 1e3
        for p in sbufs:
            cu.free(p)
        gbps = wbytes / us / 1e3
        print(f"{sname}: {wbytes / 1e6:.1f} MB, stream {us:.2f} us ({gbps:.0f} GB/s), dp4a {dp4a_us}", flush=True)
        if pmod is not None:
            row["dp4a_same_harness"] = time_production(cu, pmod, rng, n_out, n_in, nbuf, a.reps)
            print("  dp4a (engine kernels):", json.dumps(row["dp4a_same_harness"]), flush=True)
        one_row = {}
        for np_ in (16, 8):
            lim = (1 << (np_ - 1)) - 1
            act = rng.integers(-lim, lim + 1, size=(5, n_in)).astype(np.int64)
            u = (rng.random((5, nblk)) * 1e-3 + 1e-5).astype(np.float32)
            wa, wd, xp, uu, xs = layouts(w, dw, act, u, np_)
            ref = reference(w, dw, act, u)
            pw = [cu.put(wa) for _ in range(nbuf)]
            pd = [cu.put(wd) for _ in range(nbuf)]
            px, pu, ps = cu.put(xp), cu.put(uu), cu.put(xs)
            py = cu.zeros(5 * n_out * 4)
            for k in names:
                m = KRE.fullmatch(k)
                NP, KS, RGW, RT, NT, UNR = (int(x) for x in m.groups())
                if NP != np_:
                    continue
                f = cu.func(mod, k)
                rows = 16 * RGW * RT
                grid = (n_out // 16 + RGW * RT - 1) // (RGW * RT)
                block = 32 * KS * RGW
                cu.launch(f, grid, block, [P(pw[0]), P(pd[0]), P(px), P(pu), P(ps), P(py), n_out, nblk])
                cu.ok(cu.cu.cuCtxSynchronize(), k)
                y = cu.get(py, (NT, n_out), np.float32)
                err = float(np.abs(y - ref[:NT]).max() / np.abs(ref[:NT]).max())
                args = [[P(pw[j]), P(pd[j]), P(px), P(pu), P(ps), P(py), n_out, nblk] for j in range(nbuf)]
                us = cu.time(f, grid, block, args, a.reps)
                r = {"us": us, "GBps": wbytes / us / 1e3, "rel_err": err, "grid": grid, "block": block}
                r["rows_per_block"] = rows
                if NT == 1:
                    one_row[(NP, KS)] = y[0].copy()
                elif (NP, KS) in one_row:
                    r["row0_equals_n1"] = bool(np.array_equal(one_row[(NP, KS)].view(np.uint32), y[0].view(np.uint32)))
                    bad += not r["row0_equals_n1"]
                if err > 1e-4:
                    bad += 1
                row["kernels"][k] = r
                eq = r.get("row0_equals_n1", "")
                print(f"  {k:28s} {us:8.2f} us {wbytes / us / 1e3:7.0f} GB/s  err {err:.1e} {eq}", flush=True)
            for p in pw + pd + [px, pu, ps, py]:
                cu.free(p)
        results.append(row)
    commit = HERE / "out" / "commit.txt"
    doc = {
        "command": "python3 bench/micro/b1plane.py",
        "commit": commit.read_text().strip() if commit.exists() else "unknown",
        "gpu": cu.name,
        "what": "Q1_0 mat-vec prototype on mma.m16n8k128.b1 with int16 (16 planes) or int8 (8 planes) "
        "per-128 activation codes; us per launch, back-to-back launches queued behind a spin kernel "
        "(no host gaps), weights rotated past the L2",
        "failures": bad,
        "shapes": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print("failures:", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
