"""Vulkan backend: decode tok/s with one submission per step (default) against a submit + fence wait
after every block (``BONSAI_VK_EAGER_SUBMIT=1``), alternating in one process on the same file.

    python bench/vulkan_submit.py [--preset tiny|small] [--variant q1] [--gen 32] [--rounds 3]

Writes ``bench/results/vulkan-submit-<preset>-<variant>.json`` (command, commit, device, every
sample) and a Markdown table beside it. Runs on any Vulkan device, llvmpipe included (then the
numbers are a CPU driver's, and say so through the device name).
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

from bonsai.bench import _commit, _cpu_name


def decode_tok_s(path: str, eager: bool, gen: int, prompt: list[int]) -> tuple[float, str]:
    import bonsai

    os.environ["BONSAI_VK_EAGER_SUBMIT"] = "1" if eager else "0"
    eng = bonsai.Engine(path, device="vulkan", n_ctx=512)
    device = eng.info["device"]
    list(eng.generate(prompt, max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    first = None
    n = 0
    for c in eng.generate(prompt, max_tokens=gen, temperature=0, ignore_eos=True):
        if c.token_ids:
            n += len(c.token_ids)
            if first is None:
                first = time.perf_counter()
    t1 = time.perf_counter()
    del eng
    return (n - 1) / (t1 - first), device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--variant", default="q1")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default=os.environ.get("BONSAI_BENCH_MODELS", "models"))
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    path = Path(a.models) / f"{a.preset}-{a.variant}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "bonsai.synth", "--preset", a.preset, "--variant", a.variant]
            + ["--out", str(path), "--no-progress"],
            check=True,
        )
    prompt = [(i * 7919 + 11) % 200 for i in range(16)]
    samples: dict[str, list[float]] = {"deferred": [], "eager": []}
    device = ""
    for _ in range(a.rounds):
        for mode in ("eager", "deferred"):
            v, device = decode_tok_s(str(path), mode == "eager", a.gen, prompt)
            samples[mode].append(v)
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": device,
        "host_cpu": _cpu_name(),
        "model": f"{a.preset}-{a.variant}",
        "gen": a.gen,
        "samples_tok_s": samples,
        "median_tok_s": med,
        "ratio_deferred_over_eager": med["deferred"] / med["eager"],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"vulkan-submit-{a.preset}-{a.variant}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"# Vulkan decode: one submission per step vs one per block ({result['model']})",
        "",
        f"Device: {device}. Host CPU: {result['host_cpu']}. Commit {result['commit']}, {result['date']}.",
        f"Greedy decode of {a.gen} tokens after a 16-token prompt; {a.rounds} alternating rounds, median.",
        "",
        "| submission | decode tok/s (median) | samples |",
        "|---|---|---|",
    ]
    for k in ("eager", "deferred"):
        label = "per block (`BONSAI_VK_EAGER_SUBMIT=1`)" if k == "eager" else "per step (default)"
        md.append(f"| {label} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in samples[k])} |")
    md.append("")
    md.append(f"Ratio per step / per block: {result['ratio_deferred_over_eager']:.2f}.")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
