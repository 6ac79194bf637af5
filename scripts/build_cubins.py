#!/usr/bin/env python3
"""Precompile bonsai's CUDA kernels with NVRTC for the common GPU architectures, for embedding in
the wheel (crates/kernels-cuda/build.rs picks up crates/kernels-cuda/cubins/ when it exists).

A wheel built after this needs no NVRTC at run time on those architectures; other architectures,
or a source that no longer matches the manifest's hash, fall back to NVRTC at first use with the
on-disk cache (crates/kernels-cuda/README.md). Without NVRTC this script says so and exits 0 (the
wheel is then built without embedded cubins).

    python scripts/build_cubins.py [--arch 80,86,89,90] [--nvrtc /path/libnvrtc.so]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KDIR = ROOT / "crates" / "kernels-cuda"


def source_files() -> list[str]:
    """The .cu files of lib.rs's `SOURCE` (one NVRTC translation unit), in its order."""
    lib = (KDIR / "src" / "lib.rs").read_text()
    block = lib[lib.index("pub const SOURCE: &str = concat!(") :]
    block = block[: block.index(");")]
    return re.findall(r'include_str!\("\.\./kernels/([\w.]+\.cu)"\)', block)


def fnv64(parts: list[bytes]) -> int:
    """FNV-1a 64 over the parts with a 0xff separator after each (lib.rs's `fnv64`)."""
    h = 0xCBF29CE484222325
    for p in parts:
        for b in p:
            h ^= b
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        h ^= 0xFF
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def find_nvrtc(explicit: str | None) -> str | None:
    cands = [explicit] if explicit else []
    cands += [os.environ.get("NVRTC_LIB", "")]
    try:
        import nvidia.cu13  # type: ignore[import-not-found]

        cands += glob.glob(os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so*"))
    except ImportError:
        pass
    cands += glob.glob("/usr/local/cuda/lib64/libnvrtc.so*") + glob.glob("/tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc.so*")
    cands += ["libnvrtc.so", "libnvrtc.so.13"]
    for c in cands:
        if not c or "builtins" in c:
            continue
        try:
            ctypes.CDLL(c)
            return c
        except OSError:
            continue
    return None


def compile_cubin(lib: ctypes.CDLL, src: bytes, arch: int) -> bytes:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"bonsai.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    # the options of lib.rs's `compile_cubin` (sm_90 as sm_90a: the wgmma kernels need it)
    name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    opts = [f"--gpu-architecture={name}".encode(), b"--std=c++17", b"--fmad=true"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC compile for sm_{arch} failed:\n{log.value.decode()}")
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw[: n.value]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="80,86,89,90", help="comma-separated sm versions")
    ap.add_argument("--nvrtc", default=None, help="path of libnvrtc.so")
    ap.add_argument("--out", default=str(KDIR / "cubins"))
    a = ap.parse_args()
    path = find_nvrtc(a.nvrtc)
    if path is None:
        print("build_cubins: no libnvrtc found; the wheel will compile kernels at first use", file=sys.stderr)
        return 0
    lib = ctypes.CDLL(path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    src = b"".join((KDIR / "kernels" / f).read_bytes() for f in source_files())
    h = fnv64([src, b""])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("sm*.cubin"):
        old.unlink()
    archs = [int(x) for x in a.arch.split(",") if x]
    for arch in archs:
        cubin = compile_cubin(lib, src, arch)
        (out / f"sm{arch}.cubin").write_bytes(cubin)
        print(f"build_cubins: sm_{arch}: {len(cubin):,} bytes")
    (out / "manifest.txt").write_text(
        f"source_fnv64 {h:016x}\nnvrtc {major.value}.{minor.value}\narchs {' '.join(map(str, archs))}\n"
    )
    print(f"build_cubins: {len(archs)} cubins for source {h:016x} (NVRTC {major.value}.{minor.value}) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
