"""The CPU engine gives the same bits on every instruction set it can run: full-model logits of a
chunked prefill and a greedy continuation under ``BONSAI_CPU_ISA=scalar``, ``avx2`` and ``avx512``
(each in its own process, since the ISA is chosen once per process), and AVX2 / AVX-512 with the
mask layouts off (``BONSAI_CPU_Q1M=0``, ``BONSAI_CPU_Q2M=0``), for every low-bit format.
An ISA this CPU lacks falls back to the best one, which the engine's device string shows; such a
run is left out of the comparison and named in the output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
import numpy as np
import bonsai
path, out = sys.argv[1], sys.argv[2]
eng = bonsai.Engine(path, device="cpu", threads=2)
ids = [(7 * i + 3) % 1000 for i in range(75)]  # 75 rows: full 8-row groups and a rest
lg = np.asarray(eng.logits(ids), dtype=np.float32)
gen = eng.complete(ids[:12], max_tokens=12, temperature=0, ignore_eos=True).token_ids
np.save(out, lg)
print(json.dumps({"device": eng.info["device"], "gen": list(gen)}))
"""


def run_isa(model: Path, isa: str, tmp: Path, masks: bool = True) -> tuple[str, np.ndarray, list[int]]:
    out = tmp / f"{model.stem}-{isa}-{int(masks)}.npy"
    on = "1" if masks else "0"
    env = dict(os.environ, BONSAI_CPU_ISA=isa, BONSAI_CPU_Q1M=on, BONSAI_CPU_Q2M=on, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    return info["device"], np.load(out), info["gen"]


@pytest.mark.parametrize("variant", ["tiny_q1", "tiny_q2", "tiny_q2g64", "tiny_pq2"])
def test_every_cpu_isa_gives_the_same_bits(variant, request, tmp_path):
    model = request.getfixturevalue(variant)
    runs = {isa: run_isa(model, isa, tmp_path) for isa in ("scalar", "avx2", "avx512")}
    # AVX2 and AVX-512 re-lay the Q1_0 and Q2 matrices of 512 inputs or more (the tiny model's
    # ffn_down) into their mask layout by default; the file layout too
    for isa in ("avx2", "avx512"):
        runs[f"{isa} file layout"] = run_isa(model, isa, tmp_path, masks=False)
    # the device string names the ISA that ran ("cpu (2 threads, Avx512)")
    ran = {isa: r for isa, r in runs.items() if r[0].lower().rstrip(")").endswith(isa.split()[0])}
    print(f"{variant}: ISAs run: {sorted(ran)}; fell back: {sorted(set(runs) - set(ran))}")
    assert "scalar" in ran, runs["scalar"][0]
    _, ref_lg, ref_gen = ran["scalar"]
    assert np.isfinite(ref_lg).all()
    for isa, (_, lg, gen) in ran.items():
        assert lg.shape == ref_lg.shape
        assert np.array_equal(lg.view(np.uint32), ref_lg.view(np.uint32)), (
            f"{variant}: {isa} logits differ from scalar in {(lg != ref_lg).sum()} places"
        )
        assert gen == ref_gen, f"{variant}: {isa} greedy tokens {gen} != scalar {ref_gen}"
