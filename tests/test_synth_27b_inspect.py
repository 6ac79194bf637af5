"""Issue "must show": ``python -m bonsai synth --preset 27b`` writes files whose header matches the real
Bonsai-27B (MODEL.md §0, §1.5, §2.1-2.3) and ``python -m bonsai inspect`` reads them back.

The files are written with ``--sparse``: the header is real, the data section is a hole (no disk used),
so only header-level validation applies (shapes, types, offsets, extents); the weights read as zeros.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bonsai import gguf_io as G

ROOT = Path(__file__).resolve().parent.parent

# Published file sizes (MODEL.md §0): Bonsai-27B-Q1_0 and Ternary-Bonsai-27B-Q2_0 (legacy g128, id 42).
REAL_SIZE = {"q1": 3_803_452_480, "q2": 7_165_121_600}
LOWBIT_ID = {"q1": 41, "q2": 42}
TYPE_LINE = {"q1": "Q1_0", "q2": "Q2_0(g128)"}
BYTES_PER_BLOCK = {"q1": (18, 128), "q2": (34, 128)}  # (block bytes, block elements)

N_EMBD, N_FF, N_VOCAB = 5120, 17408, 248320
N_LAYER = 64


def expected_tensors() -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape [ne0, ne1, ...], low-bit?) straight from MODEL.md §2.3."""
    t: dict[str, tuple[tuple[int, ...], bool]] = {
        "token_embd.weight": ((N_EMBD, N_VOCAB), True),
        "output_norm.weight": ((N_EMBD,), False),
        "output.weight": ((N_EMBD, N_VOCAB), True),
    }
    for il in range(N_LAYER):
        b = f"blk.{il}."
        t[b + "attn_norm.weight"] = ((N_EMBD,), False)
        t[b + "post_attention_norm.weight"] = ((N_EMBD,), False)
        t[b + "ffn_gate.weight"] = ((N_EMBD, N_FF), True)
        t[b + "ffn_up.weight"] = ((N_EMBD, N_FF), True)
        t[b + "ffn_down.weight"] = ((N_FF, N_EMBD), True)
        if (il + 1) % 4 == 0:  # full attention
            t[b + "attn_q.weight"] = ((N_EMBD, 12288), True)
            t[b + "attn_k.weight"] = ((N_EMBD, 1024), True)
            t[b + "attn_v.weight"] = ((N_EMBD, 1024), True)
            t[b + "attn_q_norm.weight"] = ((256,), False)
            t[b + "attn_k_norm.weight"] = ((256,), False)
            t[b + "attn_output.weight"] = ((6144, N_EMBD), True)
        else:  # Gated DeltaNet
            t[b + "attn_qkv.weight"] = ((N_EMBD, 10240), True)
            t[b + "attn_gate.weight"] = ((N_EMBD, 6144), True)
            t[b + "ssm_beta.weight"] = ((N_EMBD, 48), True)
            t[b + "ssm_alpha.weight"] = ((N_EMBD, 48), True)
            t[b + "ssm_conv1d.weight"] = ((4, 10240), False)
            t[b + "ssm_dt.bias"] = ((48,), False)
            t[b + "ssm_a"] = ((48,), False)
            t[b + "ssm_norm.weight"] = ((128,), False)
            t[b + "ssm_out.weight"] = ((6144, N_EMBD), True)
    return t


EXPECTED = expected_tensors()


def run(args, **kw):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "bonsai", *map(str, args)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
        env=env,
        **kw,
    )


@pytest.fixture(scope="module", params=["q1", "q2"])
def model27b(request, tmp_path_factory):
    variant = request.param
    out = tmp_path_factory.mktemp(f"b27-{variant}") / f"bonsai-27b-{variant}.gguf"
    r = run(["synth", "--preset", "27b", "--variant", variant, "--sparse", "--out", out, "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == out
    return variant, out


def test_expected_table_is_851():
    assert len(EXPECTED) == 3 + 48 * 14 + 16 * 11 == 851
    assert sum(low for _, low in EXPECTED.values()) == 498
    n_low = sum(s[0] * s[1] for s, low in EXPECTED.values() if low)
    assert n_low == 26_893_352_960  # MODEL.md §1.5


def test_sparse_writes_nothing_big(model27b):
    _, path = model27b
    st = path.stat()
    assert st.st_size > 3_000_000_000
    assert st.st_blocks * 512 < 64 << 20, "a sparse file must not allocate its data section"


def test_header_matches_real_model(model27b):
    variant, path = model27b
    g = G.read_gguf(path)
    names = [t.name for t in g.tensors]
    assert len(names) == 851 == len(set(names))
    assert set(names) == set(EXPECTED)
    assert names[0] == "token_embd.weight"

    block_bytes, block_elems = BYTES_PER_BLOCK[variant]
    nbytes: dict[str, int] = {}
    for t in g.tensors:
        shape, low = EXPECTED[t.name]
        assert tuple(t.shape) == shape, t.name
        if low:
            assert t.ggml_type == LOWBIT_ID[variant], t.name
            assert shape[0] % block_elems == 0
            nbytes[t.name] = shape[0] // block_elems * block_bytes * shape[1]
        else:
            assert t.ggml_type == 0, t.name  # F32
            nbytes[t.name] = 4 * math.prod(shape)
        assert t.offset % g.alignment == 0

    # each tensor's extent (to the next offset / end of file) is its size rounded up to the alignment:
    # no overlaps, no gaps, nothing missing at the end
    ext = g.extents()
    for name, n in nbytes.items():
        assert n <= ext[name] < n + g.alignment, name
    assert sum(ext.values()) == g.file_size - g.data_start
    assert sum(nbytes.values()) <= g.file_size - g.data_start < sum(nbytes.values()) + 851 * g.alignment

    # hyperparameters (MODEL.md §2.1)
    kv = g.kv
    want = {
        "general.architecture": "qwen35",
        "qwen35.block_count": 64,
        "qwen35.context_length": 262144,
        "qwen35.embedding_length": 5120,
        "qwen35.feed_forward_length": 17408,
        "qwen35.attention.head_count": 24,
        "qwen35.attention.head_count_kv": 4,
        "qwen35.attention.key_length": 256,
        "qwen35.attention.value_length": 256,
        "qwen35.rope.dimension_count": 64,
        "qwen35.full_attention_interval": 4,
        "qwen35.ssm.conv_kernel": 4,
        "qwen35.ssm.state_size": 128,
        "qwen35.ssm.group_count": 16,
        "qwen35.ssm.time_step_rank": 48,
        "qwen35.ssm.inner_size": 6144,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
    }
    for k, v in want.items():
        assert kv[k] == v, k
    assert float(kv["qwen35.rope.freq_base"]) == 1.0e7
    assert abs(float(kv["qwen35.attention.layer_norm_rms_epsilon"]) - 1e-6) < 1e-12
    assert list(kv["qwen35.rope.dimension_sections"]) == [11, 11, 10, 0]
    assert len(kv["tokenizer.ggml.tokens"]) == N_VOCAB
    assert "tokenizer.chat_template" in kv


def test_size_matches_published(model27b):
    variant, path = model27b
    size = path.stat().st_size
    real = REAL_SIZE[variant]
    assert abs(size - real) / real < 0.01, f"{size:,} vs published {real:,}"


def test_inspect_reads_it_back(model27b):
    variant, path = model27b
    r = run(["inspect", path])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^architecture: +qwen35$", out, re.M)
    assert re.search(r"^tensors: +851 \(26\.90 B parameters\)$", out, re.M)
    assert re.search(rf"^size: .*\({path.stat().st_size} bytes\)$", out, re.M)
    assert re.search(rf"^  {re.escape(TYPE_LINE[variant])} +498 tensors", out, re.M), out
    assert re.search(r"^  F32 +353 tensors", out, re.M)
    assert "layers 64 (48 GDN + 16 attention, interval 4), n_embd 5120, n_ff 17408, vocab 248320" in out
    assert "attention 24 heads / 4 kv x 256, rope 64 dims base 10000000; GDN H_k 16 H_v 48 d_state 128" in out
    assert "head untied" in out and "attention q/k/v separate" in out
    assert "248320 tokens" in out
    # header-level validation: shapes, types, offsets and extents all check out
    assert re.search(r"^validation: +OK$", out, re.M)
    # the memory estimate at 4096 context is dominated by the weights (~3.5 / ~6.7 GiB)
    m = re.search(r"ctx +4096: weights ([\d.]+) GiB", out)
    assert m
    assert abs(float(m.group(1)) * 2**30 - REAL_SIZE[variant]) / REAL_SIZE[variant] < 0.01


def test_inspect_counts_match_header(model27b):
    variant, path = model27b
    g = G.read_gguf(path)
    hist = Counter(t.ggml_type for t in g.tensors)
    assert hist == {LOWBIT_ID[variant]: 498, 0: 353}
