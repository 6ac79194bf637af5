"""``python -m bonsai bench``: CPU decode tok/s, prefill tok/s and TTFT against llama.cpp
(through llama-cpp-python) on the same synthetic ``small`` file, in the same run, same threads.

Writes ``bench/results/<name>.json`` (command, commit, device, every sample) and a rendered
Markdown table ``bench/results/<name>.md``. Medians over prompts after one discarded warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _prompts(n_vocab_text: int, lengths: list[int], seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # ordinary (byte/merge) token ids only: avoid the specials at the top of the text vocabulary
    return [rng.integers(0, n_vocab_text, size=n).tolist() for n in lengths]


def bench_bonsai(path: Path, threads: int, prompts: list[list[int]], gen: int, n_ctx: int) -> dict[str, Any]:
    from . import Engine

    eng = Engine(path, device="cpu", threads=threads, n_ctx=n_ctx)
    runs = []
    for i, p in enumerate([prompts[0]] + prompts):  # first run is a discarded warm-up
        t0 = time.perf_counter()
        stamps = []
        for c in eng.generate(p, max_tokens=gen, temperature=0.0, ignore_eos=True):
            if c.token_ids:
                stamps.append(time.perf_counter())
        if i == 0:
            continue
        n = len(stamps)
        runs.append(
            {
                "prompt_tokens": len(p),
                "generated": n,
                "ttft_s": stamps[0] - t0,
                "prefill_tok_s": len(p) / (stamps[0] - t0),
                "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0,
            }
        )
    return {"engine": "bonsai", "device": eng.info["device"], "runs": runs}


def bench_llamacpp(path: Path, threads: int, prompts: list[list[int]], gen: int, n_ctx: int) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
    )
    runs = []
    for i, p in enumerate([prompts[0]] + prompts):
        llm.reset()
        t0 = time.perf_counter()
        stamps = []
        for _tok in llm.generate(p, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) >= gen:
                break
        if i == 0:
            continue
        n = len(stamps)
        runs.append(
            {
                "prompt_tokens": len(p),
                "generated": n,
                "ttft_s": stamps[0] - t0,
                "prefill_tok_s": len(p) / (stamps[0] - t0),
                "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0,
            }
        )
    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "runs": runs}


def _summ(res: dict[str, Any]) -> dict[str, float]:
    r = res["runs"]
    med = statistics.median
    return {
        "decode_tok_s": med(x["decode_tok_s"] for x in r),
        "decode_min": min(x["decode_tok_s"] for x in r),
        "decode_max": max(x["decode_tok_s"] for x in r),
        "prefill_tok_s": med(x["prefill_tok_s"] for x in r),
        "ttft_ms": 1000 * med(x["ttft_s"] for x in r),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bonsai bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--variants", default="q1,q2g64", help="comma list (llama.cpp runs q1 and q2g64)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--prompt-lengths", default="16,64,128,256,512")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--models", default=os.environ.get("BONSAI_BENCH_MODELS", "models"), help="model cache dir")
    ap.add_argument("--out", default="bench/results", help="results dir")
    ap.add_argument("--name", default=None, help="result file stem (default cpu-<preset>)")
    args = ap.parse_args(argv)

    from . import synth

    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    n_ctx = max(lengths) + args.gen + 8
    result: dict[str, Any] = {
        "command": "python -m bonsai bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": {"cpu": _cpu_name(), "cores": os.cpu_count(), "threads": args.threads},
        "settings": {"preset": args.preset, "gen": args.gen, "prompt_lengths": lengths, "greedy": True},
        "variants": {},
    }
    rows = []
    for variant in args.variants.split(","):
        path = models / f"{args.preset}-{variant}.gguf"
        if not path.exists():
            print(f"bench: generating {path}", file=sys.stderr)
            synth.make_target(path, preset=args.preset, variant=variant, seed=0, progress=False)
        # text ids: the BPE part of the vocabulary (below the first special token)
        from . import Engine

        probe = Engine(path, device="cpu", threads=1, n_ctx=64)
        first_special = min(probe.info["stop_ids"]) if probe.info["stop_ids"] else probe.info["n_vocab"]
        del probe
        prompts = _prompts(first_special, lengths, seed=1)
        entry: dict[str, Any] = {"file": str(path), "bytes": path.stat().st_size}
        b = bench_bonsai(path, args.threads, prompts, args.gen, n_ctx)
        entry["bonsai"] = b | {"summary": _summ(b)}
        peer = None
        if not args.no_peer and variant in ("q1", "q2g64"):
            try:
                peer = bench_llamacpp(path, args.threads, prompts, args.gen, n_ctx)
                entry["llama_cpp"] = peer | {"summary": _summ(peer)}
            except ImportError:
                print("bench: llama-cpp-python not installed; skipping the peer", file=sys.stderr)
        result["variants"][variant] = entry
        bs = entry["bonsai"]["summary"]
        ps = entry["llama_cpp"]["summary"] if peer else None
        rows.append((variant, bs, ps))
        print(f"bench: {variant}: bonsai {bs}  llama.cpp {ps}", file=sys.stderr)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"cpu-{args.preset}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"CPU: {result['device']['cpu']}, {args.threads} threads; `{args.preset}` synthetic model; "
        f"greedy, {args.gen} generated tokens, prompts of {lengths} tokens; medians (min–max). "
        f"Commit {result['commit']}, {result['date']}.",
        "",
        "| variant | engine | decode tok/s | prefill tok/s | TTFT ms | decode vs llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for variant, bs, ps in rows:
        ratio = f"{bs['decode_tok_s'] / ps['decode_tok_s']:.2f}×" if ps else "—"
        lines.append(
            f"| {variant} | bonsai | {bs['decode_tok_s']:.1f} ({bs['decode_min']:.1f}–{bs['decode_max']:.1f}) "
            f"| {bs['prefill_tok_s']:.0f} | {bs['ttft_ms']:.0f} | {ratio} |"
        )
        if ps:
            lines.append(
                f"| {variant} | llama.cpp | {ps['decode_tok_s']:.1f} ({ps['decode_min']:.1f}–{ps['decode_max']:.1f}) "
                f"| {ps['prefill_tok_s']:.0f} | {ps['ttft_ms']:.0f} | 1.00× |"
            )
    table = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
