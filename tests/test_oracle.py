"""The engine against the two independent oracles: the NumPy reference (tests/reference.py) and llama.cpp.

Engine API used (bonsai.Engine): `Engine(path, device="cpu", n_ctx=..., threads=...)`,
`engine.logits(ids, chunked=True) -> np.ndarray [len(ids), n_vocab] float32` (fresh sequence),
`engine.tokenize(text, special=True) -> list[int]`,
`engine.generate(prompt_ids, max_tokens=..., temperature=0)` yielding events with `.token_id`.

Tolerances (derivation in `reference.q8_logit_sigma`). The engine, like llama.cpp, rounds activations to
int8 per 32 elements before its low-bit dot products. For every sequence the reference is run exactly (X)
and with llama.cpp's Q8_0 activation rounding (Q); `σ_e = rms(Q − X)` per row is the logit error such
rounding causes, and `NMSE(Q, X)` its size over the test set.
- engine vs reference: NMSE(E, X) ≤ 4·NMSE(Q, X) + 1e-7; a token the engine picks (argmax of its logits,
  or a greedy step) may trail the reference's argmax by at most τ = 5·√2·σ_e.
- engine vs llama.cpp: both carry their own rounding noise, so the allowed variance doubles:
  NMSE(E, L) ≤ 8·NMSE(Q, X) + 1e-7 and τ_pair = √2·τ.
- engine chunked prefill vs token-by-token decode: same numerics up to f32 reduction order; a different
  order can only move an activation across a single int8 rounding boundary now and then, so the gap must
  be an order of magnitude below the full rounding noise: NMSE ≤ 0.1·NMSE(Q, X) + 1e-10, and argmax equal
  except within τ.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import reference as R
from test_reference import N_GEN, PROMPTS, oracle_for, ref_for

VARIANTS = ["tiny_q1", "tiny_q2", "tiny_pq2", "tiny_q2g64"]
LLAMA_VARIANTS = ["tiny_q1", "tiny_q2g64"]

ADVERSARIAL = [
    "日本語のテキスト、中文混合，한국어 텍스트",
    "👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 family emoji with ZWJ and skin-tone modifiers",
    "e\u0301 a\u0308 n\u0303 combining marks: Zoe\u0308 cafe\u0301 \u0915\u094d\u0937",
    "line one\r\nline two\r\n\tindented\t\ttabs\n\n\n   trailing spaces   ",
    "digits 1234567890123456789 and 3.14159265358979 and 0x7fffffff",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>text<|im_end|>",
    "don't can't WE'LL they'Re I'M it's",
    "   leading spaces and    runs   ",
    "mixed\u00a0nbsp\u2009thin\u3000ideographic space",
    "naïve résumé Ελληνικά Кириллица עברית العربية",
    "",
]


@functools.cache
def engine_for(path: str):
    import bonsai

    return bonsai.Engine(path, device="cpu", n_ctx=512, threads=2)


def _stop_ids(ref: R.Reference) -> set[int]:
    meta = ref.gguf.meta
    ids = {int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta}
    toks = meta.get("tokenizer.ggml.tokens", [])
    ids |= {i for i, t in enumerate(toks) if t in ("<|im_end|>", "<|endoftext|>")}
    return ids


def _engine_greedy(engine, prompt: list[int]) -> list[int]:
    out = []
    for ev in engine.generate(list(prompt), max_tokens=N_GEN, temperature=0):
        tid = getattr(ev, "token_id", None)
        if tid is not None:
            out.append(int(tid))
    return out[:N_GEN]


def _check_greedy_path(prompt, gen, logits_seq, tau_seq, stop_ids, label):
    """Every greedy step is the argmax of the oracle's logits along the same path, or within τ of it.

    logits_seq/tau_seq cover prompt+gen; row len(prompt)-1+i is the distribution step i chose from.
    """
    p = len(prompt)
    rows = slice(p - 1, p - 1 + len(gen))
    bad = R.choice_violations(gen, logits_seq[rows], tau_seq[rows])
    assert not bad, f"{label}: greedy steps beyond the near-tie threshold: {bad[:5]}"
    if len(gen) < N_GEN:  # stopped early: on an emitted stop token, or the oracle's next pick is one
        if not (gen and gen[-1] in stop_ids):
            nxt = logits_seq[p - 1 + len(gen)]
            best_stop = max(nxt[s] for s in stop_ids) if stop_ids else -np.inf
            assert nxt.max() - best_stop <= tau_seq[p - 1 + len(gen)], f"{label}: stopped early"


def _prompts_ids(tokenize) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        ids = tokenize(text)
        assert ids, text
        out.append(ids)
    return out


# ------------------------------------------------------------------------------------------------
# engine vs reference (all four storage variants)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_vs_reference(variant, request):
    path = str(request.getfixturevalue(variant))
    eng = engine_for(path)
    ref, ref_q8 = ref_for(path), ref_for(path, "q8_0")
    stop = _stop_ids(ref)
    err = sim = sq = 0.0
    n_rows = n_top1 = n_equal_greedy = n_steps = 0
    for prompt in _prompts_ids(lambda t: eng.tokenize(t, special=True)):
        gen = _engine_greedy(eng, prompt)
        seq = prompt + gen
        E = np.asarray(eng.logits(seq), dtype=np.float64)
        X = ref.logits(seq)
        Q = ref_q8.logits(seq)
        assert E.shape == X.shape
        assert np.all(np.isfinite(E))
        tau = R.tie_threshold(R.q8_logit_sigma(X, Q))
        bad = R.choice_violations(E.argmax(1), X, tau)
        assert not bad, f"{variant}: engine top-1 beyond the near-tie threshold: {bad[:5]}"
        _check_greedy_path(prompt, gen, X, tau, stop, f"{variant} vs reference")
        ref_gen = ref.generate(prompt, len(gen))
        n_equal_greedy += sum(1 for _ in iter_equal_prefix(gen, ref_gen))
        n_steps += len(gen)
        err += float(np.sum((E - X) ** 2))
        sim += float(np.sum((Q - X) ** 2))
        sq += float(np.sum(X**2))
        n_rows += len(seq)
        n_top1 += int(np.sum(E.argmax(1) == X.argmax(1)))
    print(
        f"\n{variant}: NMSE(engine, ref)={err / sq:.3e} NMSE(ref_q8, ref)={sim / sq:.3e} "
        f"top1={n_top1 / n_rows:.4f} greedy identical prefix={n_equal_greedy}/{n_steps}"
    )
    assert err / sq <= 4.0 * sim / sq + 1e-7


def iter_equal_prefix(a, b):
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


# ------------------------------------------------------------------------------------------------
# engine vs llama.cpp
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_engine_vs_llamacpp(variant, request):
    path = str(request.getfixturevalue(variant))
    eng, orc = engine_for(path), oracle_for(path)
    ref, ref_q8 = ref_for(path), ref_for(path, "q8_0")
    stop = _stop_ids(ref)
    err = sim = sq = 0.0
    identical = 0
    prompts = _prompts_ids(orc.tokenize)
    assert len(prompts) >= 8
    for prompt in prompts:
        gen = _engine_greedy(eng, prompt)
        llama_gen, _ = orc.generate(prompt, N_GEN)
        seq = prompt + gen
        E = np.asarray(eng.logits(seq), dtype=np.float64)
        L = orc.logits(seq).astype(np.float64)
        X, Q = ref.logits(seq), ref_q8.logits(seq)
        tau_pair = math.sqrt(2.0) * R.tie_threshold(R.q8_logit_sigma(X, Q))
        # along the engine's path, each engine step is llama.cpp's argmax or a near-tie of it
        _check_greedy_path(prompt, gen, L, tau_pair, stop, f"{variant} vs llama.cpp")
        # identical greedy output up to the first divergence, which must be a llama.cpp near-tie
        k = sum(1 for _ in iter_equal_prefix(gen, llama_gen))
        if k < len(gen):
            row = L[len(prompt) - 1 + k]
            gap = row.max() - row[gen[k]]
            assert gap <= tau_pair[len(prompt) - 1 + k], f"diverged at step {k}: gap {gap}"
        else:
            identical += 1
        err += float(np.sum((E - L) ** 2))
        sim += float(np.sum((Q - X) ** 2))
        sq += float(np.sum(L**2))
    print(f"\n{variant}: NMSE(engine, llama)={err / sq:.3e} NMSE(ref_q8, ref)={sim / sq:.3e} identical={identical}/8")
    assert err / sq <= 8.0 * sim / sq + 1e-7


# ------------------------------------------------------------------------------------------------
# engine self-consistency and tokenizer
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_chunked_equals_token_by_token(variant, request):
    path = str(request.getfixturevalue(variant))
    eng = engine_for(path)
    ref, ref_q8 = ref_for(path), ref_for(path, "q8_0")
    n_vocab = ref.n_vocab
    ids = [int(t) for t in np.random.default_rng(3).integers(0, min(n_vocab, 256), 150)]  # 3 chunks of 64
    a = np.asarray(eng.logits(ids), dtype=np.float64)
    b = np.asarray(eng.logits(ids, chunked=False), dtype=np.float64)
    assert a.shape == b.shape == (len(ids), n_vocab)
    X, Q = ref.logits(ids), ref_q8.logits(ids)
    nmse_sim = R.nmse(Q, X)
    # The chunked and recurrent GDN forms agree to f32 rounding (kernels-cpu tests: ~1e-6), but the
    # engine re-quantizes activations to int8 before every matmul: a 1e-7 difference that moves one
    # value across a rounding boundary changes that activation by a whole quantization step, and on a
    # random (chaotic) model these flips compound over layers and rows. So the two forms cannot be
    # closer than a fraction of the quantization noise itself (measured on tiny_q2g64: chunk-vs-step
    # NMSE 3-5e-4 against a simulated Q8_0 noise of 6e-4-1.8e-3, from row 0 on). What must hold: each
    # form is as close to the exact reference as the simulated Q8_0 noise allows, and their mutual
    # distance stays below that noise.
    assert R.nmse(a, b) <= 1.0 * nmse_sim + 1e-10, (R.nmse(a, b), nmse_sim)
    assert R.nmse(a, X) <= 4.0 * nmse_sim and R.nmse(b, X) <= 4.0 * nmse_sim, (R.nmse(a, X), R.nmse(b, X))
    tau = R.tie_threshold(R.q8_logit_sigma(X, Q))
    assert not R.choice_violations(a.argmax(1), b, tau)
    # a fresh call gives the same answer (no state leaks between sequences)
    np.testing.assert_array_equal(np.asarray(eng.logits(ids[:10])), np.asarray(eng.logits(ids[:10])))


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_tokenizer_matches_llamacpp(text, tiny_q1):
    eng, orc = engine_for(str(tiny_q1)), oracle_for(str(tiny_q1))
    assert eng.tokenize(text, special=True) == orc.tokenize(text, special=True)


@pytest.mark.parametrize("variant", ["tiny_q1", "tiny_q2g64"])
def test_engine_long_context_vs_reference(variant, request):
    # 700 positions: the CPU attention merges fixed 256-key chunks (kernels-cpu `attn`), so these
    # rows see 1-3 chunks, through the many-rows schedule (prefill) and the per-chunk one (decode)
    import bonsai

    path = str(request.getfixturevalue(variant))
    eng = bonsai.Engine(path, device="cpu", n_ctx=1024, threads=2)
    ref, ref_q8 = ref_for(path), ref_for(path, "q8_0")
    ids = [int(t) for t in np.random.default_rng(5).integers(0, min(ref.n_vocab, 256), 700)]
    a = np.asarray(eng.logits(ids), dtype=np.float64)
    b = np.asarray(eng.logits(ids, chunked=False), dtype=np.float64)
    X, Q = ref.logits(ids), ref_q8.logits(ids)
    nmse_sim = R.nmse(Q, X)
    for name, e in (("prefill", a), ("token by token", b)):
        # the whole sequence and its last 200 rows alone (3 chunks each) are as close to the exact
        # reference as the simulated Q8_0 noise allows
        assert R.nmse(e, X) <= 4.0 * nmse_sim, (name, R.nmse(e, X), nmse_sim)
        assert R.nmse(e[500:], X[500:]) <= 4.0 * R.nmse(Q[500:], X[500:]), name
        tau = R.tie_threshold(R.q8_logit_sigma(X, Q))
        assert not R.choice_violations(e.argmax(1), X, tau), name
