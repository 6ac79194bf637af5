#!/usr/bin/env python3
"""Two builds of bonsai against each other on the CPU DSpark round at the 27B shapes, alternating
processes: each process loads the synthetic 27B target and its random-weight drafter
(`speculative="always"`, greedy), runs 2 prompts × --gen tokens, and reports the draft and round
time per round and the tokens (which must be the same for both builds).

    pip install --no-deps --target /tmp/bonsai-a A.whl; pip install --no-deps --target /tmp/bonsai-b B.whl
    python3 bench/cpu_spec_ab.py /tmp/bonsai-a /tmp/bonsai-b --label-a OLD --label-b NEW \\
        [--reps 3] [--gen 12] [--models /tmp/bm] [--variant q1] [--name cpu-spec-ab-27b-q1]

The files are made by `bench/cpu_spec_27b.py` (or `python -m bonsai.synth`) into --models.
Writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from bonsai.bench import _commit, _cpu_name  # noqa: E402

CHILD = r"""
import json, sys
import numpy as np
import bonsai
target, drafter, gen = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(0)
prompts = [rng.integers(1000, 20000, size=32).tolist() for _ in range(2)]
eng = bonsai.Engine(target, device="cpu", draft=drafter, speculative="always")
eng.complete(prompts[0][:8], max_tokens=2, temperature=0, ignore_eos=True)
before = dict(eng.stats or {})
outs = [eng.complete(p, max_tokens=gen, temperature=0, ignore_eos=True).token_ids for p in prompts]
st = {k: v - before.get(k, 0) for k, v in (eng.stats or {}).items() if isinstance(v, (int, float))}
r = max(1, st["rounds"])
print(json.dumps({"module": bonsai.__file__, "rounds": r, "draft_ms": 1e3 * st["draft_seconds"] / r,
                  "round_ms": 1e3 * st["round_seconds"] / r, "outputs": outs}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="install dir of build A (pip install --target)")
    ap.add_argument("b", help="install dir of build B")
    ap.add_argument("--label-a", default="a")
    ap.add_argument("--label-b", default="b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=12)
    ap.add_argument("--models", default="/tmp/bm")
    ap.add_argument("--variant", default="q1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    target = Path(a.models) / f"27b-{a.variant}.gguf"
    drafter = Path(a.models) / f"27b-{a.variant}-dspark.gguf"
    for f in (target, drafter):
        if not f.exists():
            raise SystemExit(f"{f} is missing: run bench/cpu_spec_27b.py --variant {a.variant} first")
    builds = {a.label_a: a.a, a.label_b: a.b}
    rows = []
    for rep in range(a.reps):
        for label, path in builds.items():
            env = dict(os.environ, PYTHONPATH=path)
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(target), str(drafter), str(a.gen)],
                capture_output=True,
                text=True,
                env=env,
                timeout=1800,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r |= {"build": label, "rep": rep}
            rows.append(r)
            print(f"{label} rep {rep}: draft {r['draft_ms']:.1f} ms, round {r['round_ms']:.1f} ms", file=sys.stderr)
    same = len({json.dumps(r["outputs"]) for r in rows}) == 1
    summary = {}
    for label in builds:
        mine = [r for r in rows if r["build"] == label]
        summary[label] = {
            "draft_ms_median": statistics.median(r["draft_ms"] for r in mine),
            "round_ms_median": statistics.median(r["round_ms"] for r in mine),
            "draft_ms": [round(r["draft_ms"], 1) for r in mine],
            "round_ms": [round(r["round_ms"], 1) for r in mine],
        }
    name = a.name or f"cpu-spec-ab-27b-{a.variant}"
    result = {
        "command": "python3 bench/cpu_spec_ab.py " + " ".join(sys.argv[1:]),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "model": f"synth 27b {a.variant}, DSpark drafter with random weights (every draft rejected)",
        "gen": a.gen,
        "same_tokens": same,
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
    }
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"`{result['command']}` — commit {result['commit']}, {result['date']}; {result['cpu']}, "
        f"{result['cores']} cores; synthetic 27B {a.variant}, DSpark with a random-weight drafter, "
        f"2 prompts × {a.gen} tokens, {a.reps} alternating processes per build. Same tokens: "
        f"{'yes' if same else 'NO'}.",
        "",
        "| build | draft ms a round (median) | round ms (median) | draft ms, each run | round ms, each run |",
        "|---|---|---|---|---|",
    ]
    for label, s in summary.items():
        md.append(
            f"| {label} | {s['draft_ms_median']:.1f} | {s['round_ms_median']:.1f} | "
            f"{', '.join(f'{x:.0f}' for x in s['draft_ms'])} | {', '.join(f'{x:.0f}' for x in s['round_ms'])} |"
        )
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
