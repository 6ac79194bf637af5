"""The command line, run as a subprocess: ``python -m bonsai {generate,inspect,synth}``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import bonsai
from bonsai import gguf_io as G

ROOT = Path(__file__).resolve().parent.parent
TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", 41: "Q1_0", 142: "PQ2_0"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bonsai-cache")


def run(args, cache, timeout=120, **kw):
    env = dict(os.environ, BONSAI_CACHE=str(cache), PYTHONIOENCODING="utf-8")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "bonsai", *map(str, args)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
        env=env,
        **kw,
    )


def test_generate_demo_model(cache):
    r = run(["generate", "-n", "12", "--temperature", "0"], cache)
    assert r.returncode == 0, r.stderr
    assert "RANDOM" in r.stderr and "demo model" in r.stderr
    assert r.stdout.strip() != ""
    # the demo model was made in BONSAI_CACHE, and the summary line reports the run
    demo = list(Path(cache).glob("demo-*.gguf"))
    assert len(demo) == 1 and str(demo[0]) in r.stderr
    assert re.search(r"\[(length|stop)\] prompt \d+ tok", r.stderr)
    # second run reuses the cached file and gives the same greedy text
    r2 = run(["generate", "-n", "12", "--temperature", "0"], cache)
    assert r2.returncode == 0 and r2.stdout == r.stdout
    assert list(Path(cache).glob("demo-*.gguf")) == demo


def test_generate_raw_matches_api(cache, tiny_q1):
    prompt = "Once upon a time"
    r = run(["generate", "-m", tiny_q1, "--raw", "--temperature", "0", "-n", "8", "--device", "cpu", prompt], cache)
    assert r.returncode == 0, r.stderr
    eng = bonsai.Engine(tiny_q1, device="cpu")
    c = eng.complete(prompt, max_tokens=8, temperature=0)
    assert r.stdout == c.text + "\n"
    assert f"[{c.finish_reason}] prompt {len(eng.tokenize(prompt))} tok" in r.stderr
    assert f"{c.usage['completion_tokens']} tok generated" in r.stderr
    assert "RANDOM" not in r.stderr


def test_generate_chat_mode_matches_api(cache, tiny_q1):
    prompt = "Hi!"
    for extra, think in (([], True), (["--no-think"], False)):
        r = run(["generate", "-m", tiny_q1, "--temperature", "0", "-n", "8", *extra, prompt], cache)
        assert r.returncode == 0, r.stderr
        eng = bonsai.Engine(tiny_q1, device="cpu")
        text = "".join(
            c.text
            for c in eng.chat([{"role": "user", "content": prompt}], enable_thinking=think, max_tokens=8, temperature=0)
        )
        assert r.stdout == text + "\n"


def test_generate_stop_and_seed(cache, tiny_q1):
    base = ["generate", "-m", tiny_q1, "--raw", "-n", "10", "--seed", "5", "--temperature", "1.0", "Hello"]
    a, b = run(base, cache), run(base, cache)
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout  # seeded sampling is reproducible across processes
    eng = bonsai.Engine(tiny_q1, device="cpu")
    c = eng.complete("Hello", max_tokens=10, seed=5, temperature=1.0)
    assert a.stdout == c.text + "\n"


def test_generate_bad_model_exits_nonzero(cache, tmp_path):
    p = tmp_path / "nope.gguf"
    r = run(["generate", "-m", p, "-n", "4"], cache)
    assert r.returncode == 2
    assert "bonsai: error:" in r.stderr and str(p) in r.stderr
    assert "Traceback" not in r.stderr


def test_generate_bad_device_and_values(cache, tiny_q1):
    r = run(["generate", "-m", tiny_q1, "--device", "cuda", "-n", "4"], cache)
    assert r.returncode == 2 and "cuda" in r.stderr.lower() and "Traceback" not in r.stderr
    r = run(["generate", "-m", tiny_q1, "--temperature", "-1", "-n", "4"], cache)
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr
    r = run(["generate", "-m", tiny_q1, "-n", "0"], cache)
    assert r.returncode == 2 and "max_tokens" in r.stderr and "Traceback" not in r.stderr


def _type_histogram(path):
    g = G.read_gguf(path)
    return g, Counter(t.ggml_type for t in g.tensors)


def test_inspect_tiny(cache, tiny_q1):
    r = run(["inspect", tiny_q1], cache)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    g, hist = _type_histogram(tiny_q1)
    assert re.search(r"^architecture: +qwen35$", out, re.M)
    assert re.search(rf"^tensors: +{len(g.tensors)} \(", out, re.M)
    assert re.search(rf"^size: .*\({tiny_q1.stat().st_size} bytes\)", out, re.M)
    for tid, n in hist.items():
        assert re.search(rf"^  {TYPE_NAMES[tid]} +{n} tensors", out, re.M), (tid, n, out)
    assert re.search(r"^validation: +OK$", out, re.M)
    assert "layers 8 (6 GDN + 2 attention, interval 4)" in out
    assert "memory estimate" in out


def test_inspect_q2_resolves_layout(cache, tiny_q2, tiny_q2g64):
    for path, name in ((tiny_q2, "Q2_0(g128)"), (tiny_q2g64, "Q2_0(g64)")):
        r = run(["inspect", path], cache)
        assert r.returncode == 0, r.stderr
        assert re.search(rf"^  {re.escape(name)} +\d+ tensors", r.stdout, re.M), r.stdout
        assert "validation:   OK" in r.stdout


def test_inspect_drafter(cache, synth, tmp_path):
    d = synth.make_drafter(tmp_path / "d.gguf", "tiny", "q1", seed=0, progress=False)
    r = run(["inspect", d], cache)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^architecture: +dspark$", r.stdout, re.M)
    assert re.search(r"^tensors: +79 \(", r.stdout, re.M)
    assert "drafter:" in r.stdout and "validation:   OK" in r.stdout


@pytest.mark.parametrize("kind", ["random", "truncated", "empty"])
def test_inspect_corrupt_file(cache, tiny_q1, tmp_path, kind):
    p = tmp_path / f"{kind}.gguf"
    if kind == "random":
        p.write_bytes(os.urandom(4096))
        words = ["magic"]
    elif kind == "truncated":
        p.write_bytes(tiny_q1.read_bytes()[:5000])
        words = ["truncated"]
    else:
        p.write_bytes(b"")
        words = ["truncated"]
    r = run(["inspect", p], cache)
    assert r.returncode != 0
    assert r.stderr.startswith("bonsai inspect: ")
    assert str(p) in r.stderr and all(w in r.stderr for w in words), r.stderr
    assert "Traceback" not in r.stderr
    assert "validation:   OK" not in r.stdout


def test_inspect_invalid_model_reports_failure(cache, tiny_q1, tmp_path):
    """A readable container holding an invalid model: the report shows the validation failure."""
    data = bytearray(tiny_q1.read_bytes())
    key = b"qwen35.block_count"
    i = data.index(key) + len(key)
    assert int.from_bytes(data[i + 4 : i + 8], "little") == 8
    data[i + 4 : i + 8] = (12).to_bytes(4, "little")
    p = tmp_path / "bad-layers.gguf"
    p.write_bytes(bytes(data))
    r = run(["inspect", p], cache)
    assert r.returncode == 1
    assert re.search(r"^validation: +FAILED \(tensor\): .*'blk\.8\.", r.stdout, re.M), r.stdout
    assert re.search(r"^architecture: +qwen35$", r.stdout, re.M)  # the rest of the report is still there


def test_inspect_missing_file(cache, tmp_path):
    p = tmp_path / "missing.gguf"
    r = run(["inspect", p], cache)
    assert r.returncode != 0 and str(p) in r.stderr and "Traceback" not in r.stderr


def test_synth_tiny_q2(cache, tmp_path):
    out = tmp_path / "models"
    out.mkdir()
    r = run(["synth", "--preset", "tiny", "--variant", "q2", "--out", out, "--no-progress"], cache)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.parent == out and path.exists() and path.suffix == ".gguf"
    g, hist = _type_histogram(path)
    assert g.kv["general.architecture"] == "qwen35"
    assert set(hist) == {0, 42}
    # the file loads and generates
    eng = bonsai.Engine(path, device="cpu")
    assert eng.info["weight_type"].startswith("Q2")
    c = eng.complete("Hello", max_tokens=6, temperature=0, ignore_eos=True)
    assert len(c.token_ids) == 6
    # same seed, same bytes
    r2 = run(["synth", "--preset", "tiny", "--variant", "q2", "--out", tmp_path / "again.gguf", "--no-progress"], cache)
    assert r2.returncode == 0 and (tmp_path / "again.gguf").read_bytes() == path.read_bytes()


def test_synth_bad_args(cache, tmp_path):
    r = run(["synth", "--preset", "huge", "--out", tmp_path], cache)
    assert r.returncode == 2 and "preset" in r.stderr


def test_help(cache):
    r = run(["--help"], cache)
    assert r.returncode == 0
    for cmd in ("generate", "chat", "inspect", "synth", "bench"):
        assert cmd in r.stdout
    r = run([], cache)
    assert r.returncode == 2


def test_chat_cli_session(cache, tiny_q1):
    r = run(
        ["chat", "-m", tiny_q1, "--temperature", "0", "-n", "6", "--no-think"],
        cache,
        input="Hello\n/reset\nHi again\n\n",
    )
    assert r.returncode == 0, r.stderr
    eng = bonsai.Engine(tiny_q1, device="cpu")

    def reply(msgs):
        return "".join(c.text for c in eng.chat(msgs, enable_thinking=False, max_tokens=6, temperature=0))

    a = reply([{"role": "user", "content": "Hello"}])
    b = reply([{"role": "user", "content": "Hi again"}])  # after /reset the history is empty
    assert r.stdout == f"> {a}\n> > {b}\n> "
