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

MODES = ["q8_0", "q8_g32", "q8_g64", "q8_g128", "q8_g128m8", "q8_g128m16"]


def quantize(x: np.ndarray, mode: str) -> np.ndarray:
    group, f16, levels = ref.ACT_QUANT[mode]
    if levels:
        return ref.quantize_act_q8_sub(x, group, 32, levels)
    return ref.quantize_act_q8(x, group, f16_scale=f16)


def one_matrix(rows: int = 1024, k: int = 5120, samples: int = 64) -> list[dict]:
    """NMSE of y = W·x with int8 activations against exact x, for one ±1·scale (Q1_0-like) matrix
    and three activation laws: Gaussian, Student t with 3 degrees of freedom (heavy tails), and
    Gaussian with 8 outlier channels at 30σ (what real models have and random synthetic ones lack)."""
    rng = np.random.default_rng(11)
    w = np.where(rng.random((rows, k)) < 0.5, -1.0, 1.0) * rng.uniform(0.01, 0.03, (rows, k // 128)).repeat(128, 1)
    laws = {
        "gaussian": rng.standard_normal((samples, k)),
        "student_t3": rng.standard_t(3, (samples, k)),
        "outliers8": rng.standard_normal((samples, k)),
    }
    laws["outliers8"][:, rng.choice(k, 8, replace=False)] *= 30.0
    out = []
    for law, x in laws.items():
        y = x @ w.T
        for mode in MODES:
            out.append({"law": law, "mode": mode, "nmse": ref.nmse(quantize(x, mode) @ w.T, y)})
    return out


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
                        "sub_scale_levels": ref.ACT_QUANT[mode][2],
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
    mat = one_matrix()
    for r in mat:
        print(f"one matrix {r['law']:10s} {r['mode']:10s} NMSE {r['nmse']:.2e}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out = {
        "command": "python3 bench/act_group.py" + "".join(f" {a}" for a in sys.argv[1:]),
        "commit": commit.strip(),
        "device": "cpu (NumPy float64 reference)",
        "tokens": args.tokens,
        "rows": rows,
        "one_matrix": mat,
    }
    res = ROOT / "bench" / "results"
    (res / "act-group-cpu.json").write_text(json.dumps(out, indent=1) + "\n")
    md = [
        "Logit error of int8 activation quantization by scale group, NumPy reference on the synthetic "
        f"models, {args.tokens} prompt positions (commit {out['commit']}, `{out['command']}`). NMSE and top-1 "
        "agreement against the exact float64 run; `q8_0` is llama.cpp's (per 32, f16 scale), `q8_gN` "
        "this engine's (f32 scale) with N elements per scale; `q8_g128mL`: one f32 scale per 128 and an "
        "integer sub-scale 1..L per 32 (`reference.quantize_act_q8_sub`: sub-block products add up "
        "exactly in int32 inside a 128 block, one float rescale per block).",
        "",
        "| model | mode | logits NMSE | top-1 equal | max abs diff |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {r['model']} | {r['mode']} | {r['logits_nmse']:.2e} | {r['top1_equal']}/{r['rows']} | "
        f"{r['max_abs_diff']:.3f} |"
        for r in rows
    ]
    laws = list(dict.fromkeys(r["law"] for r in mat))
    md += [
        "",
        "One 5120-wide ±1·scale matrix (1024 rows, 64 activation vectors): NMSE of W·x with int8 "
        "activations against exact x, by activation law (Student t with 3 degrees of freedom; 8 "
        "outlier channels at 30σ).",
        "",
        "| mode | " + " | ".join(laws) + " |",
        "|---|" + "---|" * len(laws),
    ]
    for mode in MODES:
        cells = [f"{r['nmse']:.2e}" for law in laws for r in mat if r["law"] == law and r["mode"] == mode]
        md.append(f"| {mode} | " + " | ".join(cells) + " |")
    (res / "act-group-cpu.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
