"""CPU prefill by thread count, with the time inside / outside the parallel loops.

One process per thread count (the pool is sized at engine start): a warm-up request, then one
prompt of ``--tokens`` tokens and one generated token, with ``BONSAI_CPU_PAR_STATS=1`` so the
engine prints how much of the request ran inside its parallel loops.

    python3 bench/cpu_prefill_threads.py --model 27b-q1.gguf --tokens 256 --threads 16,8,4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import sys, time, bonsai
path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
e = bonsai.Engine(path, device="cpu", threads=threads, n_ctx=n + 16)
ids = [(7 * i + 3) % 1000 + 10 for i in range(n)]
e.complete(ids[:16], max_tokens=1, temperature=0, ignore_eos=True)
t = time.time()
r = e.complete(ids, max_tokens=1, temperature=0, ignore_eos=True)
print(f"threads {threads}: {n} tokens prefilled in {r.usage['prefill_seconds']:.2f} s "
      f"({n / r.usage['prefill_seconds']:.1f} tok/s)", flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", default="16,8,4")
    ap.add_argument("--out", default=None, help="JSON file for the lines printed")
    a = ap.parse_args()
    env = dict(os.environ, BONSAI_CPU_PAR_STATS="1")
    lines = []
    for t in a.threads.split(","):
        cmd = [sys.executable, "-c", CHILD, a.model, t, str(a.tokens)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        out = [x for x in (p.stdout + p.stderr).splitlines() if x.startswith(("threads", "bonsai par stats"))]
        for x in out:
            print(x, flush=True)
        lines.append({"threads": int(t), "rc": p.returncode, "lines": out})
    if a.out:
        from bonsai.bench import _commit, _cpu_name

        res = {
            "command": "python3 bench/cpu_prefill_threads.py " + " ".join(sys.argv[1:]),
            "commit": _commit(),
            "device": {"cpu": _cpu_name(), "cores": os.cpu_count()},
            "model": a.model,
            "tokens": a.tokens,
            "runs": lines,
        }
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
