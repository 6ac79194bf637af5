#!/usr/bin/env python3
"""Full-model logit error of int8 activation quantization by scale group size (32 / 64 / 128).

The NumPy reference (tests/reference.py, float64) runs each synthetic model once exactly and once
per activation-quantization mode, rounding the input of every low-bit matmul; the logits of every
prompt position are compared with the exact run. This sizes the cost of one activation scale per
128 elements (the Q1_0 / Q2_0 weight block), the design that would make a tensor-core verify
bit-equal to the one-row decode kernel cheaply (crates/kernels-cuda/README.md).

Synthetic weights are random, so the activations are close to Gaussian: real models, with outlier
channels, lose more from coarser groups (see the README for a one-matrix check with outliers).

    python3 bench/act_group.py [--models DIR] [--tokens N]

Writes bench/results/act-group-cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests")]

import reference as ref  # noqa: E402

MODES = ["q8_0", "q8_g32", "q8_g64", "q8_g128"]


def synth(models: Path, preset: str, variant: str) -> Path:
    p = models / f"{preset}-{variant}.gguf"
    if not p.exists():
        subprocess.run(
            [sys.executable, "-m", "bonsai.synth", "--preset", preset, "--variant", variant, "--out", str(p)],
            check=True,
            capture_output=True,
            env={"PYTHONPATH": str(ROOT / "python")},
        )
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=Path, default=None, help="where the synthetic GGUFs are (made if missing)")
    ap.add_argument("--tokens", type=int, default=24, help="prompt length (logits of every position compared)")
    args = ap.parse_args()
    models = args.models or Path(tempfile.gettempdir()) / "bonsai-act-group"
    models.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in ("tiny", "small"):
        for variant in ("q1", "q2"):
            path = synth(models, preset, variant)
            exact_model = ref.Reference(path)
            ids = [int(i) for i in np.random.default_rng(7).integers(0, exact_model.n_vocab, args.tokens)]
            exact = exact_model.logits(ids)
            for mode in MODES:
                t0 = time.time()
                got = ref.Reference(path, act_quant=mode).logits(ids)
                rows.append(
                    {
                        "model": f"{preset}-{variant}",
                        "mode": mode,
                        "group": ref.ACT_QUANT[mode][0],
                        "f16_scale": ref.ACT_QUANT[mode][1],
                        "logits_nmse": ref.nmse(got, exact),
                        "top1_equal": int((got.argmax(1) == exact.argmax(1)).sum()),
                        "rows": len(ids),
                        "max_abs_diff": float(np.abs(got - exact).max()),
                        "seconds": round(time.time() - t0, 2),
                    }
                )
                r = rows[-1]
                print(
                    f"{r['model']:9s} {mode:8s} NMSE {r['logits_nmse']:.2e}  top-1 {r['top1_equal']}/{r['rows']}  "
                    f"max |d| {r['max_abs_diff']:.3f}"
                )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out = {
        "command": "python3 bench/act_group.py" + "".join(f" {a}" for a in sys.argv[1:]),
        "commit": commit.strip(),
        "device": "cpu (NumPy float64 reference)",
        "tokens": args.tokens,
        "rows": rows,
    }
    res = ROOT / "bench" / "results"
    (res / "act-group-cpu.json").write_text(json.dumps(out, indent=1) + "\n")
    md = [
        "Logit error of int8 activation quantization by scale group, NumPy reference on the synthetic "
        f"models, {args.tokens} prompt positions (commit {out['commit']}, `{out['command']}`). NMSE and top-1 "
        "agreement against the exact float64 run; `q8_0` is llama.cpp's (per 32, f16 scale), `q8_gN` "
        "this engine's (f32 scale) with N elements per scale.",
        "",
        "| model | mode | logits NMSE | top-1 equal | max abs diff |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {r['model']} | {r['mode']} | {r['logits_nmse']:.2e} | {r['top1_equal']}/{r['rows']} | "
        f"{r['max_abs_diff']:.3f} |"
        for r in rows
    ]
    (res / "act-group-cpu.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
