"""Read bandwidth of this machine's memory, for the CPU roofline: each of N worker processes sums
its own array (past the caches) repeatedly; the aggregate is bytes read by all workers over the
slowest worker's time, best of the repeats. Run with 1 worker and with one per core.

    python3 bench/membw.py --workers 1,16 --mib 1024 --repeat 5 --out bench/results/membw.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time


def _worker(mib: int, repeat: int, start: mp.Barrier, q: mp.Queue) -> None:
    import numpy as np

    a = np.ones(mib * (1 << 20) // 4, dtype=np.float32)  # [mib MiB / 4] f32, touched once
    a.sum()
    times = []
    for _ in range(repeat):
        start.wait()
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    q.put(times)


def measure(workers: int, mib: int, repeat: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    start, q = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(mib, repeat, start, q)) for _ in range(workers)]
    for p in procs:
        p.start()
    per = [q.get() for _ in procs]
    for p in procs:
        p.join()
    # repeat r ends when its slowest worker ends
    slowest = [max(w[r] for w in per) for r in range(repeat)]
    best = min(slowest)
    gb = workers * mib * (1 << 20) / 1e9
    return {"workers": workers, "mib_each": mib, "best_s": best, "GBps": gb / best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default=f"1,{os.cpu_count() or 1}")
    ap.add_argument("--mib", type=int, default=1024, help="array per worker, MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [measure(int(w), a.mib, a.repeat) for w in a.workers.split(",")]
    for r in rows:
        print(f"membw: {r['workers']:3d} workers x {r['mib_each']} MiB: {r['GBps']:.1f} GB/s")
    if a.out:
        res = {"command": "python3 bench/membw.py", "cores": os.cpu_count(), "rows": rows}
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
