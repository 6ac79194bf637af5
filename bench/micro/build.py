#!/usr/bin/env python3
"""Compile bench/micro/throughput.cu (or --src FILE) to an sm_90 cubin with NVRTC (ctypes; no toolkit needed):
python3 bench/micro/build.py [--nvrtc PATH]. The cubin lands in bench/micro/out/ (ignored by git)."""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def find_nvrtc(explicit: str | None) -> str:
    if explicit:
        return explicit
    for pat in (
        "/tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc.so*",
        "/usr/local/cuda/lib64/libnvrtc.so*",
        os.path.expanduser("~/.local/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so*"),
    ):
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[0]
    raise SystemExit("libnvrtc not found: pass --nvrtc")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--src", default="throughput.cu")
    a = ap.parse_args()
    lib = ctypes.CDLL(find_nvrtc(a.nvrtc))
    src = (HERE / a.src).read_bytes()
    stem = Path(a.src).stem
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, a.src.encode(), 0, None, None) == 0
    opts = [f"--gpu-architecture=sm_{a.arch}".encode(), b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit(f"nvrtc failed ({rc}):\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    assert lib.nvrtcGetCUBIN(prog, cubin) == 0
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / f"{stem}_sm{a.arch}.cubin").write_bytes(cubin.raw)
    # the device copy has no .git: record what was built
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    (out / "commit.txt").write_text(rev.stdout.strip() or "unknown")
    print(f"bench/micro/out/{stem}_sm{a.arch}.cubin: {n.value} bytes")


if __name__ == "__main__":
    main()
