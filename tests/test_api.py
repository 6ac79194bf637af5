"""The public Python API (``bonsai.Engine``) on the tiny synthetic models: streaming, sampling controls,
stops, chat templates, UTF-8 safety, cancellation, threads and asyncio."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

import bonsai

PROMPT = "Hello world"
# An uncancelled request of this length takes many seconds on the tiny model (~20 s on 2 cores), so
# a follow-up request finishing within PROMPT_S proves the first one was really stopped.
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}
PROMPT_S = 5.0


@pytest.fixture(scope="module")
def eng(tiny_q1):
    return bonsai.Engine(tiny_q1, device="cpu")


def greedy(eng, prompt=PROMPT, n=24, **kw):
    return eng.complete(prompt, max_tokens=n, temperature=0, **kw)


def assert_quick_followup(eng, expect):
    t0 = time.perf_counter()
    c = greedy(eng)
    dt = time.perf_counter() - t0
    assert c.token_ids == expect.token_ids
    assert dt < PROMPT_S, f"follow-up request took {dt:.1f} s: the previous one was not cancelled"


@pytest.fixture(scope="module")
def ref(eng):
    """The reference greedy completion of PROMPT (24 tokens)."""
    return greedy(eng)


# ---------------------------------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------------------------------


def test_repr_and_info(eng, tiny_q1, synth):
    p = synth.PRESETS["tiny"]
    i = eng.info
    assert i["architecture"] == "qwen35"
    assert i["weight_type"] == "Q1_0"
    assert i["n_layer"] == p.n_layer and i["n_embd"] == p.n_embd and i["n_vocab"] == p.n_vocab_rows
    assert i["n_ctx"] == min(p.context_length, 4096) and i["n_ctx_train"] == p.context_length
    assert i["device"].startswith("cpu")
    assert i["file_bytes"] == tiny_q1.stat().st_size
    assert i["path"] == str(tiny_q1)
    assert sorted(i["stop_ids"]) == sorted(eng.tokenize("<|im_end|><|endoftext|>"))
    r = repr(eng)
    assert r.startswith("<bonsai.Engine ") and tiny_q1.name in r
    assert "qwen35" in r and "Q1_0" in r and f"layers={p.n_layer}" in r and "n_ctx=4096" in r


def test_n_ctx_option(tiny_q1):
    e = bonsai.Engine(tiny_q1, device="cpu", n_ctx=128, threads=1)
    assert e.info["n_ctx"] == 128 and e.info["threads"] == 1
    # generation stops at the end of the context with "length"
    prompt = list(range(10, 110))
    c = e.complete(prompt, max_tokens=1000, temperature=0, ignore_eos=True)
    assert c.finish_reason == "length"
    # every position fed to the model fits the context (the last sampled token is never fed back)
    assert c.usage["prompt_tokens"] == 100
    assert 128 - 100 <= c.usage["completion_tokens"] <= 128 - 100 + 1
    assert len(c.token_ids) == c.usage["completion_tokens"]
    # the longest prompt that fits still generates
    c = e.complete(list(range(10, 137)), max_tokens=10, temperature=0, ignore_eos=True)
    assert c.finish_reason == "length" and 1 <= len(c.token_ids) <= 2


@pytest.mark.parametrize("entries", [4, 0])
def test_prompt_cache_resumes_and_equals_fresh(tiny_q1, entries):
    """A prompt that extends a cached one resumes at that prompt's last 64-token boundary (the CPU
    backend's prefill granule; 512-token prefill chunks) and gives the tokens and logprobs of a fresh
    prefill (the engine without a cache). With stashed lineages (``prompt_cache_entries`` 4) a
    conversation the last prompt replaced is resumed from the stash; with 0 only the live one is.
    The expected lengths follow the rules of the engine's ``PromptCache`` (its last chunk start and
    last 64-token boundary of each prompt, the shared-prefix boundary of a fresh prefill)."""
    cached = bonsai.Engine(tiny_q1, device="cpu", prompt_cache_entries=entries)
    fresh = bonsai.Engine(tiny_q1, device="cpu", prompt_cache=False)
    stash = entries > 0
    n_vocab = cached.info["n_vocab"]
    first = [(i * 7919 + 11) % n_vocab for i in range(700)]
    turn = first + [(i * 104729 + 5) % n_vocab for i in range(120)]
    steps = [(first, 0), (turn, 640), (first, 512), (turn[:512], 0), (turn, 768 if stash else 448)]
    for prompt, want_cached in steps:
        got = cached.complete(prompt, max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
        want = fresh.complete(prompt, max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
        assert got.usage["cached_tokens"] == want_cached, (len(prompt), got.usage)
        assert want.usage["cached_tokens"] == 0
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs  # the same bits: the resumed state is exact
    # three users of one 600-token system prompt: without the stash the second saves the system
    # prompt's last 64-token boundary (576) for the third
    system = first[:600]
    users = [system + [(i * 31 + 7 * u) % n_vocab for i in range(600)] for u in (1, 2, 3)]
    steps = [
        ([5, 6, 7], 0),  # short: the live lineage is emptied (and stashed)
        (users[0], 512 if stash else 0),  # a stashed first[:512]
        (users[1], 512 if stash else 0),
        (users[2], 512 if stash else 576),
        (users[1], 1152 if stash else 576),  # its own last 64-token boundary, from the stash
    ]
    for prompt, want_cached in steps:
        got = cached.complete(prompt, max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
        want = fresh.complete(prompt, max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
        assert got.usage["cached_tokens"] == want_cached, got.usage
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    with pytest.raises(bonsai.InvalidRequestError, match="prompt_cache"):
        bonsai.Engine(tiny_q1, device="cpu", prompt_cache="yes")
    with pytest.raises(bonsai.InvalidRequestError, match="prompt_cache_entries"):
        bonsai.Engine(tiny_q1, device="cpu", prompt_cache_entries=-1)
    with pytest.raises(bonsai.InvalidRequestError, match="prefill_chunk"):
        bonsai.Engine(tiny_q1, device="cpu", prefill_chunk=0)


def test_prefill_chunk_sets_the_prompt_cache_boundaries(tiny_q1):
    """``prefill_chunk`` 128: a chat turn resumes at its previous prompt's last 64-token boundary
    (300 tokens: 256), with the tokens and logprobs of a fresh prefill on 128-token chunks."""
    cached = bonsai.Engine(tiny_q1, device="cpu", prefill_chunk=128)
    fresh = bonsai.Engine(tiny_q1, device="cpu", prefill_chunk=128, prompt_cache=False)
    n_vocab = cached.info["n_vocab"]
    first = [(i * 7919 + 11) % n_vocab for i in range(300)]
    turn = first + [(i * 104729 + 5) % n_vocab for i in range(50)]
    for prompt, want_cached in ((first, 0), (turn, 256)):
        got = cached.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
        want = fresh.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
        assert got.usage["cached_tokens"] == want_cached, got.usage
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)


@pytest.mark.parametrize("variant,wtype", [("q2", "Q2"), ("pq2", "PQ2")])
def test_ternary_models_generate(synth_model, variant, wtype):
    e = bonsai.Engine(synth_model("tiny", variant), device="cpu")
    assert e.info["weight_type"].startswith(wtype)
    c = e.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert len(c.token_ids) == 8 and c.finish_reason == "length"
    assert all(0 <= t < e.info["n_vocab"] for t in c.token_ids)


def test_generate_streams_one_chunk_per_token(eng):
    chunks = list(eng.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
    final = chunks[-1]
    assert final.finish_reason == "length"
    assert final.token_ids == [] and final.token_id is None and final.text == ""
    u = final.usage
    assert u["prompt_tokens"] == len(eng.tokenize(PROMPT))
    assert u["completion_tokens"] == 12
    for k in ("prefill_seconds", "decode_seconds", "ttft_seconds"):
        assert u[k] >= 0.0
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    tok = [c for c in chunks if c.token_ids]
    assert len(tok) == 12
    for c in tok:
        assert isinstance(c.text, str)
        assert len(c.token_ids) == 1 and c.token_id == c.token_ids[0]
        assert len(c.logprobs) == 1 and c.logprobs[0] <= 0.0
        assert len(c.top_logprobs) == 1 and len(c.top_logprobs[0]) == 2
    # chunks without a token (released held-back text) come only at the end, before the final one
    first_textonly = next((i for i, c in enumerate(chunks) if not c.token_ids), len(chunks))
    assert all(not c.token_ids for c in chunks[first_textonly:])


def test_complete_collects_the_stream(eng):
    chunks = list(eng.generate(PROMPT, max_tokens=16, temperature=0))
    c = greedy(eng, n=16)
    assert c.text == "".join(x.text for x in chunks)
    assert c.token_ids == [t for x in chunks for t in x.token_ids]
    assert c.logprobs == [lp for x in chunks for lp in x.logprobs]
    assert c.finish_reason == chunks[-1].finish_reason
    assert c.usage["completion_tokens"] == chunks[-1].usage["completion_tokens"]


def test_prompt_as_ids_equals_prompt_as_text(eng, ref):
    c = eng.complete(eng.tokenize(PROMPT), max_tokens=24, temperature=0)
    assert c.token_ids == ref.token_ids and c.text == ref.text
    c = eng.complete(tuple(eng.tokenize(PROMPT)), max_tokens=24, temperature=0)
    assert c.token_ids == ref.token_ids


def test_greedy_reproducible(eng, ref):
    outs = {tuple(greedy(eng).token_ids) for _ in range(10)}
    assert outs == {tuple(ref.token_ids)}
    assert len(ref.token_ids) == 24


def test_greedy_ignores_seed_and_top_k(eng, ref):
    for seed in (0, 1, 12345):
        assert greedy(eng, seed=seed, top_k=5, top_p=0.5).token_ids == ref.token_ids


def test_seeded_sampling(eng):
    def run(seed):
        return eng.complete(PROMPT, max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, seed=seed).token_ids

    a = run(7)
    assert a == run(7) == run(7)
    others = [run(s) for s in range(8)]
    assert len({tuple(o) for o in others}) >= 2, "different seeds must give different samples"
    assert any(o != a for o in others)


def test_unseeded_sampling_varies(eng):
    outs = {tuple(eng.complete(PROMPT, max_tokens=24, temperature=1.0, top_k=0).token_ids) for _ in range(6)}
    assert len(outs) >= 2


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def test_logprobs_greedy_match_logits(eng):
    ids = eng.tokenize(PROMPT)
    ch = next(iter(eng.generate(ids, max_tokens=1, temperature=0, logprobs=5)))
    ls = log_softmax(eng.logits(ids)[-1])
    order = np.argsort(-ls)[:5]
    top = ch.top_logprobs[0]
    assert len(top) == 5
    assert [t for t, _ in top] == [int(i) for i in order]
    for (_, lp), i in zip(top, order, strict=True):
        assert abs(lp - ls[i]) < 1e-3
    # greedy: the chosen token is the top-1 alternative, with the same logprob
    assert ch.token_id == top[0][0]
    assert ch.logprobs[0] == pytest.approx(top[0][1], abs=1e-6)


def test_logprobs_sampled_consistent(eng):
    seen_in_top = 0
    chunks = [c for c in eng.generate(PROMPT, max_tokens=30, temperature=1.0, seed=3, logprobs=5) if c.token_ids]
    assert chunks
    for c in chunks:
        top = c.top_logprobs[0]
        assert len(top) == 5
        lps = [lp for _, lp in top]
        assert lps == sorted(lps, reverse=True)
        assert all(lp <= 1e-6 for lp in lps)
        assert sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-4
        assert len({t for t, _ in top}) == 5
        d = dict(top)
        if c.token_id in d:
            seen_in_top += 1
            assert c.logprobs[0] == pytest.approx(d[c.token_id], abs=1e-5)
        else:
            assert c.logprobs[0] <= lps[-1] + 1e-5
    assert seen_in_top > 0


def test_logprobs_zero_gives_no_alternatives(eng):
    for c in eng.generate(PROMPT, max_tokens=4, temperature=0):
        if c.token_ids:
            assert c.top_logprobs == [[]]


def test_max_tokens_gives_length(eng, ref):
    for n in (1, 5, 17):
        c = greedy(eng, n=n)
        assert c.finish_reason == "length"
        assert len(c.token_ids) == n == c.usage["completion_tokens"]
        assert c.token_ids == ref.token_ids[:n]


def _stop_candidate(text: str):
    """A 2-character stop string (no U+FFFD) whose first occurrence is at index p > 0."""
    for p in range(1, len(text) - 2):
        s = text[p : p + 2]
        if "\ufffd" in s or text.find(s) != p:
            continue
        return s, p
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string(eng):
    full = greedy(eng, n=40, ignore_eos=True)
    stop, p = _stop_candidate(full.text[len(full.text) // 3 :])
    p = full.text.find(stop)
    c = greedy(eng, n=40, ignore_eos=True, stop=stop)
    assert c.finish_reason == "stop"
    assert c.text == full.text[:p]
    assert stop not in c.text
    assert c.token_ids == full.token_ids[: len(c.token_ids)]
    # the token completing the stop string is generated (and counted) but its text is held back
    assert stop in eng.detokenize(c.token_ids)
    assert stop not in eng.detokenize(c.token_ids[:-1])
    # several stops: the earliest occurrence wins
    c2 = greedy(eng, n=40, ignore_eos=True, stop=["\x00never", stop])
    assert c2.text == c.text and c2.finish_reason == "stop"


def test_stop_string_not_present_runs_to_length(eng, ref):
    c = greedy(eng, stop=["\x00\x01"])
    assert c.finish_reason == "length" and c.text == ref.text and c.token_ids == ref.token_ids


def test_stop_token_ids(eng):
    full = greedy(eng, n=24, ignore_eos=True)
    k = 5
    target = full.token_ids[k]
    first = full.token_ids.index(target)
    c = greedy(eng, n=24, ignore_eos=True, stop_token_ids=[target])
    assert c.finish_reason == "stop"
    assert c.token_ids == full.token_ids[:first]
    assert c.usage["completion_tokens"] == first + 1  # the stop token was sampled
    assert c.text == eng.detokenize(full.token_ids[:first])


def test_eos_and_ignore_eos(eng):
    eos = eng.info["stop_ids"][0]
    bias = {eos: 100.0}
    c = eng.complete(PROMPT, max_tokens=6, logit_bias=bias, seed=1)
    assert c.finish_reason == "stop" and c.token_ids == [] and c.text == ""
    assert c.usage["completion_tokens"] == 1
    c = eng.complete(PROMPT, max_tokens=6, logit_bias=bias, seed=1, ignore_eos=True)
    assert c.finish_reason == "length" and c.token_ids == [eos] * 6
    # every model stop id (<|im_end|>, <|endoftext|>) ends the generation
    for sid in eng.info["stop_ids"]:
        c = eng.complete(PROMPT, max_tokens=6, logit_bias={sid: 100.0}, temperature=0)
        assert c.finish_reason == "stop" and c.token_ids == []


def test_logit_bias_forbids_token(eng, ref):
    t = ref.token_ids[0]
    c = greedy(eng, n=4, logit_bias={t: -math.inf})
    assert c.token_ids[0] != t


# ---------------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------------

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_chat_template_generation_prompt(eng):
    on = eng.apply_chat_template(MSGS, enable_thinking=True)
    off = eng.apply_chat_template(MSGS, enable_thinking=False)
    assert on.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n")
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert eng.apply_chat_template(MSGS) == on  # thinking is on by default
    assert eng.apply_chat_template(MSGS, chat_template_kwargs={"enable_thinking": False}) == off
    no_gen = eng.apply_chat_template(MSGS, add_generation_prompt=False)
    assert no_gen.endswith("Hi there<|im_end|>\n") and "assistant" not in no_gen


def test_chat_uses_the_template(eng):
    for think in (True, False):
        prompt = eng.apply_chat_template(MSGS, enable_thinking=think)
        chunks = list(eng.chat(MSGS, enable_thinking=think, max_tokens=10, temperature=0))
        ref = greedy(eng, prompt, n=10)
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        assert chunks[-1].usage["prompt_tokens"] == len(eng.tokenize(prompt))
    # the special tokens of the template are single tokens
    ids = eng.tokenize(eng.apply_chat_template(MSGS))
    im_start = eng.tokenize("<|im_start|>")
    assert len(im_start) == 1 and ids.count(im_start[0]) == 3


# ---------------------------------------------------------------------------------------------------
# tokens and UTF-8
# ---------------------------------------------------------------------------------------------------

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces\nand\ttabs\n\n",
    "数字 123 と 日本語のテキスト",
    "emoji 🌳🌲 and accents: café, naïve, Ελληνικά, русский",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_roundtrip(eng, text):
    ids = eng.tokenize(text)
    assert all(isinstance(t, int) and 0 <= t < eng.info["n_vocab"] for t in ids)
    assert eng.detokenize(ids) == text
    assert eng.detokenize(eng.tokenize(text, special=False)) == text
    assert b"".join(eng.token_bytes(t) for t in ids) == text.encode("utf-8")


def test_special_parsing(eng):
    s = "<|im_start|>"
    assert len(eng.tokenize(s, special=True)) == 1
    assert len(eng.tokenize(s, special=False)) > 1


def test_stream_text_is_valid_utf8(eng):
    """Every chunk is a valid str and the concatenation equals the detokenized ids, over many sampled
    runs (random weights produce plenty of partial multi-byte tokens)."""
    held_back = 0
    for seed in range(40):
        chunks = list(eng.generate(PROMPT, max_tokens=40, temperature=1.0, top_k=0, seed=seed, ignore_eos=True))
        ids = [t for c in chunks for t in c.token_ids]
        for c in chunks:
            assert isinstance(c.text, str)
            c.text.encode("utf-8")  # no lone surrogates
            if c.token_ids and c.text == "":
                held_back += 1
        assert "".join(c.text for c in chunks) == eng.detokenize(ids)
    assert held_back > 0, "expected some tokens whose text is held back (partial UTF-8)"


def test_partial_utf8_is_held_back(eng):
    """A token that is only the lead byte of a multi-byte character streams as "" (held back); at the
    end of the generation the incomplete bytes are released in a text-only chunk."""
    raw = "狐".encode()
    lead = next(t for t in range(eng.info["n_vocab"]) if eng.token_bytes(t) == raw[:1])
    tail = [next(t for t in range(eng.info["n_vocab"]) if eng.token_bytes(t) == raw[i : i + 1]) for i in (1, 2)]
    assert eng.detokenize([lead, *tail]) == "狐"
    chunks = list(eng.generate(PROMPT, max_tokens=1, logit_bias={lead: 100.0}, seed=0))
    assert [c.token_ids for c in chunks] == [[lead], [], []]
    assert chunks[0].text == ""
    assert chunks[1].text == eng.detokenize([lead]) != ""
    assert chunks[2].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------
# cancellation, threads
# ---------------------------------------------------------------------------------------------------


def test_break_out_of_generate_cancels(eng, ref):
    got = []
    t0 = time.perf_counter()
    for c in eng.generate(PROMPT, **LONG):
        got += c.token_ids
        if len(got) >= 3:
            break
    assert got == ref.token_ids[:3]
    assert time.perf_counter() - t0 < PROMPT_S
    assert_quick_followup(eng, ref)


def test_close_generator_cancels(eng, ref):
    g = eng.generate(PROMPT, **LONG)
    first = next(g)
    assert first.token_id == ref.token_ids[0]
    g.close()
    with pytest.raises(StopIteration):
        next(g)
    assert_quick_followup(eng, ref)


def test_dropped_stream_cancels(eng, ref):
    g = eng.generate(PROMPT, **LONG)  # never consumed
    del g
    g = eng.generate(PROMPT, **LONG)
    next(g)  # started, then dropped
    del g
    assert_quick_followup(eng, ref)


def test_raw_stream_cancel_reports_cancelled(eng):
    stream = eng._submit(PROMPT, **LONG)
    n = 0
    for ev in stream:
        if ev[0] == "token":
            n += 1
            if n == 3:
                stream.cancel()
        if ev[0] == "done":
            assert ev[1] == "cancelled"
            assert 3 <= ev[2]["completion_tokens"] < LONG["max_tokens"]
            break
    else:
        pytest.fail("no done event")
    assert stream.finished
    stream.cancel()  # idempotent
    assert list(stream) == []


def test_concurrent_threads(eng):
    prompts = ["Hello world", "The quick brown fox", "数字と日本語", "import numpy as np"]
    serial = [eng.complete(p, max_tokens=20, temperature=0, ignore_eos=True) for p in prompts]
    results: list = [None] * len(prompts)
    errors: list = []

    def work(i):
        try:
            results[i] = eng.complete(prompts[i], max_tokens=20, temperature=0, ignore_eos=True)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    for r, s in zip(results, serial, strict=True):
        assert r.token_ids == s.token_ids and r.text == s.text and r.finish_reason == "length"


def test_interleaved_streams_in_one_thread(eng, ref):
    """Two generators consumed alternately: requests run one after another, outputs are not mixed."""
    g1 = eng.generate(PROMPT, max_tokens=24, temperature=0)
    g2 = eng.generate(PROMPT, max_tokens=24, temperature=0)
    a, b = [], []
    for c1, c2 in zip(g1, g2, strict=False):
        a += c1.token_ids
        b += c2.token_ids
    a += [t for c in g1 for t in c.token_ids]
    b += [t for c in g2 for t in c.token_ids]
    assert a == ref.token_ids and b == ref.token_ids


# ---------------------------------------------------------------------------------------------------
# asyncio
# ---------------------------------------------------------------------------------------------------


async def _collect(agen):
    out = []
    async for c in agen:
        out.append(c)
    return out


def test_agenerate_matches_generate(eng, ref):
    chunks = asyncio.run(_collect(eng.agenerate(PROMPT, max_tokens=24, temperature=0, logprobs=3)))
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert chunks[-1].finish_reason == ref.finish_reason
    assert chunks[-1].usage["completion_tokens"] == 24
    assert all(len(c.top_logprobs[0]) == 3 for c in chunks if c.token_ids)


def test_achat_matches_chat(eng):
    sync = [t for c in eng.chat(MSGS, enable_thinking=False, max_tokens=12, temperature=0) for t in c.token_ids]
    chunks = asyncio.run(_collect(eng.achat(MSGS, enable_thinking=False, max_tokens=12, temperature=0)))
    assert [t for c in chunks for t in c.token_ids] == sync
    assert chunks[-1].usage["prompt_tokens"] == len(eng.tokenize(eng.apply_chat_template(MSGS, enable_thinking=False)))


def test_async_cancel(eng, ref):
    async def main():
        got = []

        async def consume():
            async for c in eng.agenerate(PROMPT, **LONG):
                got.extend(c.token_ids)

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(consume(), timeout=0.3)
        assert 0 < len(got) < LONG["max_tokens"]
        t0 = time.perf_counter()
        nxt = await _collect(eng.agenerate(PROMPT, max_tokens=24, temperature=0))
        return got, nxt, time.perf_counter() - t0

    got, nxt, dt = asyncio.run(main())
    n = min(len(got), len(ref.token_ids))
    assert got[:n] == ref.token_ids[:n]
    assert [t for c in nxt for t in c.token_ids] == ref.token_ids
    assert dt < PROMPT_S


def test_async_concurrent_tasks(eng, ref):
    async def main():
        return await asyncio.gather(*[_collect(eng.agenerate(PROMPT, max_tokens=24, temperature=0)) for _ in range(3)])

    for chunks in asyncio.run(main()):
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids


# ---------------------------------------------------------------------------------------------------
# the typed stub of the compiled module
# ---------------------------------------------------------------------------------------------------


def _sig_params(sig: str) -> list[str]:
    """Parameter names of a compiled ``__text_signature__`` like ``($self, text, special=True)``."""
    out = []
    for part in sig.strip("()").split(","):
        name = part.strip().split("=")[0]
        if name and name != "/":
            out.append("self" if name == "$self" else name)
    return out


def test_stub_matches_compiled_module():
    import ast
    from pathlib import Path

    from bonsai import _bonsai

    tree = ast.parse((Path(bonsai.__file__).parent / "_bonsai.pyi").read_text())
    top = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            top[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top[node.target.id] = node
    # every public name of the module is in the stub (type aliases are stub-only extras)
    public = {n for n in dir(_bonsai) if not n.startswith("_")} | {"__version__"}
    assert public <= set(top), f"missing in stub: {public - set(top)}"
    for name in set(top) - public - {"__all__"}:
        assert not isinstance(top[name], ast.FunctionDef) and not name.endswith("Error"), name
    # methods: the same set, with the same parameter names
    for cls in ("RawEngine", "Stream"):
        real_cls = getattr(_bonsai, cls)
        methods = {n.name: n for n in top[cls].body if isinstance(n, ast.FunctionDef)}
        real = {n for n in dir(real_cls) if not n.startswith("_")} | {"__iter__", "__next__"} & set(dir(real_cls))
        assert {n for n in methods if not n.startswith("_") or n in ("__iter__", "__next__")} == real, cls
        for name, node in methods.items():
            sig = getattr(getattr(real_cls, name), "__text_signature__", None)
            if name.startswith("_") or sig is None:  # dunders, properties
                continue
            assert [a.arg for a in node.args.args] == _sig_params(sig), (cls, name)
    new = next(n for n in top["RawEngine"].body if isinstance(n, ast.FunctionDef) and n.name == "__new__")
    assert [a.arg for a in new.args.args][1:] == _sig_params(_bonsai.RawEngine.__text_signature__)
    assert [a.arg for a in top["inspect"].args.args] == _sig_params(_bonsai.inspect.__text_signature__)
    # the exception hierarchy in the stub is the real one
    for name, node in top.items():
        if name.endswith("Error"):
            assert getattr(_bonsai, name).__bases__[0].__name__ == node.bases[0].id, name
