"""CPU prefill and decode by prompt length: bonsai builds against each other and against llama.cpp.

Each (engine, build) runs in its own process, the builds alternating, so one machine's state
serves every column. Per prompt length: prefill tok/s (prompt tokens / time to the first token)
and decode tok/s (the generated tokens after the first over their time), greedy, medians over the
repetitions. A build is a directory put first on PYTHONPATH (``pip install --target``), or ``-``
for the bonsai already importable.

    python3 bench/cpu_long_context.py --model small-q1.gguf --build old=/tmp/a --build new=- \\
        --llamacpp --lengths 512,2048,8192 --gen 32 --reps 2 --out bench/results --name cpu-longctx
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
from typing import Any

CHILD = r"""
import json, sys
from bonsai import bench, Engine
path, engine, threads, gen = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lengths = [int(x) for x in sys.argv[5].split(",")]
probe = Engine(path, device="cpu", threads=1, n_ctx=64)
first_special = min(probe.info["stop_ids"]) if probe.info["stop_ids"] else probe.info["n_vocab"]
del probe
prompts = bench._prompts(first_special, lengths, seed=1)
n_ctx = max(lengths) + gen + 8
# the first prompt runs twice (the first run, a warm-up, is dropped)
run = bench.bench_bonsai if engine == "bonsai" else bench.bench_llamacpp
print(json.dumps(run(path, threads, prompts, gen, n_ctx)["runs"]))
"""


def child(model: str, engine: str, pythonpath: str, threads: int, gen: int, lengths: list[int], timeout: float):
    env = dict(os.environ)
    if pythonpath != "-":
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-c", CHILD, model, engine, str(threads), str(gen), ",".join(map(str, lengths))]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if p.returncode != 0:
        return None, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"rc {p.returncode}"
    return json.loads(p.stdout.strip().splitlines()[-1]), f"{time.time() - t0:.0f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--build", action="append", default=[], help="name=PYTHONPATH dir, or name=- (repeatable)")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp through llama-cpp-python as a peer")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="cpu-long-context")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    builds = [tuple(b.split("=", 1)) for b in a.build] or [("bonsai", "-")]
    cols = [(name, "bonsai", pp) for name, pp in builds]
    if a.llamacpp:
        cols.append(("llama.cpp", "llamacpp", builds[-1][1]))
    runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in cols}
    log = []
    for rep in range(a.reps):
        for name, engine, pp in cols:
            res, note = child(a.model, engine, pp, a.threads, a.gen, lengths, a.timeout)
            msg = f"rep {rep} {name}: {note}"
            print(msg, file=sys.stderr, flush=True)
            log.append(msg)
            if res is not None:
                runs[name].extend(res)
    med = statistics.median
    table: dict[str, dict[int, dict[str, float]]] = {}
    for name, rs in runs.items():
        table[name] = {}
        for n in lengths:
            at = [r for r in rs if r["prompt_tokens"] == n]
            if at:
                table[name][n] = {
                    "prefill_tok_s": med(r["prefill_tok_s"] for r in at),
                    "decode_tok_s": med(r["decode_tok_s"] for r in at),
                    "runs": len(at),
                }
    from bonsai.bench import _commit, _cpu_name

    result = {
        "command": "python3 bench/cpu_long_context.py " + " ".join(sys.argv[1:]),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": {"cpu": _cpu_name(), "cores": os.cpu_count(), "threads": a.threads},
        "model": a.model,
        "settings": {"lengths": lengths, "gen": a.gen, "reps": a.reps, "greedy": True},
        "builds": dict(builds),
        "log": log,
        "runs": runs,
        "median": {k: {str(n): v for n, v in t.items()} for k, t in table.items()},
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    names = [c[0] for c in cols]
    lines = [
        f"CPU: {result['device']['cpu']}, {a.threads} threads; `{Path(a.model).name}`; greedy, {a.gen} generated "
        f"tokens; medians of {a.reps} processes per engine, alternating. Commit {result['commit']}, {result['date']}.",
        "",
        "| prompt tokens | " + " | ".join(f"{n} prefill tok/s | {n} decode tok/s" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for n in lengths:
        cells = []
        for name in names:
            v = table[name].get(n)
            cells += [f"{v['prefill_tok_s']:.1f}", f"{v['decode_tok_s']:.2f}"] if v else ["—", "—"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / f"{a.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
