"""Multi-turn chat with and without the prompt cache: time to first token per turn.

A conversation of ``--turns`` turns over token ids: a ``--system``-token prompt, then each turn
appends the previous answer (``--gen`` greedy tokens) and a ``--user``-token message, as a chat
history does. The same conversation runs on an engine with the prompt cache and on one without
(``prompt_cache=False``), one engine at a time in this process, the order alternating per
repetition; the answers must be the same tokens (the script fails otherwise). Writes JSON (command,
commit, device, every turn's prompt / resumed tokens, prefill seconds and TTFT) and a Markdown
table of medians.

    python3 bench/prompt_cache.py --model small-q1.gguf --device cpu --out bench/results/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import bonsai
from bonsai.bench import _commit, _cpu_name


def conversation(eng: bonsai.Engine, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the turns; per turn the prompt and resumed tokens, prefill seconds, TTFT, the answer."""
    nv = min(eng.info["n_vocab"], 200_000)
    history = [(i * 7919 + 11) % nv for i in range(a.system)]
    turns = []
    for t in range(a.turns):
        history += [(i * 104_729 + 31 * t + 5) % nv for i in range(a.user)]
        t0 = time.perf_counter()
        c = eng.complete(history, max_tokens=a.gen, temperature=0, ignore_eos=True)
        wall = time.perf_counter() - t0
        u = c.usage
        turns.append(
            {
                "turn": t + 1,
                "prompt_tokens": u["prompt_tokens"],
                "cached_tokens": u.get("cached_tokens", 0),
                "prefill_s": u["prefill_seconds"],
                "ttft_s": u["ttft_seconds"],
                "wall_s": wall,
                "answer": c.token_ids,
            }
        )
        history += c.token_ids
    return turns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--system", type=int, default=1500, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=60, help="tokens per user message")
    ap.add_argument("--gen", type=int, default=32, help="tokens per answer")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    a = ap.parse_args()
    n_ctx = a.system + a.turns * (a.user + a.gen) + 16
    runs: dict[str, list[list[dict[str, Any]]]] = {"cache": [], "no_cache": []}
    device = ""
    for rep in range(a.reps):
        order = ["cache", "no_cache"] if rep % 2 == 0 else ["no_cache", "cache"]
        for mode in order:
            eng = bonsai.Engine(a.model, device=a.device, threads=a.threads, n_ctx=n_ctx, prompt_cache=mode == "cache")
            device = eng.info["device"]
            eng.complete([1, 2, 3], max_tokens=2, temperature=0)  # warm-up (graphs, kernels)
            runs[mode].append(conversation(eng, a))
            del eng
            r = runs[mode][-1]
            print(
                f"rep {rep + 1} {mode:8s}: TTFT per turn (ms) "
                + " ".join(f"{x['ttft_s'] * 1e3:.0f}" for x in r)
                + f"; resumed {[x['cached_tokens'] for x in r]}",
                flush=True,
            )
    answers = {m: [[x["answer"] for x in r] for r in v] for m, v in runs.items()}
    same = all(x == answers["no_cache"][0] for v in answers.values() for x in v)
    rows = []
    for t in range(a.turns):
        med = {
            m: {k: statistics.median(r[t][k] for r in v) for k in ("ttft_s", "prefill_s", "cached_tokens")}
            for m, v in runs.items()
        }
        rows.append(
            {
                "turn": t + 1,
                "prompt_tokens": runs["cache"][0][t]["prompt_tokens"],
                "cached_tokens": int(med["cache"]["cached_tokens"]),
                "ttft_ms_cache": med["cache"]["ttft_s"] * 1e3,
                "ttft_ms_no_cache": med["no_cache"]["ttft_s"] * 1e3,
                "speedup": med["no_cache"]["ttft_s"] / med["cache"]["ttft_s"],
            }
        )
    for v in runs.values():
        for r in v:
            for x in r:
                del x["answer"]
    res = {
        "command": "python3 bench/prompt_cache.py " + " ".join(sys.argv[1:]),
        "commit": os.environ.get("BONSAI_BUILD_COMMIT") or _commit(),
        "device": {"engine": device, "cpu": _cpu_name(), "cores": os.cpu_count()},
        "model": os.path.basename(a.model),
        "config": {k: getattr(a, k) for k in ("system", "user", "gen", "turns", "reps", "threads")},
        "same_answers": same,
        "medians": rows,
        "runs": runs,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = [
        f"Prompt cache, {os.path.basename(a.model)} on {device} ({res['commit']}): {a.system}-token system "
        f"prompt, {a.user}-token user turns, {a.gen}-token greedy answers; median of {a.reps} "
        f"conversations per mode. Answers identical with and without the cache: {same}.",
        "",
        "| turn | prompt tokens | resumed | TTFT cache (ms) | TTFT no cache (ms) | speedup |",
        "|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_ms_cache']:.1f} | "
        f"{r['ttft_ms_no_cache']:.1f} | {r['speedup']:.2f}× |"
        for r in rows
    ]
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    if not same:
        print("FAILED: the answers differ with and without the prompt cache", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
