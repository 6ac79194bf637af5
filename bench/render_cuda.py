#!/usr/bin/env python3
"""Render bench/results/cuda-*.json (written on the H200 by scripts/gpu_check.sh) as one Markdown
table: bench/results/cuda-27b.md. Run after copying a device run's JSON into bench/results/."""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"
PEERS = {"q1": (84.7, 159.4), "q2": (80.5, 162.1)}  # PrismML llama.cpp fork, bonsai-turbo best (DEVICE.md)
PP_PEER = {"q1": 2713, "q2": 2743}


def esc(cell: str) -> str:
    """A Markdown table cell: the '|' of a grouped launch's name (gate|up) escaped."""
    return cell.replace("|", "\\|")


def load(name: str) -> dict | None:
    p = R / name
    return json.loads(p.read_text()) if p.exists() else None


def main() -> None:
    lines = []
    api = load("cuda-python-api-check.json") or {}
    meta = None
    lines.append(
        "| weights | decode tok/s (graph) | of 4.49 TB/s | Python API greedy | "
        "Python API sampled (top-k 20; reading whole rows) | "
        "pp512 tok/s | n-gram round ms (k=0..4), round graphs | R = round / greedy graph step | "
        "same R, eager round | DSpark GPU drafter, round graphs: draft ms, R | "
        "DSpark tok/s: random drafter (0 accepted), agreeing (4 of 4) | resident GB |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in ("q1", "q2"):
        d = load(f"cuda-decode-27b-{v}.json")
        s = load(f"cuda-spec-27b-{v}.json") or {}
        if not d:
            continue
        meta = meta or d
        a = api.get("decode_27b", {}).get(v, {})
        # R against the decode bench's graph step (the greedy plain step: no logits row), from the
        # round times in ms, whichever denominator the spec bench of that commit printed
        step = d["graph_ms_median"] / d["steps"]
        search = s.get("ngram", {}).get("search_ms", 0.0)

        def rounds(graph: bool, s=s) -> list[float]:
            return [
                r["round_ms"]
                for r in s.get("rounds", [])
                if r["round_graph"] == graph and not r["taps"] and r["rollback"] == "Replay"
            ]

        ms = ", ".join(f"{x:.2f}" for x in rounds(True))
        ng = ", ".join(f"{(x + search) / step:.2f}" for x in rounds(True))
        nge = ", ".join(f"{(x + search) / step:.2f}" for x in rounds(False))
        ds = s.get("dspark_graph", s.get("dspark", {}))
        # tokens per second of DSpark rounds: the measured drafter (random weights: nothing
        # accepted, 1 token per round) and an agreeing one (oracle drafts, all 4 accepted: 5
        # tokens for draft + stage + the k = 4 round with taps)
        full = [
            r["round_ms"]
            for r in s.get("rounds", [])
            if r["round_graph"] and r["taps"] and r["rollback"] == "Replay" and r["k"] == 4
        ]
        tps_random = 1e3 / ds["total_ms"] if "total_ms" in ds else float("nan")
        tps_agree = 5e3 / (ds["draft_ms"] + ds["stage_ms"] + full[0]) if full and ds else float("nan")
        pk, tk = PEERS[v]
        pp = d.get("prefill_pp512_tok_s", float("nan"))
        lines.append(
            f"| {d['weight_type']} | **{d['decode_tok_s']:.1f}** ({d['decode_tok_s'] / pk:.1f}× fork, "
            f"{d['decode_tok_s'] / tk:.2f}× turbo) | {100 * d['fraction_of_4_49_TBps']:.0f}% | "
            f"{a.get('decode_tok_s_median', float('nan')):.1f} | {a.get('sampled_tok_s_median', float('nan')):.1f}"
            + (f" ({a['sampled_row_tok_s_median']:.1f})" if "sampled_row_tok_s_median" in a else "")
            + " | "
            f"{pp:.0f} ({pp / PP_PEER[v]:.2f}× fork) | "
            f"{ms} | {ng} | {nge} | {ds.get('draft_ms', float('nan')):.2f}, "
            f"{ds.get('total_ms', float('nan')) / step:.2f} | {tps_random:.0f}, {tps_agree:.0f} | "
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
        if api.get("commit") and api.get("commit") != meta.get("commit"):
            head[-1] += f" The Python API columns are from commit {api['commit']} (`{api.get('command')}`)."
        spec = load("cuda-spec-27b-q1.json") or {}
        if spec.get("commit") and spec.get("commit") != meta.get("commit"):
            head[-1] += (
                f" The round columns (n-gram, DSpark) are from commit {spec['commit']} "
                f"(`{spec.get('command')}`), R against this table's decode step."
            )
        head.append("")
    q2 = load("cuda-decode-27b-q2.json") or {}
    if head and q2.get("commit") and q2.get("commit") != meta.get("commit"):
        head[-2] += f" The Q2_0 decode and round columns are from commit {q2['commit']} (`{q2.get('command')}`)."
    lines += prefill_section()
    lines += whatif_section()
    lines += round_profile_section()
    lines += rollback_ab_section()
    lines += staged_section()
    lines += mma_section()
    lines += pipe_section()
    lines += o8_section()
    lines += verify_section()
    lines += blk_section()
    lines += decode_ab_section()
    lines += subscale_section()
    (R / "cuda-27b.md").write_text("\n".join(head + lines) + "\n")
    print("\n".join(head + lines))


def prefill_section() -> list[str]:
    """pp512 by prefill GEMM configuration (one process: the default, then each alternative), the
    GEMMs alone per projection group, and the largest kernels of one pp512 forward."""
    runs = {v: load(f"cuda-decode-27b-{v}.json") or {} for v in ("q1", "q2")}
    if not any("prefill_alt" in d for d in runs.values()):
        return []
    names = {
        "int8": "int8 `mma.m16n8k32`, rescale per 32 (`BONSAI_CUDA_GEMM=i8`)",
        "f16-wgs": "f16 `wgmma.m64n128k16`, weights expanded into shared memory, both operands swizzled "
        "there (default on sm_90a)",
        "f16-w4": "f16 `mma.m16n8k16`, 4 warps, stages per launch: 2 for Q1_0 at n_in 5120, else 3 "
        "(`BONSAI_CUDA_GEMM=f16`; the default before sm_90a's `wgs`)",
        "f16-w4-o3": "f16 `mma.m16n8k16`, 4 warps, 3 stages, 3 CTAs/SM (`BONSAI_CUDA_GEMMH_O4=0`)",
        "f16-w4-o4": "f16 `mma.m16n8k16`, 4 warps, 2 stages, 4 CTAs/SM (`BONSAI_CUDA_GEMMH_O4=1`)",
        "f16-w8": "f16 `mma.m16n8k16`, 8 warps (`BONSAI_CUDA_GEMMH_WARPS=8`)",
        "f16-wgmma4": "f16 `wgmma.m64n64k16`, A from registers, 4 register sets (`BONSAI_CUDA_GEMM=wgmma`)",
        "f16-wgmma2": "f16 `wgmma.m64n64k16`, A from registers, 2 register sets",
    }
    out = [
        "",
        "Prefill pp512 by GEMM configuration (`cuda_bench`: the default, then each alternative in the same "
        "process; ms per 512-token forward, tok/s, and every projection's GEMM alone, ms per forward), "
        + ", ".join(f"{d.get('weight_type')} at {d.get('commit')}" for d in runs.values() if d)
        + ".",
        "",
        "| GEMM | Q1_0 pp512 ms | Q1_0 tok/s | Q1_0 GEMMs ms | Q2_0 pp512 ms | Q2_0 tok/s | Q2_0 GEMMs ms |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: dict[str, list[str]] = {}
    for v, d in runs.items():
        if not d:
            continue
        alt_gemm: dict[str, float] = {}
        for g in d.get("alt_gemm_n512", []):
            alt_gemm[g["gemm"]] = alt_gemm.get(g["gemm"], 0.0) + g["us_per_launch"] * 1e-3 * (
                next((x["launches"] for x in d["gemm_n512"] if x["group"] == g["group"]), 0)
            )
        entries = [(d["prefill_gemm"], d["prefill_pp512_ms_median"], d["gemm_n512_total_ms"])]
        entries += [(a["gemm"], a["pp512_ms_median"], alt_gemm.get(a["gemm"], float("nan"))) for a in d["prefill_alt"]]
        for name, ms, gms in entries:
            rows.setdefault(name, ["—"] * 6)
            i = 0 if v == "q1" else 3
            rows[name][i : i + 3] = [f"{ms:.1f}", f"{512e3 / ms:.0f}", f"{gms:.1f}"]
    for name, cells in rows.items():
        out.append(f"| {names.get(name, name)} | " + " | ".join(cells) + " |")
    # the other GDN recurrences: a list of A/B records (one dict in files before chunked-tc)
    gdn: dict[str, list[dict]] = {}
    for v, d in runs.items():
        alt = (d or {}).get("prefill_gdn_alt")
        if alt:
            gdn[v] = alt if isinstance(alt, list) else [alt]
    if gdn:
        out += [
            "",
            "Prefill GDN recurrence (`cuda_bench`, same process): the default against the others; pp512 "
            "ms, tok/s, and the last row's logit NMSE against the default (f32 reorderings, amplified by "
            "the random synthetic weights).",
            "",
            "| GDN recurrence | Q1_0 pp512 ms | Q1_0 tok/s | Q2_0 pp512 ms | Q2_0 tok/s "
            "| logit NMSE vs default (Q1_0, Q2_0) |",
            "|---|---|---|---|---|---|",
        ]
        labels = {
            "row-by-row": "row by row (`gdn_step_seq_d128`)",
            "chunked": "chunked, 64 rows (`gdn_chunk_prep_d128` + `gdn_chunk_scan_d128`)",
            "chunked-tc": "chunked, tensor-core walk (`gdn_chunk_scan_tc_d128`, 3×TF32)",
        }
        first = next(iter(gdn.values()))[0]
        names = [first["gdn_default"]] + [a["gdn"] for a in next(iter(gdn.values()))]
        for which in names:
            cells, nm = [], []
            for v in ("q1", "q2"):
                d = runs.get(v) or {}
                recs = {a["gdn"]: a for a in gdn.get(v, [])}
                if which == first["gdn_default"] and d:
                    ms = d["prefill_pp512_ms_median"]
                elif which in recs:
                    ms = recs[which]["pp512_ms_median"]
                    nm.append(f"{recs[which]['last_logit_nmse_vs_default']:.2e}")
                else:
                    cells += ["—", "—"]
                    continue
                cells += [f"{ms:.2f}", f"{512e3 / ms:.0f}"]
            tag = " (default)" if which == first["gdn_default"] else ""
            out.append(f"| {labels.get(which, which)}{tag} | " + " | ".join(cells) + f" | {', '.join(nm) or '—'} |")
    # the other prefill attention kernel (tensor cores vs CUDA cores)
    att = {v: d["prefill_attn_alt"] for v, d in runs.items() if d and d.get("prefill_attn_alt")}
    if att:
        a0 = next(iter(att.values()))
        cells = []
        for v in ("q1", "q2"):
            d, a = runs.get(v) or {}, att.get(v)
            if a:
                cells.append(
                    f"{d.get('weight_type')} {d['prefill_pp512_ms_median']:.2f} ms with {a['attn_default']} "
                    f"(default), {a['pp512_ms_median']:.2f} ms with {a['attn']} "
                    f"(last-row logit NMSE {a['last_logit_nmse_vs_default']:.2e})"
                )
        out += [
            "",
            f"Prefill attention (`cuda_bench`, same process; `{a0['attn_default']}` = `attn_prefill_tc_hd*`, "
            "`fp32` = `attn_prefill_hd*`, `BONSAI_CUDA_ATTN_TC=0`): pp512 " + "; ".join(cells) + ".",
        ]
    # a deep chunk: the 8th 512-row chunk of a 4,096-token prompt, both attention kernels
    deep = {v: d["prefill_deep_chunk"] for v, d in runs.items() if d and d.get("prefill_deep_chunk")}
    if deep:
        cells = []
        for v, recs in deep.items():
            wt = runs[v].get("weight_type")
            cells.append(
                f"{wt} "
                + ", ".join(
                    f"{r['ms_median']:.1f} ms with {r['attn']} (attention {r['attn_kernels_ms']:.1f} ms)" for r in recs
                )
            )
        r0 = next(iter(deep.values()))[0]
        out += [
            "",
            f"A deep prefill chunk (`cuda_bench`: 512 rows at pos0 = {r0['pos0']}, the 8th chunk of a "
            f"{r0['pos0'] + r0['n']:,}-token prompt; median of 3, attention from one profiled run): "
            + "; ".join(cells)
            + ".",
        ]
    prof = []
    for d in runs.values():
        pk = d.get("prefill_kernel_profile", [])
        tot = d.get("prefill_kernel_profile_total_us", 0.0) or 1.0
        if pk:
            top = ", ".join(f"{k['kernel']} {k['us'] / 1e3:.1f} ({100 * k['us'] / tot:.0f}%)" for k in pk[:7])
            prof.append(f"{d.get('weight_type')}: {top}")
    if prof:
        out += ["", "Largest kernels of one pp512 forward (ms, each launch timed alone): " + "; ".join(prof) + "."]
    return out


def whatif_section() -> list[str]:
    """What each family of launches costs inside the decode graph (cuda_launch_what_if)."""
    runs = {v: load(f"cuda-whatif-27b-{v}.json") for v in ("q1", "q2")}
    if not all(runs.values()):
        return []
    q1, q2 = runs["q1"], runs["q2"]
    out = [
        "",
        "Decode graph without one family of launches (`cuda_bench::cuda_launch_what_if`: captured again "
        "with those launches dropped, against the full graph in the same process; the tokens are then "
        f"meaningless). ms per token saved, of {q1['graph_ms_per_token']:.3f} (Q1_0) / "
        f"{q2['graph_ms_per_token']:.3f} (Q2_0); commit {q1.get('commit')}, `{q1.get('command')}`.",
        "",
        "| launches left out | Q1_0 | Q2_0 |",
        "|---|---|---|",
    ]
    saved2 = {r["skipped"]: r["saved_ms_per_token"] for r in q2["without"]}
    for r in q1["without"]:
        out.append(f"| {r['skipped']} | {r['saved_ms_per_token']:.3f} | {saved2.get(r['skipped'], float('nan')):.3f} |")
    rounds = {v: load(f"cuda-whatif-round-27b-{v}.json") for v in ("q1", "q2")}
    if all(rounds.values()):
        r1, r2 = rounds["q1"], rounds["q2"]
        # the same what-if at one draft (a 2-row verify), where it was run
        one = {v: load(f"cuda-whatif-round-d1-27b-{v}.json") for v in ("q1", "q2")}
        one_ok = all(one.values())
        head = "| launches left out | round Q1_0 | round Q2_0 | step Q1_0 | step Q2_0 |"
        rule = "|---|---|---|---|---|"
        if one_ok:
            head += " 1-draft round Q1_0 | 1-draft round Q2_0 |"
            rule += "---|---|"
        out += [
            "",
            f"The same for a speculative round (`cuda_spec_bench::cuda_round_what_if`: {r1['round']}) and the "
            f"greedy step measured beside it: ms saved, of a {r1['round_ms']:.2f} / {r2['round_ms']:.2f} ms round "
            f"and a {r1['step_ms']:.2f} / {r2['step_ms']:.2f} ms step (Q1_0 / Q2_0; commit {r1.get('commit')}, "
            f"{r1.get('gpu')})"
            + (
                f"; the last two columns: rounds of 1 draft (a 2-row verify), of {one['q1']['round_ms']:.2f} / "
                f"{one['q2']['round_ms']:.2f} ms"
                if one_ok
                else ""
            )
            + ".",
            "",
            head,
            rule,
        ]
        by2 = {r["skipped"]: r for r in r2["without"]}
        d1 = {v: {r["skipped"]: r for r in one[v]["without"]} for v in one} if one_ok else {}
        nan = float("nan")
        for r in r1["without"]:
            o = by2.get(r["skipped"], {})
            row = (
                f"| {r['skipped']} | {r['round_saved_ms']:.3f} | {o.get('round_saved_ms', nan):.3f} | "
                f"{r['step_saved_ms']:.3f} | {o.get('step_saved_ms', nan):.3f} |"
            )
            if one_ok:
                row += "".join(f" {d1[v].get(r['skipped'], {}).get('round_saved_ms', nan):.3f} |" for v in ("q1", "q2"))
            out.append(row)
    out += by_drafts_section()
    return out


def by_drafts_section() -> list[str]:
    """The round's cost by draft count (cuda_round_by_drafts): R for 1..4 drafts rejected at once."""
    runs = {v: load(f"cuda-round-by-drafts-27b-{v}.json") for v in ("q1", "q2")}
    if not all(runs.values()):
        return []
    alt = load("cuda-round-by-drafts-b1q0-27b-q1.json")

    def cells(d: dict) -> str:
        def span(n: int) -> str:
            rs = [r["R"] for r in d["rows"] if r["drafts"] == n]
            return f"{min(rs):.2f} – {max(rs):.2f}"

        return " | ".join(span(n) for n in range(1, 5))

    out = [
        "",
        "The round's cost by its draft count (`cuda_spec_bench::cuda_round_by_drafts`: "
        f"{runs['q1']['round']}, against the greedy step, three alternations in one process; commit "
        f"{runs['q1'].get('commit')}, {runs['q1'].get('gpu')}): R, min – max.",
        "",
        "| weights | verify kernels | 1 draft | 2 drafts | 3 drafts | 4 drafts |",
        "|---|---|---|---|---|---|",
        f"| Q1_0 | default | {cells(runs['q1'])} |",
    ]
    if alt:
        out.append(f"| Q1_0 | 5-row b1-plane instead of the int8 tensor cores (`BONSAI_CUDA_B1Q=0`) | {cells(alt)} |")
    out.append(f"| Q2_0(g128) | default | {cells(runs['q2'])} |")
    return out


def round_profile_section() -> list[str]:
    """One what-if round and one plain step run eagerly with every launch timed alone, by kernel
    and grid (cuda_round_what_if's eager profiles; the newest what-if JSON that has them)."""
    for name in ("cuda-whatif-round-27b-q1.json", "cuda-h100-whatif-round-27b-q1.json"):
        d = load(name)
        if d and "eager_round_profile" in d:
            break
    else:
        return []
    rp, sp = d["eager_round_profile"], d["eager_step_profile"]
    out = [
        "",
        f"Where one round's kernel time goes (`cuda_round_what_if`'s eager profiles, `{name}`: {d['round']}, "
        f"then a plain step; every launch timed alone after a spin kernel, so launch gaps are not counted but "
        f"each launch's ramp is). Q1_0, {d.get('gpu')}, commit {d.get('commit')}: "
        f"{rp['kernels_alone_us'] / 1e3:.2f} ms of kernels in {rp['launches']} launches for the round, "
        f"{sp['kernels_alone_us'] / 1e3:.2f} ms in {sp['launches']} for the step.",
        "",
        "| kernel and grid (round) | launches | µs | kernel and grid (step) | launches | µs |",
        "|---|---|---|---|---|---|",
    ]

    def cell(k: dict | None) -> str:
        return f"`{esc(k['kernel'])}` | {k['launches']} | {k['us']:.1f}" if k else " | | "

    rk, sk = rp["by_kernel"], sp["by_kernel"]
    for i in range(max(len(rk), len(sk))):
        out.append(f"| {cell(rk[i] if i < len(rk) else None)} | {cell(sk[i] if i < len(sk) else None)} |")
    return out


def rollback_ab_section() -> list[str]:
    """The round's GDN bookkeeping launches, alternating in one process (cuda_replay_round_ab):
    one gdn_replay per layer or one launch for all, and the verify record by gdn_rec_write or by
    the fused GDN kernel."""
    runs = {v: load(f"cuda-rollback-ab-27b-{v}.json") for v in ("q1", "q2")}
    if not all(runs.values()):
        return []
    out = [
        "",
        "The rollback's replay and the verify record (`cuda_spec_bench::cuda_replay_round_ab`: rounds of 4 "
        f"drafts rejected at once, round graphs, four alternations in one process; commit "
        f"{runs['q1'].get('commit')}, {runs['q1'].get('gpu')}): round ms, min – max.",
        "",
        "| replay | verify record | Q1_0 | Q2_0 |",
        "|---|---|---|---|",
    ]
    for layers, rec in ((False, False), (True, False), (True, True)):
        cells = []
        for v in ("q1", "q2"):
            ms = [r["round_ms"] for r in runs[v]["rows"] if r["replay_layers"] == layers and r["rec_fused"] == rec]
            cells.append(f"{min(ms):.3f} – {max(ms):.3f}")
        out.append(
            f"| {'one launch, all layers' if layers else 'a launch per layer'} | "
            f"{'by the GDN kernel' if rec else 'gdn_rec_write per layer'} | {cells[0]} | {cells[1]} |"
        )
    return out


def staged_section() -> list[str]:
    """The staged persistent decode mat-vec (kernels/mvs.cu): per-category µs per launch, plain
    against every launch staged (cuda-staged-27b-*.json, one run with the staged kernels off by
    default), and the decode graph by carveout x staged mode (the current decode JSON)."""
    rows = []
    meta = None
    for v in ("q1", "q2"):
        d = load(f"cuda-staged-27b-{v}.json")
        if not d:
            continue
        meta = meta or d
        plain = {p["kernel"]: p["us_per_launch"] for p in d.get("profile", [])}
        runs = {(r["stages"], r["rows"]): r for r in d.get("staged_flipped_profile", [])}
        cfgs = [(0, 0), (2, 2), (2, 4)]
        for k, us in plain.items():
            if k.endswith("_alone"):
                continue
            cells = []
            for c in cfgs:
                st = {p["kernel"]: p["us_per_launch"] for p in runs.get(c, {}).get("profile", [])}
                cells.append(f"{st[k]:.2f}" if k in st else "—")
            best = min(float(x) for x in cells if x != "—")
            rows.append(f"| {d['weight_type']} | {esc(k)} | {us:.2f} | " + " | ".join(cells) + f" | {us / best:.2f}× |")
    if not rows:
        return []
    out = [
        "",
        "Staged persistent decode mat-vec (`kernels/mvs.cu`: row tiles through a shared-memory ring "
        "filled by the bulk copy engine; same float order as the plain kernel). µs per launch, each "
        "category back to back over all layers, plain against every launch staged "
        f"(commit {meta.get('commit')}, `cuda-staged-27b-*.json`). Default since then: staged for the Q2 "
        "launches of ≥ 32,768 rows (ffn gate‖up, head); Q1 keeps the plain kernels.",
        "",
        "| weights | matrices | plain | staged (2 stages, layout rows) | staged (2 stages, 2 rows/warp) | "
        "staged (2 stages, 4 rows/warp) | best staged speed-up |",
        "|---|---|---|---|---|---|---|",
    ] + rows
    mat = []
    for v in ("q1", "q2"):
        d = load(f"cuda-decode-27b-{v}.json") or {}
        cx = d.get("carveout_x_staged", [])
        if not cx:
            continue
        st = d.get("steps", 128)
        cells = ", ".join(
            f"{c['carveout'].replace('Some(', '').replace(')', '')}/{c['staged']} {c['graph_ms_median'] / st:.3f}"
            for c in cx
        )
        mat.append(f"{d['weight_type']} (commit {d.get('commit')}): {cells}")
    if mat:
        out += [
            "",
            "Decode graph ms/token by shared-memory carveout (one for every kernel; None = the driver's, "
            "which a staged launch turns into the staged carveout (100 % up to 72997f6, 58 % since fc75e0c) for all "
            "but the verify mat-vecs and, since fc75e0c, the prefill kernels) / staged mode: " + "; ".join(mat) + ".",
        ]
    return out


def mma_section() -> list[str]:
    """The tensor-core mat-vec family (was BONSAI_CUDA_MV_MMA=1; removed 2026-12-06) against dp4a:
    per-launch sweep times at n = 1 (decode) and n = 5 (a verify of 4 drafts), the decode graph A/B, and R."""
    out = []
    rows = []
    for v in ("q1", "q2"):
        sw = load(f"cuda-mv-sweep-{v}.json")
        if not sw:
            continue
        for m in sw.get("mma_vs_dp4a", []):
            if "n1_tc_default_us" not in m:
                continue
            # the default mvx plan is 2 rows per lane (n1_mvx_r2_us) since that sweep
            n1 = m.get("n1_mvx_r2_us", m["n1_tc_default_us"])
            rows.append(
                f"| {sw['weight_type']} | {esc(m['category'])} | {m['n1_dp4a_us']:.2f} | {n1:.2f} | "
                f"{m['n5_dp4a_us']:.2f} | {m['n5_tc_default_us']:.2f} |"
            )
    if rows:
        out += [
            "",
            "Tensor-core mat-vec family (was `BONSAI_CUDA_MV_MMA=1`, off; removed on 2026-12-06, 946a672 is "
            "the last tree with it): µs per launch at the 27B "
            "shapes; n = 1 runs `mvx` (dp4a in the tensor-core float order, so verify rows equal decode "
            "rows bit for bit), n = 5 the `mvm` tensor-core kernel (`cuda-mv-sweep-*.json`).",
            "",
            "| weights | matrices | n=1 dp4a | n=1 mvx (2 rows per lane) | n=5 dp4a | n=5 tensor cores |",
            "|---|---|---|---|---|---|",
        ] + rows
    ab = decode_ab("mv_mma", "with dp4a", "with the tensor-core family")
    sm = load("cuda-spec-27b-q1-mma.json")
    if sm:
        round_ms = sm["ngram"]["R_by_k_replay_graph"][0] * sm["plain_step_ms"]
        d1 = load("cuda-decode-27b-q1.json") or {}
        mma = d1.get("mv_mma", {})
        if "graph_ms_median_on" in mma:
            step = mma["graph_ms_median_on"] / d1["steps"]
            ab.append(
                f"with the family on (commit {sm.get('commit')}, mvx at 1 row per lane then), a Q1_0 n-gram "
                f"round with round graphs took {round_ms:.2f} ms (k = 0), R = {round_ms / step:.2f} of the "
                f"family's own {step:.2f} ms decode step"
            )
    if ab:
        out += ["", "; ".join(ab) + "."]
    return out


def decode_ab(key: str, off: str, on: str, tokens: bool = False, stem: str = "cuda-decode-27b") -> list[str]:
    """One phrase per weight type from the decode bench's graph A/B `key` (ms per token off, on),
    read from `{stem}-q1.json` / `-q2.json`."""
    ab = []
    for v in ("q1", "q2"):
        d = load(f"{stem}-{v}.json") or {}
        m = d.get(key)
        if isinstance(m, dict) and "graph_ms_median_on" in m:
            st = d.get("steps", 128)
            line = (
                f"{d['weight_type']}: decode graph {m['graph_ms_median_off'] / st:.3f} ms/token {off}, "
                f"{m['graph_ms_median_on'] / st:.3f} {on}"
            )
            if tokens:
                line += f", tokens equal for {m['tokens_agree']} of {st}"
            ab.append(line)
    return ab


def sweep_rows(key: str, cells) -> list[str]:
    """One table row per matrix category of the sweeps' `key` list: weights, category, `cells(m)`."""
    rows = []
    for v in ("q1", "q2"):
        sw = load(f"cuda-mv-sweep-{v}.json") or {}
        rows += [f"| {sw['weight_type']} | {esc(m['category'])} | {cells(m)} |" for m in sw.get(key, [])]
    return rows


def pipe_section() -> list[str]:
    """The pipelined persistent decode mat-vec against the plain dp4a kernels: per-launch sweep
    times at n = 1 and the decode graph A/B (every one-row launch on it: was BONSAI_CUDA_MV_PIPE=1,
    removed 2026-12-07)."""
    rows = sweep_rows(
        "pipe_vs_dp4a",
        lambda m: (
            f"{m['plain_plan']} {m['plain_us']:.2f} | {m['mvp_plan']} {m['mvp_us']:.2f} | "
            f"{m['plain_us'] / m['mvp_us']:.2f}×"
        ),
    )
    if not rows:
        return []
    commits = ", ".join(
        f"{v} at {c}" for v in ("q1", "q2") if (c := (load(f"cuda-mv-sweep-{v}.json") or {}).get("commit"))
    )
    out = [
        "",
        "Pipelined persistent decode mat-vec (`mvp`): µs per launch at n = 1, best mvp plan with the "
        f"shape's K split (sweeps: {commits}). Since 71f9846 the Q2 launches of 8,192 to 32,767 rows "
        "(gdn q‖z‖b‖a, attn q‖k‖v) take mvp r4 by default (staged first since 2026-12-01); "
        "`BONSAI_CUDA_MV_PIPE=1` put every one-row launch on it (off: slower; removed on 2026-12-07, "
        "9732105 is the last tree with it).",
        "",
        "| weights | matrices | plain dp4a | best mvp | speed-up |",
        "|---|---|---|---|---|",
    ] + rows
    ab = decode_ab("mv_pipe", "with the shape defaults", "with mvp everywhere (4 rows per group)", tokens=True)
    if ab:
        out += ["", "; ".join(ab) + "."]
    return out


def o8_section() -> list[str]:
    """The o8 family (was BONSAI_CUDA_MV_O8=1, removed 2026-12-06: one float order for a one-row
    dp4a kernel and an n-row tensor-core kernel) against the default dp4a kernels, per launch."""
    rows = sweep_rows(
        "o8_vs_dp4a",
        lambda m: (
            f"{m['n1_dp4a_us']:.2f} | r{m['n1_mvo_r']} {m['n1_mvo_us']:.2f} | {m['n5_dp4a_us']:.2f} | "
            f"{m['n5_mvt_us']:.2f}"
        ),
    )
    if not rows:
        return []
    out = [
        "",
        "o8 family (was `BONSAI_CUDA_MV_O8=1`, off: slower at both n; removed on 2026-12-06): µs per launch, "
        "one-row `mvo` with its "
        "best rows per lane group against dp4a, and the n = 5 tensor-core `mvt` against dp4a.",
        "",
        "| weights | matrices | n=1 dp4a | n=1 mvo | n=5 dp4a | n=5 mvt |",
        "|---|---|---|---|---|---|",
    ] + rows
    ab = decode_ab("mv_o8", "default", "with o8")
    if ab:
        out += ["", "; ".join(ab) + "."]
    return out


def verify_section() -> list[str]:
    """Verify (n-row) mat-vec plans against each other: the n-gram round of cuda_spec_bench."""
    out = []
    for v, label in (("q1", "Q1_0"), ("q2", "Q2_0(g128)")):
        # by rows per warp, the plain file (before the 5-row kernels) first
        files = sorted(R.glob(f"cuda-spec-27b-{v}-rn*.json"), key=lambda f: (f.stem.split("-rn")[1][0], len(f.stem)))
        for f in files:
            d = json.loads(f.read_text())
            tag = f.stem.split(f"{v}-")[1]  # rn4, rn4-n51, ...
            rn = tag.split("-")[0][2:]
            n5 = "on" if tag.endswith("n51") else "off" if tag.endswith("n50") else "— (before the 5-row kernels)"
            k0 = [
                r["round_ms"]
                for r in d["rounds"]
                if r["round_graph"] and not r["taps"] and r["rollback"] == "Replay" and r["k"] == 0
            ]
            rs = ", ".join(f"{x:.2f}" for x in d["ngram"]["R_by_k_replay_graph"])
            out.append(f"| {label} | {rn} | {n5} | {d['plain_step_ms']:.3f} | {k0[0]:.2f} | {rs} | {d.get('commit')} |")
    if not out:
        return []
    return [
        "",
        "Verify mat-vec plans (`cuda_spec_bench::cuda_spec_round_cost` with `BONSAI_CUDA_MV_RN` / "
        "`BONSAI_CUDA_MV_N5`: weight rows per warp of the n-row launches, and the 5-row kernels for "
        "n ≤ 5): the n-gram round with round graphs and replay rollback, k = 0 accepted, and R for "
        "k = 0..4 (`cuda-spec-27b-*-rn*.json`). Defaults: Q1_0 8 rows on the 5-row kernels, Q2_0 4 "
        "rows on the 5-row kernels (since 08dcbcf; the 8-row kernels before).",
        "",
        "| weights | rows per warp | 5-row kernels | greedy step ms | round ms, k = 0 | R, k = 0..4 | commit |",
        "|---|---|---|---|---|---|---|",
    ] + out


def decode_ab_section() -> list[str]:
    """Decode-graph A/Bs of the newer switches (same process, same tokens): the GDN conv fused
    into the recurrence, and the long one-row launches plain with 4 rows per warp."""
    out = []
    for key, off, on, what, *stem in (
        (
            "gdn_fused",
            "with gdn_conv + gdn_step + gated_norm_quant",
            "with gdn_conv_step_norm_d128",
            "GDN conv and gated norm fused into the recurrence (`BONSAI_CUDA_GDN_FUSED=2`, the default; "
            "a 4-block cluster per head)",
        ),
        (
            "gdn_fused_conv_only_vs_default",
            "with the default (conv and gated norm fused)",
            "with the conv fused only (gdn_conv_step, then gated_norm_quant)",
            "GDN conv fused alone (`BONSAI_CUDA_GDN_FUSED=1`)",
        ),
        (
            "swiglu_fused",
            "with gate‖up then swiglu_quant",
            "with the SwiGLU fused",
            "SwiGLU + quantize fused into the decode gate‖up launch (`BONSAI_CUDA_SWIGLU_FUSED`, default on; "
            "`mv_*_n1_r8_k1_swi` where that launch is plain with 8 rows per warp, Q1_0; since df91c25 "
            "`mvs_*_swi` where it is staged, Q2_0)",
        ),
        (
            "attn_fused",
            "with attn_prep + attn_chunks + attn_merge_quant",
            "with attn_decode_fused",
            "A decode row's attention in one launch (was `BONSAI_CUDA_ATTN_FUSED=1`; off: within noise, "
            "slower in every later A/B; removed on 2026-12-07; a one-off run at a5d1ee0, "
            "`cuda-attn-fused-ab-27b-*.json`, where it was on)",
            "cuda-attn-fused-ab-27b",
        ),
        (
            "gate_up_plain_r8_swiglu",
            "with the defaults",
            "with gate‖up plain at 8 rows per warp (so SwiGLU fused), the head staged",
            "ffn gate‖up plain with 8 rows per warp and the SwiGLU fused, instead of Q2_0's staged launch "
            "(`BONSAI_CUDA_MV_LONG_R=8 BONSAI_CUDA_MVS_MIN_ROWS=40000`; Q1_0's default already)",
        ),
        (
            "mv_l2pre",
            "without",
            "with the pre-wait L2 prefetch",
            "The one-row mat-vecs asking the L2 for their weight rows before the PDL wait "
            "(`cp.async.bulk.prefetch.L2`; branch `wip/l2pre`, not merged; the round cost with it: "
            "`cuda-spec-l2pre-27b-*.json`)",
            "cuda-l2pre-27b",
        ),
        (
            "mv_long_plain_r4",
            "with the defaults",
            "with the long launches plain at 4 rows per warp",
            "long one-row launches (> 15,000 rows) plain with 4 rows per warp (`BONSAI_CUDA_MV_LONG_R=4`, staging off)",
        ),
    ):
        ab = decode_ab(key, off, on, tokens=True, stem=stem[0] if stem else "cuda-decode-27b")
        if ab:
            out += ["", f"{what}: " + "; ".join(ab) + "."]
    return out


def blk_section() -> list[str]:
    """The blk family (a lane per scale block; measured, then reverted) against the default plans."""
    runs = {v: load(f"cuda-mv-blk-sweep-{v}.json") for v in ("q1", "q2")}
    if not any(runs.values()):
        return []
    out = [
        "",
        "The blk mat-vec family (a lane per 128-element scale block, 8 lanes per row; b5247f6, "
        "reverted in the next commit) against the default plans: µs per launch, best blk plan "
        "(`cuda-mv-blk-sweep-*.json`, `cuda-ncu-blk.txt`).",
        "",
        "| weights | matrices | n=1 default | n=1 best blk | n=5 default | n=5 best blk |",
        "|---|---|---|---|---|---|",
    ]
    for d in runs.values():
        if not d:
            continue
        for c in d["blk"]:
            out.append(
                f"| {d['weight_type']} | {esc(c['category'])} | {c['n1_default_us']:.2f} | "
                f"{c['n1_best']} {c[c['n1_best']]:.2f} | {c['n5_default_us']:.2f} | "
                f"{c['n5_best']} {c[c['n5_best']]:.2f} |"
            )
    return out


def subscale_section() -> list[str]:
    """The integer sub-scale kernels (never used by the engine; removed 2026-12-06) against the per-32 mat-vecs."""
    d = load("cuda-subscale-27b.json")
    if not d:
        return []

    def best(r: dict, n: str) -> tuple[str, float]:
        k = min(r["sub"], key=lambda k: r["sub"][k][n])
        return k, r["sub"][k][n]

    kept = next(v for v in d["variants"] if v["kept"])
    out = [
        "",
        f"The integer sub-scale mat-vecs ({kept['commit']}; never used by the engine, removed on 2026-12-06) "
        "against the "
        "per-32 ones, µs per launch past the L2, best K split (`cuda-subscale-27b.json`, "
        "`gpu_kernels::mv_sub_timing`):",
        "",
        "| weights | matrix | per-32 n=1 | sub one-row n=1 | per-32 n=5 | sub tensor-core n=5 |",
        "|---|---|---|---|---|---|",
    ]
    for r in kept["rows"]:
        k1, t1 = best(r, "n1_us")
        k5, t5 = best(r, "n5_us")
        out.append(
            f"| {r['weights']} | {esc(r['matrix'])} | {r['per32_n1_us']:.2f} | {t1:.2f} ({k1}) | "
            f"{r['per32_n5_us']:.2f} | {t5:.2f} ({k5}) |"
        )
    out += [
        "",
        "Sum of the eight best n=5 times per variant (per-32: "
        f"{sum(r['per32_n5_us'] for r in kept['rows']):.1f} µs; per-32 n=1: "
        f"{sum(r['per32_n1_us'] for r in kept['rows']):.1f} µs):",
        "",
    ]
    for v in d["variants"]:
        tot = sum(best(r, "n5_us")[1] for r in v["rows"])
        out.append(f"- {v['name']} ({v['commit']}): {tot:.1f} µs — {v['what']}")
    x = d.get("variants_x")
    if x:
        same = x["same_run"]
        p1 = sum(r["per32_n1_us"] for r in same)
        p5 = sum(r["per32_n5_us"] for r in same)
        qt = sum(min(r["mvqt_n5_us"].values()) for r in same)
        out += [
            "",
            "Experimental verify variants `mvqx_*` (same bits; one later device call, sum of the best K split "
            f"per launch; that call's per-32 n=1 {p1:.1f}, per-32 n=5 {p5:.1f}, mvqt {qt:.1f} µs):",
            "",
        ]
        for key, what in (
            ("u0t1", "whole chunks, constant ring stages, ping-pong operands"),
            ("u1t1", "the same with unsigned A and the code-sum correction"),
            ("u0t2", "two m16 tiles per warp sharing the activation-side loads"),
            ("u1t2", "two tiles and unsigned A"),
        ):
            tot = sum(min(v for k, v in r["n5_us"].items() if k.startswith(key)) for r in x["rows"])
            out.append(f"- {key}: {tot:.1f} µs — {what}")
        tot = sum(min(r["n5_us"].values()) for r in x["rows"])
        out.append(f"- best variant per launch: {tot:.1f} µs")
    return out


if __name__ == "__main__":
    main()
