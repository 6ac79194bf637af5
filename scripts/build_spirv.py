#!/usr/bin/env python3
"""Compile the Vulkan compute shaders to the committed SPIR-V in crates/kernels-vulkan/spv.

The crate's build.rs compiles them itself whenever glslc is installed; these committed modules are
what a build without glslc (a wheel build on a machine with no Vulkan SDK) embeds. build.rs refuses
them once the sources change, so run this after editing a shader (needs glslc).
"""

import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent / "crates" / "kernels-vulkan"
SRC, SPV = ROOT / "shaders", ROOT / "spv"


def source_hash() -> str:
    """FNV-1a 64 over every file of shaders/ in name order: name, NUL, contents, NUL (as build.rs)."""
    h = 0xCBF29CE484222325
    for p in sorted(x for x in SRC.iterdir() if x.is_file()):
        for b in p.name.encode() + b"\0" + p.read_bytes() + b"\0":
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def main() -> None:
    if shutil.which("glslc") is None:
        raise SystemExit("build_spirv: glslc not found (Debian: apt-get install glslc)")
    SPV.mkdir(exist_ok=True)
    names = []
    for line in (SRC / "variants.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, file, *defines = line.split()
        cmd = ["glslc", "-O", "--target-env=vulkan1.2", *defines, str(SRC / file), "-o", str(SPV / f"{name}.spv")]
        subprocess.run(cmd, check=True)
        names.append(name)
    for old in SPV.glob("*.spv"):
        if old.stem not in names:
            old.unlink()
    version = subprocess.run(["glslc", "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    (SPV / "manifest.txt").write_text(f"source_fnv64 {source_hash()}\nglslc {version}\nmodules {' '.join(names)}\n")
    print(f"build_spirv: {len(names)} modules, sources {source_hash()}")


if __name__ == "__main__":
    main()
