#!/usr/bin/env bash
# Two builds of the bonsai wheel against each other on one machine, alternating processes: the
# same greedy CPU decode (a 4-token prompt, a warm-up request, then N tokens timed) with
# BONSAI_CPU_PAR_STATS=1 (the time inside / outside the parallel loops per request).
#   bench/cpu_build_ab.sh A.whl B.whl model.gguf [tokens] [threads] [reps]
set -uo pipefail
A=$1; B=$2; MODEL=$3; N=${4:-16}; T=${5:-$(nproc)}; REPS=${6:-3}
for v in a b; do
  w=$A; [[ $v == b ]] && w=$B
  rm -rf /tmp/bonsai-ab-$v && pip install -q --no-deps --target /tmp/bonsai-ab-$v "$w" 2>&1 | grep -v "^WARNING" | tail -2
done
DEC='
import sys, time, bonsai
e = bonsai.Engine(sys.argv[1], device="cpu", threads=int(sys.argv[3]))
ids = [(7 * i + 3) % 1000 for i in range(4)]
e.complete(ids, max_tokens=2, temperature=0, ignore_eos=True)
t = time.time()
r = e.complete(ids, max_tokens=int(sys.argv[2]), temperature=0, ignore_eos=True)
dt = time.time() - t
print(f"{len(r.token_ids)} tokens in {dt:.3f} s: {len(r.token_ids) / dt:.2f} tok/s", flush=True)
'
for ((i = 0; i < REPS; i++)); do
  for v in a b; do
    out=$(BONSAI_CPU_PAR_STATS=1 PYTHONPATH=/tmp/bonsai-ab-$v python3 -c "$DEC" "$MODEL" "$N" "$T" 2>&1 | tail -2 | tr '\n' ' ')
    echo "build-ab $v rep $i: $out"
  done
done
