#!/usr/bin/env python3
"""DSpark round cost R on the CPU at the full 27B shapes (synthetic files).

`python -m bonsai bench --spec` measures the `small` model; this measures the real proportions:
the 27B target against the 27B-shaped DSpark drafter (random weights: every draft is rejected,
the case R is defined on), greedy, `speculative="always"`. It reports the plain decode step,
R = round time / plain step, the draft's share of a round, and whether the output equals plain
decoding token for token. (n-gram drafting finds nothing to propose in random text, so it is not
measured here.)

    python3 bench/cpu_spec_27b.py [--variant q1] [--gen 16] [--prompts 2] [--models /tmp/bm]
                                  [--name spec-cpu-27b-q1]

The files are generated into --models when missing (`python -m bonsai.synth`, ~15 s for the
target and ~50 s for the drafter on a 2-core machine). Writes bench/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

import numpy as np  # noqa: E402

from bonsai import Engine, synth  # noqa: E402
from bonsai.bench import _commit, _cpu_name  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="q1")
    ap.add_argument("--gen", type=int, default=16, help="tokens generated per prompt")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--models", default="/tmp/bm")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    models = Path(a.models)
    models.mkdir(parents=True, exist_ok=True)
    target = models / f"27b-{a.variant}.gguf"
    drafter = models / f"27b-{a.variant}-dspark.gguf"
    if not target.exists():
        synth.make_target(target, "27b", a.variant, progress=False)
    if not drafter.exists():
        synth.make_drafter(drafter, "27b", a.variant, progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1000, 20000, size=32).tolist() for _ in range(a.prompts)]

    def decode(eng: Engine) -> tuple[list[list[int]], int, float]:
        outs, toks, secs = [], 0, 0.0
        for p in prompts:
            c = eng.complete(p, max_tokens=a.gen, temperature=0, ignore_eos=True)
            toks += c.usage["completion_tokens"] - 1  # the first token comes from prefill
            secs += c.usage["decode_seconds"]
            outs.append(c.token_ids)
        return outs, toks, secs

    plain = Engine(str(target), device="cpu", threads=a.threads)
    plain.complete(prompts[0][:8], max_tokens=2, temperature=0, ignore_eos=True)  # warm-up
    base_out, base_toks, base_secs = decode(plain)
    step_s = base_secs / base_toks
    print(f"plain: {1e3 * step_s:.1f} ms a step, {1 / step_s:.2f} tok/s", file=sys.stderr)
    del plain
    rows = []
    for name, d in (("dspark-random", str(drafter)),):
        eng = Engine(str(target), device="cpu", threads=a.threads, draft=d, speculative="always")
        eng.complete(prompts[0][:8], max_tokens=2, temperature=0, ignore_eos=True)
        before = dict(eng.stats or {})
        out, toks, secs = decode(eng)
        st = {k: v - before.get(k, 0) for k, v in (eng.stats or {}).items() if isinstance(v, (int, float))}
        rounds = max(1, st.get("rounds", 0))
        round_s = st["round_seconds"] / rounds
        draft_s = st["draft_seconds"] / rounds
        rows.append(
            {
                "drafter": name,
                "lossless": out == base_out,
                "rounds": st.get("rounds", 0),
                "plain_tokens": st.get("plain_tokens", 0),
                "R": round_s / step_s,
                "round_ms": 1e3 * round_s,
                "draft_ms": 1e3 * draft_s,
                "draft_steps": draft_s / step_s,
                "rest_steps": (round_s - draft_s) / step_s,
                "acceptance": st["accepted_tokens"] / max(1, st["drafted_tokens"]),
                "tok_per_s": toks / secs,
                "speedup": (toks / secs) * step_s,
            }
        )
        print(rows[-1], file=sys.stderr)
        del eng
    name = a.name or f"spec-cpu-27b-{a.variant}"
    result = {
        "command": "python3 bench/cpu_spec_27b.py " + " ".join(sys.argv[1:]),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "threads": a.threads,
        "model": f"synth 27b {a.variant}, DSpark drafter with random weights",
        "gen": a.gen,
        "prompts": a.prompts,
        "plain_step_ms": 1e3 * step_s,
        "plain_tok_per_s": 1 / step_s,
        "rounds": rows,
    }
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"`{result['command']}` — commit {result['commit']}, {result['date']}; {result['cpu']}, "
        f"{a.threads} threads; synthetic 27B {a.variant}, greedy, {a.prompts} prompts × {a.gen} tokens. "
        f"Plain decode: {1e3 * step_s:.1f} ms a step ({1 / step_s:.2f} tok/s).",
        "",
        "| drafter | R (round / plain step) | draft ms a round | draft, in steps | verify + rollback, in steps "
        "| acceptance | tok/s | vs plain | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['drafter']} | {r['R']:.2f} | {r['draft_ms']:.0f} | {r['draft_steps']:.2f} | "
            f"{r['rest_steps']:.2f} | {r['acceptance']:.2f} | {r['tok_per_s']:.2f} | {r['speedup']:.2f}× | "
            f"{'yes' if r['lossless'] else 'NO'} |"
        )
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
