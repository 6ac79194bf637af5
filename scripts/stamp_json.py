#!/usr/bin/env python3
"""Stamp the JSON records a device run wrote with the command, the commit built and the GPU.

    stamp_json.py GLOB COMMAND COMMIT GPU [ALT_COMMIT]

Every JSON object matching GLOB gets `command`, `commit` and `gpu` in front of its own keys; files
named `ab-alt-*` (scripts/gpu_ab.sh's other build) take ALT_COMMIT instead of COMMIT. Files that are
not a JSON object are left alone.
"""

import glob
import json
import os
import sys


def main() -> None:
    pattern, cmd, commit, gpu = sys.argv[1:5]
    alt = sys.argv[5] if len(sys.argv) > 5 else commit
    for f in glob.glob(pattern):
        try:
            d = json.load(open(f))
        except (OSError, ValueError):
            continue
        if isinstance(d, dict):
            c = alt if os.path.basename(f).startswith("ab-alt-") else commit
            json.dump({"command": cmd, "commit": c, "gpu": gpu.strip(), **d}, open(f, "w"), indent=1)


if __name__ == "__main__":
    main()
