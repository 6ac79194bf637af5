"""The CPU forward's parallel loops on the spinning pool against rayon (`BONSAI_CPU_SPIN=0`), in
one process, alternating: an engine per run (the switch is read at load), the same prompts, decode
tok/s and prefill as `python -m bonsai bench` measures them. With `BONSAI_CPU_PAR_STATS=1` the
engine also prints, per request, its parallel loops and the time inside and outside them.

    python3 bench/cpu_spin_ab.py --models /tmp/m/small-q1.gguf,/tmp/m/27b-q1.gguf --reps 3 \\
        --out bench/results --name cpu16-spin-ab
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

try:
    import bonsai  # noqa: F401  (an installed wheel first: the device copy of the tree has no .so)
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from bonsai import Engine  # noqa: E402
from bonsai.bench import _commit, _cpu_name, _prompts, _summ, bench_bonsai  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True, help="comma list of GGUF files")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prompt-lengths", default="16,32")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="cpu-spin-ab")
    a = ap.parse_args()
    lengths = [int(x) for x in a.prompt_lengths.split(",")]
    res = {
        "command": "python3 bench/cpu_spin_ab.py " + " ".join(sys.argv[1:]),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": {"cpu": _cpu_name(), "cores": os.cpu_count(), "threads": a.threads},
        "what": "decode tok/s, spinning pool (BONSAI_CPU_SPIN=1, the default) against rayon (0), "
        "alternating engines in one process; medians over prompts per run",
        "models": {},
    }
    for path in a.models.split(","):
        probe = Engine(path, device="cpu", threads=1, n_ctx=64)
        first_special = min(probe.info["stop_ids"]) if probe.info["stop_ids"] else probe.info["n_vocab"]
        del probe
        prompts = _prompts(first_special, lengths, seed=1)
        runs: dict[str, list[dict]] = {"0": [], "1": []}
        for rep in range(a.reps):
            for spin in ("0", "1"):
                os.environ["BONSAI_CPU_SPIN"] = spin
                b = bench_bonsai(Path(path), a.threads, prompts, a.gen, max(lengths) + a.gen + 8)
                s = _summ(b)
                runs[spin].append(s)
                print(
                    f"spin-ab {Path(path).name} rep {rep} spin={spin}: decode {s['decode_tok_s']:.2f} tok/s, "
                    f"prefill {s['prefill_tok_s']:.1f} tok/s",
                    flush=True,
                )
                gc.collect()
        med = {k: statistics.median(r["decode_tok_s"] for r in v) for k, v in runs.items()}
        res["models"][Path(path).name] = {
            "runs": runs,
            "decode_tok_s_median": med,
            "spin_over_rayon": med["1"] / med["0"],
        }
        ratio = med["1"] / med["0"]
        print(f"spin-ab {Path(path).name}: rayon {med['0']:.2f}, spin {med['1']:.2f} tok/s ({ratio:.2f}x)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
