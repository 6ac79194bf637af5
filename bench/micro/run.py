#!/usr/bin/env python3
"""Time the kernels of bench/micro/throughput.cu (cubin from bench/micro/build.py) through the CUDA
driver API (ctypes, libcuda only) and write instruction throughput per SM and clock as JSON:
python3 bench/micro/run.py [--out FILE]. Scalar kinds report lane-operations per clock per SM; the
tensor-core kinds report warp-level MMA instructions per clock per SM and dense TOPS."""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CH, ITERS = 8, 4096
# kernel -> (what one counted operation is, operations per thread (scalar) or per warp (mma))
KINDS = {
    "k_dp4a": ("dp4a", CH * ITERS),
    "k_shf_lop": ("shift+and pair (2 instructions)", CH * ITERS),
    "k_unpack_dp4a": ("shift+and+dp4a triple (3 instructions)", CH * ITERS),
    "k_ffma": ("ffma", CH * ITERS),
    "k_i2f": ("i2f+fadd pair (2 instructions)", CH * ITERS),
    "k_mma_s8": ("mma m16n8k32 s8", ITERS),
    "k_mma_b1": ("mma m16n8k256 b1 and.popc", ITERS),
}
MACS = {"k_mma_s8": 16 * 8 * 32, "k_mma_b1": 16 * 8 * 256}


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"{what}: CUDA error {rc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "out" / "micro.json"))
    ap.add_argument("--cubin", default=str(HERE / "out" / "throughput_sm90.cubin"))
    a = ap.parse_args()
    cu = ctypes.CDLL("libcuda.so.1")
    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    name = ctypes.create_string_buffer(256)
    cu.cuDeviceGetName(name, 256, dev)
    sms, clk = ctypes.c_int(), ctypes.c_int()
    cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)  # MULTIPROCESSOR_COUNT
    cu.cuDeviceGetAttribute(ctypes.byref(clk), 13, dev)  # CLOCK_RATE (kHz, the maximum)
    ctx = ctypes.c_void_p()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
    check(cu.cuCtxSetCurrent(ctx), "ctx current")
    mod = ctypes.c_void_p()
    data = Path(a.cubin).read_bytes()
    check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data)), "module")
    out = ctypes.c_uint64()
    check(cu.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(64)), "alloc")
    e0, e1 = ctypes.c_void_p(), ctypes.c_void_p()
    cu.cuEventCreate(ctypes.byref(e0), 0)
    cu.cuEventCreate(ctypes.byref(e1), 0)
    blocks, threads = sms.value * 8, 256
    hz = clk.value * 1e3
    res = {}
    for k, (what, per) in KINDS.items():
        f = ctypes.c_void_p()
        rc = cu.cuModuleGetFunction(ctypes.byref(f), mod, k.encode())
        if rc != 0:
            res[k] = {"error": f"cuModuleGetFunction {rc}"}
            continue
        seed = ctypes.c_int(7)
        args = (ctypes.c_void_p * 2)(ctypes.addressof(out), ctypes.addressof(seed))
        best = None
        err = 0
        for _ in range(5):
            cu.cuEventRecord(e0, None)
            err = cu.cuLaunchKernel(f, blocks, 1, 1, threads, 1, 1, 0, None, args, None)
            cu.cuEventRecord(e1, None)
            err = err or cu.cuEventSynchronize(e1)
            if err:
                break
            ms = ctypes.c_float()
            cu.cuEventElapsedTime(ctypes.byref(ms), e0, e1)
            best = ms.value if best is None else min(best, ms.value)
        if err or best is None:
            res[k] = {"error": f"launch {err}"}
            print(f"{k:16s} error {err}", file=sys.stderr)
            continue
        s = best / 1e3
        if k in MACS:
            n = blocks * threads // 32 * per
            r = {
                "op": what,
                "ms": best,
                "instr_per_clk_per_sm": n / (s * hz * sms.value),
                "dense_TOPS": 2 * n * MACS[k] / s / 1e12,
            }
        else:
            n = blocks * threads * per
            r = {"op": what, "ms": best, "ops_per_clk_per_sm": n / (s * hz * sms.value)}
        res[k] = r
        print(k, json.dumps(r))
    commit = HERE / "out" / "commit.txt"
    doc = {
        "command": "python3 bench/micro/run.py",
        "commit": commit.read_text().strip() if commit.exists() else "unknown",
        "gpu": name.value.decode(),
        "sms": sms.value,
        "max_clock_mhz": clk.value / 1e3,
        "note": "rates use the maximum clock; under sustained load the clock may be lower, so these "
        "are lower bounds of the per-clock rate",
        "grid": [blocks, threads],
        "results": res,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
