#!/usr/bin/env python3
"""Render bench/results/cuda-*.json (written on the H200 by scripts/gpu_check.sh) as one Markdown
table: bench/results/cuda-27b.md. Run after copying a device run's JSON into bench/results/."""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"
PEERS = {"q1": (84.7, 159.4), "q2": (80.5, 162.1)}  # PrismML llama.cpp fork, bonsai-turbo best (DEVICE.md)
PP_PEER = {"q1": 2713, "q2": 2743}


def load(name: str) -> dict | None:
    p = R / name
    return json.loads(p.read_text()) if p.exists() else None


def main() -> None:
    lines = []
    api = load("cuda-python-api-check.json") or {}
    meta = None
    lines.append(
        "| weights | decode tok/s (graph) | of 4.49 TB/s | Python API greedy | Python API sampled | "
        "pp512 tok/s | n-gram R (k=0..4) | DSpark GPU drafter: draft ms, R | resident GB |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for v in ("q1", "q2"):
        d = load(f"cuda-decode-27b-{v}.json")
        s = load(f"cuda-spec-27b-{v}.json")
        if not d:
            continue
        meta = meta or d
        a = api.get("decode_27b", {}).get(v, {})
        ng = ", ".join(f"{x:.2f}" for x in (s or {}).get("ngram", {}).get("R_by_k_replay", []))
        ds = (s or {}).get("dspark", {})
        pk, tk = PEERS[v]
        pp = d.get("prefill_pp512_tok_s", float("nan"))
        lines.append(
            f"| {d['weight_type']} | **{d['decode_tok_s']:.1f}** ({d['decode_tok_s'] / pk:.1f}× fork, "
            f"{d['decode_tok_s'] / tk:.2f}× turbo) | {100 * d['fraction_of_4_49_TBps']:.0f}% | "
            f"{a.get('decode_tok_s_median', float('nan')):.1f} | {a.get('sampled_tok_s_median', float('nan')):.1f} | "
            f"{pp:.0f} ({pp / PP_PEER[v]:.2f}× fork) | "
            f"{ng} | {ds.get('draft_ms', float('nan')):.2f}, {ds.get('R_vs_eager_taps_step', float('nan')):.2f} | "
            f"{d['resident_bytes'] / 1e9:.2f} |"
        )
    head = []
    if meta:
        head.append(
            f"H200 ({meta.get('gpu', meta.get('device'))}); synthetic 27B files generated on the device; batch 1, "
            f"greedy, {meta.get('steps')} tokens; medians. Commit {meta.get('commit')}, command "
            f"`{meta.get('command')}`. Peers on the same machine (DEVICE.md): PrismML llama.cpp fork "
            "84.7 / 80.5 tok/s, bonsai-turbo 159.4 / 162.1 tok/s, fork pp512 2,713 / 2,743 tok/s."
        )
        head.append("")
    (R / "cuda-27b.md").write_text("\n".join(head + lines) + "\n")
    print("\n".join(head + lines))


if __name__ == "__main__":
    main()
