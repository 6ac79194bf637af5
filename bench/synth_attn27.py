"""A `small`-sized synthetic qwen35 file with the 27B's attention shape (24 q heads, 4 kv heads,
head dim 256, 64 rotary dims): long-context CPU measurements of the attention at the real
model's shape without a 27B prefill (which takes minutes per thousand tokens on a few cores).

    python3 bench/synth_attn27.py --out /tmp/attn27-q1.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bonsai import synth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="q1")
    a = ap.parse_args()
    big, small = synth.PRESETS["27b"], synth.PRESETS["small"]
    synth.PRESETS["attn27"] = dataclasses.replace(
        small,
        name="attn27",
        n_head=big.n_head,
        head_dim=big.head_dim,
        n_head_kv=big.n_head_kv,
        rope_dims=big.rope_dims,
        rope_sections=big.rope_sections,
    )
    print(synth.make_target(a.out, preset="attn27", variant=a.variant, progress=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
