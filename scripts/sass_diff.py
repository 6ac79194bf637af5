#!/usr/bin/env python3
"""Compare the SASS of every CUDA kernel between a git revision and the working tree, no GPU needed.

Both trees' kernels are compiled by NVRTC (each tree's own scripts/build_cubins.py) and
disassembled with cuobjdump; the functions are compared instruction by instruction, the
encodings and addresses left out. A refactor whose default kernels come out identical cannot
have changed their speed or their bits, which is worth knowing before any device time is spent.

    python scripts/sass_diff.py [--base HEAD] [--arch 90] [--nvrtc PATH] [--cuobjdump PATH]
                                [--repeat] [--show NAME]
    python scripts/sass_diff.py --loops NAME[,NAME..]   (the working tree only)

--loops prints, for each named kernel of the working tree, its longest loop (a backward branch
and what it spans): the instruction count and the most frequent opcodes, e.g. how many shifts
and masks a mat-vec issues beside its dot products per iteration.

--repeat compiles the working tree twice and marks the functions whose SASS differs between two
compiles of one source (NVRTC 13.5 does that for a few large kernels) as unstable, so a
difference there says nothing. cuobjdump: --cuobjdump, $CUOBJDUMP, PATH, /usr/local/cuda/bin, or
the pip package nvidia-cuda-cuobjdump (site-packages/nvidia/cu13/bin). Exit status 0 when every
common function is identical (unstable ones aside), 1 otherwise, 2 when a tool is missing.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUNC = re.compile(r"\s*Function : (\S+)")
# `/* 0x... */` encodings and `/*0123*/` addresses: not what a kernel computes
NOISE = re.compile(r"/\*[^*]*\*/")


def find_cuobjdump(explicit: str | None) -> str | None:
    cands = [explicit, os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    for d in site.getsitepackages() + [site.getusersitepackages()]:
        cands += glob.glob(os.path.join(d, "nvidia", "cu*", "bin", "cuobjdump"))
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def build(tree: Path, arch: int, nvrtc: str | None, out: Path) -> Path:
    """`tree`'s kernels compiled by `tree`'s own build_cubins.py into `out`."""
    cmd = [sys.executable, str(tree / "scripts" / "build_cubins.py"), "--arch", str(arch), "--out", str(out)]
    if nvrtc:
        cmd += ["--nvrtc", nvrtc]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    cubin = out / f"sm{arch}.cubin"
    if not cubin.exists():
        raise SystemExit(f"sass_diff: no cubin from {tree} (no libnvrtc? pass --nvrtc)")
    return cubin


def functions(cuobjdump: str, cubin: Path) -> dict[str, list[str]]:
    """Function name → its SASS lines without encodings, addresses and blank lines."""
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    funcs: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        if cur is not None:
            line = NOISE.sub("", line).strip()
            if line:
                cur.append(line)
    return funcs


def loops(cuobjdump: str, cubin: Path, name: str) -> str:
    """`name`'s longest loop (backward branch to the branch) as a line: span, size, top opcodes."""
    text = subprocess.run(
        [cuobjdump, "-sass", "-fun", name, str(cubin)], check=True, capture_output=True, text=True
    ).stdout
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*/\*", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    best = None
    for at, op in ins:
        m = re.search(r"BRA\s+(?:`\()?(0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) <= at:
            body = [o for a, o in ins if int(m.group(1), 16) <= a <= at]
            if best is None or len(body) > len(best[2]):
                best = (int(m.group(1), 16), at, body)
    if best is None:
        return f"{name}: no loop ({len(ins)} instructions)"
    ops: dict[str, int] = {}
    for o in best[2]:
        k = re.split(r"[ .;]", re.sub(r"^@!?U?P[T0-9]\s+", "", o))[0]
        ops[k] = ops.get(k, 0) + 1
    top = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:10])
    return f"{name}: loop {best[0]:#x}..{best[1]:#x}, {len(best[2])} instructions: {top}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare against (default HEAD)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--nvrtc", default=None, help="path of libnvrtc.so (else build_cubins.py's search)")
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--repeat", action="store_true", help="compile the working tree twice: mark unstable functions")
    ap.add_argument("--show", default=None, help="print the diff of this function")
    ap.add_argument("--loops", default=None, help="comma-separated kernels: their longest loop (working tree)")
    a = ap.parse_args()
    cuobjdump = find_cuobjdump(a.cuobjdump)
    if cuobjdump is None:
        print("sass_diff: no cuobjdump (pip install nvidia-cuda-cuobjdump, or pass --cuobjdump)", file=sys.stderr)
        return 2
    if a.loops:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = build(ROOT, a.arch, a.nvrtc, Path(tmp))
            for name in a.loops.split(","):
                print(loops(cuobjdump, cubin, name.strip()))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        wt = t / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(wt), a.base], check=True)
        try:
            old = functions(cuobjdump, build(wt, a.arch, a.nvrtc, t / "old"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False)
        new = functions(cuobjdump, build(ROOT, a.arch, a.nvrtc, t / "new"))
        unstable: set[str] = set()
        if a.repeat:
            again = functions(cuobjdump, build(ROOT, a.arch, a.nvrtc, t / "again"))
            unstable = {k for k in new if again.get(k) != new[k]}
    common = [k for k in old if k in new]
    differ = [k for k in common if old[k] != new[k]]
    print(f"sass_diff: {a.base} → working tree, sm_{a.arch}: {len(old)} / {len(new)} functions, {len(common)} in both")
    for k in sorted(set(new) - set(old)):
        print(f"  new      {k} ({len(new[k])} instructions)")
    for k in sorted(set(old) - set(new)):
        print(f"  removed  {k}")
    for k in differ:
        tag = "unstable" if k in unstable else "changed "
        print(f"  {tag} {k} ({len(old[k])} → {len(new[k])} instructions)")
    if a.show and a.show in old and a.show in new:
        sys.stdout.writelines(l + "\n" for l in difflib.unified_diff(old[a.show], new[a.show], lineterm="", n=1))
    real = [k for k in differ if k not in unstable]
    print(f"sass_diff: {len(common) - len(differ)} identical, {len(real)} changed, {len(differ) - len(real)} unstable")
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
