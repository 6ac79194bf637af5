"""Decode and prefill speed through the Python API, per device, on the same GGUF files.

    python bench/gpu_api_decode.py --models /tmp/m/27b-q1.gguf,/tmp/m/27b-q2.gguf --devices vulkan,cuda

A device ``vulkan:f32`` or ``vulkan:int8`` runs Vulkan with that activation mode (``BONSAI_VK_ACT``);
``cuda:dp4a`` runs CUDA with the norm-fed projections kept in both weight layouts
(``BONSAI_CUDA_B1P_DP4A=1``; the default keeps only the b1-plane one where the prefill GEMM reads it).
The GPU memory column is what ``nvidia-smi`` reports for this process after the warm-up.

For every (model, device): load, warm up, then greedy decode of ``--gen`` tokens after each of
``--prompts`` different 16-token prompts (decode tok/s = tokens after the first / time from the first
token to the last), and a ``--pp``-token prefill (time to the first token) repeated ``--pp-reps``
times. Medians are reported; every sample is kept in the JSON. The devices run one after the other
in one process, so their ratio is a same-machine, same-file comparison.

Writes ``<out>/<name>.json`` (command, commit, date, device names, host CPU, samples, medians) and
``<out>/<name>.md`` (a table).
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

from bonsai.bench import _commit, _cpu_name


def process_gpu_mib() -> float | None:
    """This process's GPU memory in MiB as nvidia-smi reports it (None where it cannot say)."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()):
            try:
                return float(mib)
            except ValueError:
                return None
    return None


def run_one(path: str, device: str, gen: int, prompts: int, pp: int, pp_reps: int) -> dict:
    import bonsai

    device, _, mode = device.partition(":")
    if mode and device == "vulkan":
        os.environ["BONSAI_VK_ACT"] = mode  # read when the backend is created
    if mode == "dp4a" and device == "cuda":
        os.environ["BONSAI_CUDA_B1P_DP4A"] = "1"  # read when the weights are loaded
    t0 = time.perf_counter()
    try:
        eng = bonsai.Engine(path, device=device, n_ctx=max(1024, pp + gen + 64))
    finally:
        os.environ.pop("BONSAI_VK_ACT", None)
        os.environ.pop("BONSAI_CUDA_B1P_DP4A", None)
    load_s = time.perf_counter() - t0
    name = eng.info["device"]
    vocab = 200  # token ids of the synthetic tokenizer's plain range

    def prompt(seed: int, n: int) -> list[int]:
        return [(i * 7919 + 11 * seed + 13) % vocab + 3 for i in range(n)]

    list(eng.generate(prompt(0, 16), max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    gpu_mib = process_gpu_mib()
    decode: list[float] = []
    for s in range(prompts):
        first = None
        n = 0
        for c in eng.generate(prompt(s + 1, 16), max_tokens=gen, temperature=0, ignore_eos=True):
            if c.token_ids:
                n += len(c.token_ids)
                if first is None:
                    first = time.perf_counter()
        t1 = time.perf_counter()
        if first is None or n < 2:
            raise RuntimeError(f"{device}: no tokens generated")
        decode.append((n - 1) / (t1 - first))
    prefill: list[float] = []
    for s in range(pp_reps):
        t = time.perf_counter()
        for _ in eng.generate(prompt(100 + s, pp), max_tokens=1, temperature=0, ignore_eos=True):
            pass
        prefill.append(pp / (time.perf_counter() - t))
    del eng
    gc.collect()
    return {
        "device": name,
        "load_s": load_s,
        "decode_tok_s": decode,
        "prefill_tok_s": prefill,
        "decode_median": statistics.median(decode),
        "prefill_median": statistics.median(prefill),
        "gpu_mib_after_warmup": gpu_mib,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="comma list of GGUF paths")
    ap.add_argument("--devices", default="vulkan,cuda")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--pp-reps", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="gpu-api-decode")
    a = ap.parse_args()
    rows = []
    for path in a.models.split(","):
        for dev in a.devices.split(","):
            try:
                r = run_one(path, dev, a.gen, a.prompts, a.pp, a.pp_reps)
            except Exception as e:  # noqa: BLE001 - a device that cannot run is reported, not fatal
                r = {"device": dev, "error": f"{type(e).__name__}: {e}"}
            r["model"] = Path(path).name
            r["requested"] = dev
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), flush=True)
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        # a device copy has no .git: scripts/vk_gpu_check.sh passes what was built
        "commit": os.environ.get("BONSAI_BUILD_COMMIT") or _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host_cpu": _cpu_name(),
        "gen": a.gen,
        "prompts": a.prompts,
        "pp": a.pp,
        "rows": rows,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"Python API, greedy, {a.gen} generated tokens after each of {a.prompts} prompts (median), "
        f"prefill of {a.pp} tokens (median of {a.pp_reps}). Commit {result['commit']}, {result['date']}.",
        "",
        "| model | device | decode tok/s | prefill tok/s | GPU memory (process) | load s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['requested']} | error: {r['error']} | | | |")
        else:
            mib = r.get("gpu_mib_after_warmup")
            mem = f"{mib / 1024:.2f} GiB" if mib else "n/a"
            lines.append(
                f"| {r['model']} | {r['device']} ({r['requested']}) | {r['decode_median']:.1f} "
                f"({min(r['decode_tok_s']):.1f}–{max(r['decode_tok_s']):.1f}) | {r['prefill_median']:.0f} | "
                f"{mem} | {r['load_s']:.1f} |"
            )
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
