"""Tests of the synthetic model generator (bonsai.synth), its GGUF writer/reader and quantizers."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from bonsai import _quant as Q
from bonsai import gguf_io as G

VARIANTS = ["q1", "q2", "pq2", "q2g64"]
GGML_ID = {"q1": 41, "q2": 42, "pq2": 142, "q2g64": 42}
FMT = {"q1": "Q1_0", "q2": "Q2_0G128", "pq2": "PQ2_0", "q2g64": "Q2_0G64"}


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ---------------------------------------------------------------------------------------------------
# quantizers
# ---------------------------------------------------------------------------------------------------


def test_quant_hand_blocks():
    x = np.linspace(-1, 1, 128, dtype=np.float32)
    b = Q.quantize("Q1_0", x)
    assert b.shape == (1, 18)
    d = np.frombuffer(b[0, :2].tobytes(), "<f2")[0]
    assert abs(float(d) - np.abs(x).mean()) < 1e-3
    # bit j = x_j >= 0: the first 64 elements are negative -> the first 8 bytes are 0
    assert (b[0, 2:10] == 0).all() and (b[0, 10:18] == 0xFF).all()
    y = Q.dequantize("Q1_0", b, 128)[0]
    assert np.allclose(y, np.where(x >= 0, d, -d))

    for fmt, be in (("Q2_0G128", 128), ("PQ2_0", 128), ("Q2_0G64", 64)):
        x = np.zeros(be, np.float32)
        x[0], x[1], x[2], x[3] = -2.0, 0.4, 2.0, 1.2  # codes 0, 1, 2, 2 (roundf(0.6) = 1)
        x[5] = -0.5  # roundf(-0.25) + 1 = 1
        b = Q.quantize(fmt, x)
        assert b.shape == (1, 2 + be // 4)
        assert b[0, 2] == (0 | 1 << 2 | 2 << 4 | 2 << 6)
        y = Q.dequantize(fmt, b, be)[0]
        assert y[0] == -2.0 and y[1] == 0.0 and y[2] == 2.0 and y[3] == 2.0 and y[5] == 0.0
        assert not Q.q2_has_code3(b, fmt)
        # code 3 (+2d) decodes as +2d and is detected
        b2 = b.copy()
        b2[0, 3] = 3
        assert Q.dequantize(fmt, b2, be)[0][4] == 4.0
        assert Q.q2_has_code3(b2, fmt)


def test_quant_q4_1_layout_and_q8_0():
    x = np.arange(32, dtype=np.float32) * 0.5 - 3.0  # min -3, max 12.5 -> d = 15.5/15
    b = Q.quantize("Q4_1", x)
    assert b.shape == (1, 20)
    d = float(np.frombuffer(b[0, 0:2].tobytes(), "<f2")[0])
    m = float(np.frombuffer(b[0, 2:4].tobytes(), "<f2")[0])
    assert abs(m + 3.0) < 1e-6 and abs(d - 15.5 / 15) < 1e-3
    # element 0 in the low nibble of qs[0], element 16 in its high nibble
    assert b[0, 4] & 0xF == 0 and b[0, 4] >> 4 == round(8.0 / (15.5 / 15))
    y = Q.dequantize("Q4_1", b, 32)[0]
    assert np.abs(y - x).max() <= d / 2 + 1e-3
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for fmt, tol in (("Q8_0", 1 / 127), ("Q4_0", 1 / 7), ("F16", 1e-3), ("BF16", 1e-2), ("F32", 0)):
        y = Q.dequantize(fmt, Q.quantize(fmt, x), 64)
        assert y.shape == x.shape
        assert np.abs(y - x).max() <= tol * np.abs(x).max() + 1e-6, fmt
    # bf16 rounds to nearest even
    assert Q.bf16_bits(np.float32(1.0 + 2**-8))[()] == 0x3F80
    assert Q.bf16_bits(np.float32(1.0 + 3 * 2**-8))[()] == 0x3F82


# ---------------------------------------------------------------------------------------------------
# tiny files: determinism, structure, weight statistics
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_deterministic_and_structure(variant, synth, synth_model, tmp_path):
    a = synth_model("tiny", variant)
    b = synth.make_target(tmp_path / "again.gguf", "tiny", variant, seed=0, progress=False)
    c = synth.make_target(tmp_path / "seed1.gguf", "tiny", variant, seed=1, progress=False)
    assert sha(a) == sha(b)
    assert sha(a) != sha(c)

    g = G.read_gguf(a)
    assert g.version == 3
    p = synth.PRESETS["tiny"]
    n_attn = sum(1 for il in range(p.n_layer) if (il + 1) % 4 == 0)
    assert n_attn == 2
    assert len(g.tensors) == 3 + 6 * 14 + 2 * 11
    plan = synth.plan_tensors(p, FMT[variant])
    assert [t.name for t in g.tensors] == [s.name for s in plan]
    for t, s in zip(g.tensors, plan, strict=True):
        assert t.shape == s.shape, t.name
        assert t.ggml_type == (0 if s.fmt == "F32" else GGML_ID[variant]), t.name
        assert t.offset % 32 == 0
    names = {t.name for t in g.tensors}
    for n in (
        "token_embd.weight",
        "output.weight",
        "output_norm.weight",
        "blk.3.attn_q.weight",
        "blk.7.attn_k_norm.weight",
        "blk.0.ssm_a",
        "blk.0.ssm_dt.bias",
        "blk.6.ssm_conv1d.weight",
    ):
        assert n in names
    assert g.tensor("blk.3.attn_q.weight").shape == (256, 512)
    assert g.tensor("blk.0.attn_qkv.weight").shape == (256, 2 * 128 + 384)
    assert g.tensor("blk.0.ssm_conv1d.weight").shape == (4, 640)
    assert g.tensor("blk.0.ssm_out.weight").shape == (384, 256)
    assert g.tensor("blk.0.ssm_beta.weight").shape == (256, 6)
    assert g.data_start % 32 == 0
    ext = g.extents()
    for s in plan:
        assert s.nbytes <= ext[s.name] < s.nbytes + 32
    assert G.resolve_id42(g) == {"q1": None, "q2": 128, "pq2": None, "q2g64": 64}[variant]
    # every id-42 tensor resolves on its own (no tensor fits both layouts), MODEL.md §1.4
    for name, fits in G.id42_candidates(g).items():
        assert fits == [{"q2": 128, "q2g64": 64}[variant]], name

    kv = g.kv
    assert kv["general.architecture"] == "qwen35"
    assert kv["general.alignment"] == 32
    assert kv["qwen35.block_count"] == 8 and kv["qwen35.embedding_length"] == 256
    assert list(kv["qwen35.rope.dimension_sections"]) == [3, 3, 2, 0]
    assert g.kv_types["qwen35.rope.dimension_sections"] == (G.ARRAY, G.I32)
    assert kv["qwen35.full_attention_interval"] == 4
    assert kv["qwen35.ssm.inner_size"] == kv["qwen35.ssm.state_size"] * kv["qwen35.ssm.time_step_rank"]
    assert abs(kv["qwen35.attention.layer_norm_rms_epsilon"] - 1e-6) < 1e-12
    toks = kv["tokenizer.ggml.tokens"]
    assert len(toks) == p.n_vocab_rows == g.tensor("token_embd.weight").shape[1]
    assert len(set(toks)) == len(toks)
    assert toks[kv["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert toks[kv["tokenizer.ggml.padding_token_id"]] == "<|endoftext|>"
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert kv["tokenizer.ggml.pre"] == "qwen35" and kv["tokenizer.ggml.model"] == "gpt2"
    assert toks[-1] == f"[PAD{len(toks) - 1}]" and kv["tokenizer.ggml.token_type"][-1] == 5
    assert kv["tokenizer.chat_template"] == synth.chat_template()


def _read(g, name):
    t = g.tensor(name)
    fmt = "F32" if t.ggml_type == 0 else {41: "Q1_0", 142: "PQ2_0"}.get(t.ggml_type)
    if fmt is None:
        fmt = "Q2_0G128" if G.resolve_id42(g) == 128 else "Q2_0G64"
    nbytes = Q.tensor_bytes(fmt, t.shape)
    raw = g.tensor_data(name, nbytes)
    n0 = t.shape[0]
    return fmt, raw, Q.dequantize(fmt, raw, n0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_weight_statistics(variant, request, synth):
    g = G.read_gguf(request.getfixturevalue(f"tiny_{variant}"))
    fmt, raw, emb = _read(g, "token_embd.weight")
    if fmt != "Q1_0":
        assert not Q.q2_has_code3(raw, fmt)
    rms = np.sqrt((emb**2).mean(axis=1))
    assert 0.8 < rms.mean() < 1.2
    for name, n_in in (
        ("blk.0.ffn_up.weight", 256),
        ("blk.0.ffn_down.weight", 512),
        ("blk.3.attn_q.weight", 256),
        ("blk.0.ssm_out.weight", 384),
    ):
        fmt, raw, w = _read(g, name)
        if fmt != "Q1_0":
            assert not Q.q2_has_code3(raw, fmt)
            zeros = (w == 0).mean()
            assert 0.4 < zeros < 0.6  # P(code 1) = 1/2
        x = np.random.default_rng(0).standard_normal((n_in, 16))
        y = w @ x
        assert 0.8 < y.std() < 1.25, name  # unit-RMS in -> ~unit-RMS out
    # head: logits std ~3.5 on real tokens, padding rows quiet
    _, _, head = _read(g, "output.weight")
    x = np.random.default_rng(1).standard_normal(256)
    logits = head @ x
    n_real = synth.PRESETS["tiny"].n_bpe + len(synth.SPECIALS)
    assert 3.0 < logits[:n_real].std() < 4.2
    assert np.abs(logits[n_real:]).max() < 0.1
    # F32 side tensors
    a = _read(g, "blk.0.ssm_a")[2].ravel()
    assert (a <= -1).all() and (a >= -16).all()
    dtb = _read(g, "blk.0.ssm_dt.bias")[2].ravel()
    dt = np.log1p(np.exp(dtb))
    assert (dt > 9e-4).all() and (dt < 0.11).all()
    for n in ("blk.0.attn_norm.weight", "blk.0.ssm_norm.weight", "output_norm.weight", "blk.3.attn_q_norm.weight"):
        w = _read(g, n)[2]
        assert abs(w.mean() - 1) < 0.05 and 0.02 < w.std() < 0.1
    c = _read(g, "blk.0.ssm_conv1d.weight")[2]
    assert c.shape == (640, 4) and np.abs(c).max() <= 0.5


# ---------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # comment\n\n",
    "Schön, ¿Dónde? 你好，世界 🙂  two  spaces   end",
    "I'm sure they'll say it's 12345 — ok?",
]


def test_reference_tokenizer_roundtrip(tiny_tokenizer):
    for s in TEXTS:
        ids = tiny_tokenizer.encode(s)
        assert tiny_tokenizer.decode(ids) == s
        assert len(ids) < len(s.encode())  # merges actually merge
    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tiny_tokenizer.encode(chat)
    v = tiny_tokenizer
    assert ids[0] == v.ids["<|im_start|>"] and v.ids["<think>"] in ids
    assert v.decode(ids) == chat


def test_27b_vocab_specials(synth):
    v = synth.build_vocab(248044, 248320)
    assert len(v.tokens) == 248320 and len(set(v.tokens)) == 248320
    assert len(v.merges) == 248044 - 256
    want = {
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<|object_ref_start|>": 248047,
        "<|quad_end|>": 248052,
        "<|vision_start|>": 248053,
        "<|vision_end|>": 248054,
        "<|vision_pad|>": 248055,
        "<|video_pad|>": 248057,
        "<tool_call>": 248058,
        "</tool_call>": 248059,
        "<|fim_prefix|>": 248060,
        "<|fim_pad|>": 248063,
        "<|repo_name|>": 248064,
        "<|file_sep|>": 248065,
        "<think>": 248068,
        "</think>": 248069,
    }
    for s, i in want.items():
        assert v.tokens[i] == s
    assert v.token_types[248044] == 3 and v.token_types[248046] == 3 and v.token_types[248068] == 4
    assert v.tokens[248319] == "[PAD248319]" and v.token_types[248319] == 5
    assert v.eos_id == 248046 and v.pad_id == 248044
    # every merge is valid: both parts are earlier tokens and the result is the next token
    index = {t: i for i, t in enumerate(v.tokens)}
    for r in range(0, len(v.merges), 997):
        a, b = v.merges[r].split(" ")
        assert index[a] < 256 + r and index[b] < 256 + r and index[a + b] == 256 + r


# ---------------------------------------------------------------------------------------------------
# llama.cpp loads the tiny q1 / q2g64 files
# ---------------------------------------------------------------------------------------------------


def _llama(path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)


@pytest.mark.parametrize("variant", ["q1", "q2g64"])
def test_llama_cpp_loads_tiny(variant, request, tiny_tokenizer):
    llm = _llama(request.getfixturevalue(f"tiny_{variant}"))
    assert llm.n_vocab() == 1536
    for s in TEXTS:
        ids = llm.tokenize(s.encode(), add_bos=False, special=False)
        assert ids == tiny_tokenizer.encode(s, special=False)
        assert llm.detokenize(ids).decode() == s
    chat = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.tokenize(chat.encode(), add_bos=False, special=True)
    assert ids == tiny_tokenizer.encode(chat)
    llm.reset()
    llm.eval(ids)
    lg = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    assert np.isfinite(lg).all()
    assert (lg.std(axis=1) > 1.0).all()  # not constant within a row
    assert np.abs(np.diff(lg, axis=0)).max() > 1.0  # rows differ between positions


def test_llama_cpp_greedy_is_varied(tiny_q1, tiny_tokenizer, synth):
    llm = _llama(tiny_q1)
    prompt = tiny_tokenizer.encode("<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n")
    llm.reset()
    llm.eval(prompt)
    out, margins = [], []
    for _ in range(32):
        lg = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.sort(lg)[-2:]
        margins.append(top[1] - top[0])
        t = int(np.argmax(lg))
        out.append(t)
        llm.eval([t])
    distinct = len(set(out))
    m = np.asarray(margins)
    print(
        f"\ngreedy tiny q1: {distinct} distinct of 32; top1-top2 margin min {m.min():.4f} "
        f"median {np.median(m):.4f} max {m.max():.4f}"
    )
    print("text:", repr(tiny_tokenizer.decode(out)))
    assert distinct >= 8
    assert all(t < synth.PRESETS["tiny"].n_bpe + len(synth.SPECIALS) for t in out)  # never a pad row


# ---------------------------------------------------------------------------------------------------
# 27b headers (sparse) and write throughput
# ---------------------------------------------------------------------------------------------------


def _check_27b_shapes(g, variant):
    E, V, FF = 5120, 248320, 17408
    low = GGML_ID[variant]
    expect = {
        "token_embd.weight": ((E, V), low),
        "output.weight": ((E, V), low),
        "output_norm.weight": ((E,), 0),
    }
    for il in range(64):
        b = f"blk.{il}."
        expect[b + "attn_norm.weight"] = ((E,), 0)
        expect[b + "post_attention_norm.weight"] = ((E,), 0)
        expect[b + "ffn_gate.weight"] = ((E, FF), low)
        expect[b + "ffn_up.weight"] = ((E, FF), low)
        expect[b + "ffn_down.weight"] = ((FF, E), low)
        if (il + 1) % 4 == 0:
            expect[b + "attn_q.weight"] = ((E, 12288), low)
            expect[b + "attn_k.weight"] = ((E, 1024), low)
            expect[b + "attn_v.weight"] = ((E, 1024), low)
            expect[b + "attn_q_norm.weight"] = ((256,), 0)
            expect[b + "attn_k_norm.weight"] = ((256,), 0)
            expect[b + "attn_output.weight"] = ((6144, E), low)
        else:
            expect[b + "attn_qkv.weight"] = ((E, 10240), low)
            expect[b + "attn_gate.weight"] = ((E, 6144), low)
            expect[b + "ssm_beta.weight"] = ((E, 48), low)
            expect[b + "ssm_alpha.weight"] = ((E, 48), low)
            expect[b + "ssm_conv1d.weight"] = ((4, 10240), 0)
            expect[b + "ssm_dt.bias"] = ((48,), 0)
            expect[b + "ssm_a"] = ((48,), 0)
            expect[b + "ssm_norm.weight"] = ((128,), 0)
            expect[b + "ssm_out.weight"] = ((6144, E), low)
    assert len(g.tensors) == 851 == len(expect)
    assert g.tensors[0].name == "token_embd.weight" and g.tensors[1].name == "output_norm.weight"
    for t in g.tensors:
        assert (t.shape, t.ggml_type) == expect[t.name], t.name
    n_low = sum(1 for t in g.tensors if t.ggml_type != 0)
    assert n_low == 498
    assert sum(int(np.prod(t.shape)) for t in g.tensors if t.ggml_type != 0) == 26_893_352_960


@pytest.mark.parametrize("variant", VARIANTS)
def test_27b_sparse_headers(variant, synth, tmp_path):
    t0 = time.time()
    path = synth.make_target(tmp_path / f"27b-{variant}.gguf", "27b", variant, sparse=True, progress=False)
    dt = time.time() - t0
    g = G.read_gguf(path)
    _check_27b_shapes(g, variant)
    real = synth.REAL_SIZES[variant]
    size = path.stat().st_size
    print(f"\n27b {variant}: {size:,} B vs real {real:,} B ({100 * (size - real) / real:+.3f} %), header in {dt:.1f} s")
    assert abs(size - real) / real < 0.01
    kv = g.kv
    assert kv["qwen35.block_count"] == 64 and kv["qwen35.embedding_length"] == 5120
    assert kv["qwen35.feed_forward_length"] == 17408 and kv["qwen35.context_length"] == 262144
    assert kv["qwen35.attention.head_count"] == 24 and kv["qwen35.attention.head_count_kv"] == 4
    assert kv["qwen35.attention.key_length"] == 256 == kv["qwen35.attention.value_length"]
    assert kv["qwen35.rope.dimension_count"] == 64 and list(kv["qwen35.rope.dimension_sections"]) == [11, 11, 10, 0]
    assert kv["qwen35.rope.freq_base"] == 1.0e7
    assert (
        kv["qwen35.ssm.conv_kernel"],
        kv["qwen35.ssm.state_size"],
        kv["qwen35.ssm.group_count"],
        kv["qwen35.ssm.time_step_rank"],
        kv["qwen35.ssm.inner_size"],
    ) == (4, 128, 16, 48, 6144)
    assert kv["tokenizer.ggml.eos_token_id"] == 248046 and kv["tokenizer.ggml.padding_token_id"] == 248044
    toks = kv["tokenizer.ggml.tokens"]
    assert len(toks) == 248320 and toks[248046] == "<|im_end|>" and toks[248319] == "[PAD248319]"
    # id-42 extents: g128 34-byte blocks for q2, 18-byte g64 for q2g64 (MODEL.md §1.4)
    ext = g.extents()
    assert G.resolve_id42(g) == {"q1": None, "q2": 128, "pq2": None, "q2g64": 64}[variant]
    if variant == "q2":
        assert g.tensor("output_norm.weight").offset == 337_715_200 == ext["token_embd.weight"]
    if variant == "q2g64":
        assert g.tensor("output_norm.weight").offset == 357_580_800
    blk = {"q1": (128, 18), "q2": (128, 34), "pq2": (128, 34), "q2g64": (64, 18)}[variant]
    for t in g.tensors:
        if t.ggml_type != 0:
            n = int(np.prod(t.shape))
            s = n // blk[0] * blk[1]
            assert s <= ext[t.name] < s + 32, t.name


def test_write_throughput(synth, tmp_path):
    """Time a full small q1 file and 256 MB of the 27b q2 stream; report the 27b estimate."""
    t0 = time.time()
    p = synth.make_target(tmp_path / "small-q1.gguf", "small", "q1", progress=False)
    dt_small = time.time() - t0
    size = p.stat().st_size
    g = G.read_gguf(p)
    assert len(g.tensors) == 3 + 12 * 14 + 4 * 11
    _, _, emb = _read(g, "blk.5.ffn_down.weight")
    assert np.isfinite(emb).all()
    n = 256 << 20
    t0 = time.time()
    synth.make_target(tmp_path / "27b-q2-part.gguf", "27b", "q2", progress=False, max_bytes=n)
    dt = time.time() - t0
    rate = n / dt
    print(
        f"\nsmall q1: {size / 1e6:.1f} MB in {dt_small:.2f} s; 27b q2 stream: {rate / 1e6:.0f} MB/s "
        f"(incl. header) -> full 27b q1 ~{3.80e9 / rate:.0f} s, q2 ~{7.17e9 / rate:.0f} s on this machine"
    )
    assert dt_small < 30


# ---------------------------------------------------------------------------------------------------
# DSpark drafter
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["q1", "q2", "q2g64"])
def test_tiny_drafter_matches_target(variant, synth, synth_model, tmp_path):
    tp = synth_model("tiny", variant)
    dp = synth.make_drafter(tmp_path / "d.gguf", "tiny", variant, progress=False)
    assert sha(dp) == sha(synth.make_drafter(tmp_path / "d2.gguf", "tiny", variant, progress=False))
    g, gt = G.read_gguf(dp), G.read_gguf(tp)
    assert len(g.tensors) == 13 + 6 * 11
    kv = g.kv
    assert kv["general.architecture"] == "dspark" and kv["dspark.block_count"] == 6
    assert kv["dspark.embedding_length"] == gt.kv["qwen35.embedding_length"]
    assert kv["dspark.vocab_size"] == 1536 and kv["dspark.dspark.mask_token_id"] == 1535
    assert list(kv["dspark.dspark.target_layers"]) == synth.drafter_target_layers(8)
    assert synth.drafter_target_layers(64) == [1, 16, 31, 46, 61]
    assert kv["dspark.dspark.min_log_snr"] < kv["dspark.dspark.max_log_snr"]
    assert g.tensor("dspark.fc.weight").shape == (5 * 256, 256)
    assert G.resolve_id42(g) == (None if variant == "q1" else 128)
    fmt_d = "Q1_0" if variant == "q1" else "Q2_0G128"
    ed = g.tensor_data("token_embd.weight", Q.tensor_bytes(fmt_d, (256, 1536)))
    et = gt.tensor_data("token_embd.weight", Q.tensor_bytes(FMT[variant], (256, 1536)))
    assert (ed.size == et.size and (ed == et).all()) == (variant != "q2g64")
    assert g.tensor("output.weight").ggml_type == 3  # Q4_1 copy of the target head
    h = Q.dequantize("Q4_1", g.tensor_data("output.weight", Q.tensor_bytes("Q4_1", (256, 1536))), 256)
    ht = Q.dequantize(FMT[variant], gt.tensor_data("output.weight", Q.tensor_bytes(FMT[variant], (256, 1536))), 256)
    assert ((h - ht) ** 2).sum() / (ht**2).sum() < 0.01


def test_27b_drafter_sparse(synth, tmp_path):
    p = synth.make_drafter(tmp_path / "d27.gguf", "27b", "q2", sparse=True, progress=False)
    g = G.read_gguf(p)
    assert len(g.tensors) == 79
    assert g.tensor("token_embd.weight").shape == (5120, 248320)
    assert g.tensor("dspark.markov_head_b.weight").shape == (256, 248320)
    assert g.tensor("blk.5.attn_k.weight").shape == (5120, 512)
    assert G.resolve_id42(g) == 128
    size = p.stat().st_size
    print(f"\n27b ternary drafter: {size:,} B (published Q4_1 drafter 1,946,393,568 B)")
    assert abs(size - 1_946_393_568) / 1_946_393_568 < 0.10
