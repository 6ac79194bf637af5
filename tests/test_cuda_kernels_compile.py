"""The CUDA kernel source compiles with NVRTC for the architectures a wheel ships, so that a GPU
without an embedded cubin still gets its kernels at first use. No GPU needed.

sm_80 stands for every pre-Hopper target (sm_86 and sm_89 take the same code paths: the kernels
that need thread-block clusters or bulk copies compile to trapping stubs there, and the host never
launches them); sm_90 is compiled as sm_90a, with the wgmma GEMMs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_compile_for_ampere_and_hopper(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_cubins.py"), "--arch", "80,90", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert "no libnvrtc found" not in log, "NVRTC is missing: scripts/setup.sh --test installs nvidia-cuda-nvrtc"
    for arch in (80, 90):
        cubin = tmp_path / f"sm{arch}.cubin"
        assert cubin.exists() and cubin.stat().st_size > 100_000, log
        assert cubin.read_bytes()[:4] == b"\x7fELF"
