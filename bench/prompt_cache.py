"""Multi-turn chat with and without the prompt cache: time to first token per turn.

A conversation of ``--turns`` turns over token ids: a ``--system``-token prompt, then each turn
appends the previous answer (``--gen`` greedy tokens) and a ``--user``-token message, as a chat
history does. With ``--conversations K`` there are K such conversations, each with its own system
prompt, taking turns (turn 1 of each, then turn 2 of each, ...), as a server's users do. The same
requests run on an engine with the prompt cache, on one without (``prompt_cache=False``) and, for
K > 1, on one that keeps only the live conversation (``prompt_cache_entries=0``), one engine at a
time in this process, the order rotating per repetition; the answers must be the same tokens (the
script fails otherwise). Writes JSON (command, commit, device, every turn's prompt / resumed
tokens, prefill seconds and TTFT) and a Markdown table of medians.

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

MODES = {
    "cache": {"prompt_cache": True},
    "no_cache": {"prompt_cache": False},
    "live_only": {"prompt_cache": True, "prompt_cache_entries": 0},
}


def conversations(eng: bonsai.Engine, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the turns, conversations taking turns; per request the conversation, turn, prompt and
    resumed tokens, prefill seconds, TTFT and the answer."""
    nv = min(eng.info["n_vocab"], 200_000)
    histories = [[(i * 7919 + 11 + 9973 * k) % nv for i in range(a.system)] for k in range(a.conversations)]
    turns = []
    for t in range(a.turns):
        for k, history in enumerate(histories):
            history += [(i * 104_729 + 31 * t + 17 * k + 5) % nv for i in range(a.user)]
            t0 = time.perf_counter()
            c = eng.complete(history, max_tokens=a.gen, temperature=0, ignore_eos=True)
            wall = time.perf_counter() - t0
            u = c.usage
            turns.append(
                {
                    "conversation": k + 1,
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
    ap.add_argument("--conversations", type=int, default=1, help="conversations taking turns")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    a = ap.parse_args()
    n_ctx = a.system + a.turns * (a.user + a.gen) + 16
    modes = ["cache", "no_cache"] + (["live_only"] if a.conversations > 1 else [])
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    device = ""
    for rep in range(a.reps):
        for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            kw = {"device": a.device, "threads": a.threads, "n_ctx": n_ctx, **MODES[mode]}
            eng = bonsai.Engine(a.model, **kw)
            device = eng.info["device"]
            eng.complete([1, 2, 3], max_tokens=2, temperature=0)  # warm-up (graphs, kernels)
            runs[mode].append(conversations(eng, a))
            del eng
            r = runs[mode][-1]
            print(
                f"rep {rep + 1} {mode:9s}: TTFT per request (ms) "
                + " ".join(f"{x['ttft_s'] * 1e3:.0f}" for x in r)
                + f"; resumed {[x['cached_tokens'] for x in r]}",
                flush=True,
            )
    answers = {m: [[x["answer"] for x in r] for r in v] for m, v in runs.items()}
    same = all(x == answers["no_cache"][0] for v in answers.values() for x in v)
    rows = []
    for i, req in enumerate(runs["cache"][0]):
        med = {
            m: {k: statistics.median(r[i][k] for r in v) for k in ("ttft_s", "prefill_s", "cached_tokens")}
            for m, v in runs.items()
        }
        row = {
            "conversation": req["conversation"],
            "turn": req["turn"],
            "prompt_tokens": req["prompt_tokens"],
            "cached_tokens": int(med["cache"]["cached_tokens"]),
            "ttft_ms_cache": med["cache"]["ttft_s"] * 1e3,
            "ttft_ms_no_cache": med["no_cache"]["ttft_s"] * 1e3,
            "speedup": med["no_cache"]["ttft_s"] / med["cache"]["ttft_s"],
        }
        if "live_only" in med:
            row["cached_tokens_live_only"] = int(med["live_only"]["cached_tokens"])
            row["ttft_ms_live_only"] = med["live_only"]["ttft_s"] * 1e3
        rows.append(row)
    for v in runs.values():
        for r in v:
            for x in r:
                del x["answer"]
    res = {
        "command": "python3 bench/prompt_cache.py " + " ".join(sys.argv[1:]),
        "commit": os.environ.get("BONSAI_BUILD_COMMIT") or _commit(),
        "device": {"engine": device, "cpu": _cpu_name(), "cores": os.cpu_count()},
        "model": os.path.basename(a.model),
        "config": {k: getattr(a, k) for k in ("system", "user", "gen", "turns", "conversations", "reps", "threads")},
        "same_answers": same,
        "medians": rows,
        "runs": runs,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    live = a.conversations > 1
    convs = f"{a.conversations} conversations taking turns, each with its own " if live else ""
    md = [
        f"Prompt cache, {os.path.basename(a.model)} on {device} ({res['commit']}): {convs}{a.system}-token "
        f"system prompt, {a.user}-token user turns, {a.gen}-token greedy answers; median of {a.reps} "
        f"runs per mode. Answers identical in every mode: {same}.",
        "",
        "| turn | conversation | prompt tokens | resumed | TTFT cache (ms) | "
        + ("resumed, live only | TTFT live only (ms) | " if live else "")
        + "TTFT no cache (ms) | speedup |",
        "|---|---|---|---|---|" + ("---|---|" if live else "") + "---|---|",
    ]
    for r in rows:
        cols = [r["turn"], r["conversation"], r["prompt_tokens"], r["cached_tokens"], f"{r['ttft_ms_cache']:.1f}"]
        if live:
            cols += [r["cached_tokens_live_only"], f"{r['ttft_ms_live_only']:.1f}"]
        cols += [f"{r['ttft_ms_no_cache']:.1f}", f"{r['speedup']:.2f}×"]
        md.append("| " + " | ".join(str(c) for c in cols) + " |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    if not same:
        print("FAILED: the answers differ with and without the prompt cache", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
