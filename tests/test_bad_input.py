"""Bad input gives clear ``bonsai`` exceptions (never a crash, never a bare TypeError/OverflowError from the
binding), and the engine keeps serving afterwards."""

from __future__ import annotations

import math
import os

import pytest

import bonsai
from bonsai import (
    BackendUnavailableError,
    BonsaiError,
    ContextOverflowError,
    EngineError,
    InvalidRequestError,
    ModelError,
)

N_CTX = 64
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def eng(tiny_q1):
    return bonsai.Engine(tiny_q1, device="cpu", n_ctx=N_CTX)


@pytest.fixture(scope="module")
def ref(eng):
    return eng.complete(PROMPT, max_tokens=12, temperature=0)


def still_works(eng, ref):
    c = eng.complete(PROMPT, max_tokens=12, temperature=0)
    assert c.token_ids == ref.token_ids and c.text == ref.text and c.finish_reason == ref.finish_reason


def test_exception_hierarchy():
    for e in (ModelError, InvalidRequestError, BackendUnavailableError, EngineError):
        assert issubclass(e, BonsaiError)
    assert issubclass(ContextOverflowError, InvalidRequestError)
    assert issubclass(BonsaiError, Exception)
    assert bonsai.BonsaiError is BonsaiError


# ---------------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [N_CTX, N_CTX + 1, 500])
def test_prompt_too_long(eng, ref, n):
    ids = [(7 * i) % 1000 + 10 for i in range(n)]
    with pytest.raises(ContextOverflowError) as ei:
        eng.generate(ids)
    msg = str(ei.value)
    assert str(n) in msg and str(N_CTX) in msg
    still_works(eng, ref)


def test_prompt_too_long_text(eng, ref):
    text = "hello " * 200
    n = len(eng.tokenize(text))
    with pytest.raises(ContextOverflowError, match=rf"\b{n}\b.*\b{N_CTX}\b"):
        eng.complete(text)
    with pytest.raises(ContextOverflowError):
        eng.chat([{"role": "user", "content": text}])
    still_works(eng, ref)


def test_longest_prompt_that_fits(eng):
    c = eng.complete(list(range(10, 10 + N_CTX - 1)), max_tokens=5, temperature=0, ignore_eos=True)
    assert c.finish_reason == "length" and len(c.token_ids) >= 1


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(eng, ref, prompt):
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.generate(prompt)
    still_works(eng, ref)


@pytest.mark.parametrize("prompt", [None, 5, 3.5, [1.0, 2.0], ["a"], [True, 2], {"a": 1}, b"bytes"])
def test_bad_prompt_type(eng, ref, prompt):
    with pytest.raises(InvalidRequestError, match="prompt"):
        eng.generate(prompt)
    still_works(eng, ref)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"temperature": -1.0}, ["temperature", "-1"]),
        ({"temperature": -1e-9}, ["temperature"]),
        ({"temperature": math.nan}, ["temperature", "NaN"]),
        ({"temperature": math.inf}, ["temperature", "inf"]),
        ({"temperature": "hot"}, ["temperature"]),
        ({"temperature": True}, ["temperature"]),
        ({"top_p": 0}, ["top_p", "0"]),
        ({"top_p": 0.0}, ["top_p"]),
        ({"top_p": 1.5}, ["top_p", "1.5"]),
        ({"top_p": -0.5}, ["top_p"]),
        ({"top_p": math.nan}, ["top_p", "NaN"]),
        ({"min_p": -0.1}, ["min_p"]),
        ({"min_p": 1.5}, ["min_p"]),
        ({"min_p": math.nan}, ["min_p"]),
        ({"logprobs": 21}, ["logprobs", "21"]),
        ({"logprobs": -1}, ["logprobs"]),
        ({"logprobs": 2.0}, ["logprobs"]),
        ({"logprobs": 2**70}, ["logprobs"]),
        ({"top_k": -1}, ["top_k", "-1"]),
        ({"top_k": 2.5}, ["top_k"]),
        ({"top_k": 2**70}, ["top_k"]),
        ({"max_tokens": 0}, ["max_tokens", "0"]),
        ({"max_tokens": -5}, ["max_tokens"]),
        ({"max_tokens": 1.5}, ["max_tokens"]),
        ({"max_tokens": True}, ["max_tokens"]),
        ({"max_tokens": 2**70}, ["max_tokens"]),
        ({"seed": "abc"}, ["seed"]),
        ({"seed": 1.5}, ["seed"]),
        ({"seed": -1}, ["seed"]),
        ({"repetition_penalty": 0.0}, ["repetition_penalty"]),
        ({"repetition_penalty": math.nan}, ["repetition_penalty"]),
        ({"penalty_last_n": -1}, ["penalty_last_n"]),
        ({"penalty_last_n": 2**70}, ["penalty_last_n"]),
        ({"presence_penalty": math.nan}, ["presence_penalty"]),
        ({"frequency_penalty": "x"}, ["frequency_penalty"]),
        ({"logit_bias": {5000: 1.0}}, ["logit_bias", "5000"]),
        ({"logit_bias": {-1: 1.0}}, ["logit_bias", "-1"]),
        ({"logit_bias": {1: math.nan}}, ["logit_bias"]),
        ({"logit_bias": {"a": 1.0}}, ["logit_bias"]),
        ({"logit_bias": [1, 2]}, ["logit_bias"]),
        ({"stop": ""}, ["stop"]),
        ({"stop": ["ok", ""]}, ["stop"]),
        ({"stop": 5}, ["stop"]),
        ({"stop": ["a", 5]}, ["stop"]),
        ({"stop_token_ids": [-1]}, ["stop_token_ids", "-1"]),
        ({"stop_token_ids": [99999]}, ["stop_token_ids", "99999"]),
        ({"stop_token_ids": [1.5]}, ["stop_token_ids"]),
        ({"stop_token_ids": "ab"}, ["stop_token_ids"]),
    ],
)
def test_invalid_sampling_values(eng, ref, kw, words):
    with pytest.raises(InvalidRequestError) as ei:
        eng.generate(PROMPT, **kw)
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"{kw}: {msg!r} should mention {w!r}"
    # the same check guards every entry point
    with pytest.raises(InvalidRequestError):
        eng.complete(PROMPT, **kw)
    with pytest.raises(InvalidRequestError):
        eng.chat([{"role": "user", "content": "hi"}], **kw)
    still_works(eng, ref)


def test_async_invalid_request_raises(eng, ref):
    import asyncio

    async def main():
        async for _ in eng.agenerate(PROMPT, temperature=-1):
            pass

    with pytest.raises(InvalidRequestError, match="temperature"):
        asyncio.run(main())
    still_works(eng, ref)


def test_boundary_values_accepted(eng):
    """The edges of each valid range are accepted."""
    for kw in (
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"logprobs": 20},
        {"logprobs": 0},
        {"top_k": 0},
        {"top_k": 10**6},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"seed": 2**80},
        {"max_tokens": 1},
        {"logit_bias": {0: -math.inf}},
        {"stop_token_ids": [0]},
        {"stop": []},
    ):
        c = eng.complete(
            PROMPT, max_tokens=kw.get("max_tokens", 2), **{k: v for k, v in kw.items() if k != "max_tokens"}
        )
        assert c.finish_reason in ("length", "stop"), kw


@pytest.mark.parametrize("bad", [1536, 99999, -1, 2**32, 2**40])
def test_token_id_out_of_range(eng, ref, bad):
    with pytest.raises(InvalidRequestError, match=rf"{bad}.*1536"):
        eng.generate([10, bad, 11])
    still_works(eng, ref)


def test_detokenize_bad_ids(eng):
    with pytest.raises(InvalidRequestError):
        eng.detokenize([-1])
    with pytest.raises(InvalidRequestError):
        eng.detokenize(["a"])


@pytest.mark.parametrize(
    "messages,words",
    [
        ([{"content": "no role"}], ["role"]),
        ("just a string", ["role"]),
        ([{"role": "user", "content": 5}], ["content"]),
    ],
)
def test_bad_chat_messages(eng, ref, messages, words):
    with pytest.raises(InvalidRequestError) as ei:
        eng.apply_chat_template(messages)
    for w in words:
        assert w in str(ei.value)
    still_works(eng, ref)


def test_logits_bad_input(eng, ref):
    with pytest.raises(InvalidRequestError):
        eng.logits([])
    with pytest.raises(InvalidRequestError, match="99999"):
        eng.logits([99999])
    with pytest.raises(ContextOverflowError):
        eng.logits(list(range(10, 10 + N_CTX + 1)))
    still_works(eng, ref)


# ---------------------------------------------------------------------------------------------------
# model files and options
# ---------------------------------------------------------------------------------------------------


def test_drafter_as_target(synth, tmp_path, eng, ref):
    d = synth.make_drafter(tmp_path / "d.gguf", "tiny", "q1", seed=0, progress=False)
    with pytest.raises(ModelError) as ei:
        bonsai.Engine(d, device="cpu")
    msg = str(ei.value)
    assert "drafter" in msg.lower() and "dspark" in msg
    still_works(eng, ref)


def test_random_bytes_file(tmp_path, eng, ref):
    p = tmp_path / "random.gguf"
    p.write_bytes(os.urandom(8192))
    with pytest.raises(ModelError, match="magic") as ei:
        bonsai.Engine(p, device="cpu")
    assert str(p) in str(ei.value)
    still_works(eng, ref)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelError, match="truncated"):
        bonsai.Engine(p, device="cpu")


@pytest.mark.parametrize("frac", [0.0005, 0.01, 0.1, 0.5, 0.9, 0.9999])
def test_truncated_file(tiny_q1, tmp_path, eng, ref, frac):
    data = tiny_q1.read_bytes()
    n = max(8, int(len(data) * frac))
    p = tmp_path / f"trunc-{n}.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(ModelError) as ei:
        bonsai.Engine(p, device="cpu")
    msg = str(ei.value)
    assert str(p) in msg
    assert any(w in msg for w in ("truncated", "past the end", "absurd")), msg
    still_works(eng, ref)


def test_corrupt_metadata(tiny_q1, tmp_path, eng, ref):
    """A valid container with a wrong hyperparameter is refused with the key named."""
    data = bytearray(tiny_q1.read_bytes())
    key = b"qwen35.embedding_length"
    i = data.index(key) + len(key)
    # value type u32 (4) followed by the value: 256 -> 320
    assert int.from_bytes(data[i : i + 4], "little") == 4
    assert int.from_bytes(data[i + 4 : i + 8], "little") == 256
    data[i + 4 : i + 8] = (320).to_bytes(4, "little")
    p = tmp_path / "bad-embd.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelError) as ei:
        bonsai.Engine(p, device="cpu")
    assert "token_embd" in str(ei.value) or "embedding_length" in str(ei.value)
    still_works(eng, ref)


def test_nonexistent_path(tmp_path, eng, ref):
    p = tmp_path / "does-not-exist.gguf"
    with pytest.raises(ModelError) as ei:
        bonsai.Engine(p, device="cpu")
    msg = str(ei.value)
    assert str(p) in msg and "No such file" in msg
    still_works(eng, ref)


def test_directory_as_model(tmp_path):
    with pytest.raises(ModelError) as ei:
        bonsai.Engine(tmp_path, device="cpu")
    assert str(tmp_path) in str(ei.value)


def test_device_cuda_unavailable(tiny_q1, eng, ref):
    with pytest.raises(BackendUnavailableError, match="cuda|CUDA"):
        bonsai.Engine(tiny_q1, device="cuda")
    still_works(eng, ref)


@pytest.mark.parametrize("device", ["tpu", "", "CPU0", "gpu"])
def test_unknown_device(tiny_q1, eng, ref, device):
    with pytest.raises(InvalidRequestError) as ei:
        bonsai.Engine(tiny_q1, device=device)
    msg = str(ei.value)
    assert "device" in msg and "cpu" in msg
    still_works(eng, ref)


@pytest.mark.parametrize(
    "kw,word",
    [
        ({"device": None}, "device"),
        ({"device": 0}, "device"),
        ({"n_ctx": 0}, "n_ctx"),
        ({"n_ctx": -5}, "n_ctx"),
        ({"n_ctx": 1}, "n_ctx"),
        ({"n_ctx": 10**7}, "n_ctx"),
        ({"n_ctx": 64.0}, "n_ctx"),
        ({"threads": 0}, "threads"),
        ({"threads": True}, "threads"),
    ],
)
def test_bad_engine_options(tiny_q1, eng, ref, kw, word):
    with pytest.raises(InvalidRequestError, match=word):
        bonsai.Engine(tiny_q1, **kw)
    still_works(eng, ref)


def test_engine_survives_everything(eng, ref, tiny_q1):
    """A burst of mixed bad requests interleaved with good ones: every good one is still exact."""
    bad = [
        lambda: eng.generate(""),
        lambda: eng.generate([1536]),
        lambda: eng.generate(PROMPT, temperature=-1),
        lambda: eng.generate(list(range(10, 10 + N_CTX))),
        lambda: bonsai.Engine(tiny_q1, device="cuda"),
    ]
    for _ in range(3):
        for f in bad:
            with pytest.raises(BonsaiError):
                f()
            still_works(eng, ref)


def _mutations(data: bytes, header_end: int, count: int, seed: int):
    """Seeded damage to a file's header (metadata, tensor table): flipped bytes, 8-byte fields set to
    extreme integers, zeroed runs, truncation."""
    import random
    import struct

    rng = random.Random(seed)
    for _ in range(count):
        b = bytearray(data)
        kind = rng.choice(["flip", "flip", "u64", "zero", "trunc"])
        if kind == "flip":
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(header_end)] = rng.randrange(256)
        elif kind == "u64":
            o = rng.randrange(header_end - 8)
            v = rng.choice([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, rng.randrange(2**64)])
            b[o : o + 8] = struct.pack("<Q", v)
        elif kind == "zero":
            o = rng.randrange(header_end - 16)
            b[o : o + 16] = bytes(16)
        else:
            b = b[: rng.randrange(len(b))]
        yield kind, bytes(b)


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_damaged_headers_load_or_refuse(which, synth, tiny_q1, tmp_path, eng, ref):
    """Every damaged header either loads and generates or is refused with a ``bonsai`` error: no
    panic (a ``BaseException`` that ``except BonsaiError`` does not catch), crash or hang. (The
    same mutations run 1,550 times out of process on the 2026-12-07 session found none either.)"""
    from bonsai import gguf_io

    if which == "target":
        src = tiny_q1
    else:
        src = synth.make_drafter(tmp_path / "d.gguf", "tiny", "q1", seed=0, progress=False)
    data = src.read_bytes()
    header_end = gguf_io.read_gguf(src).data_start
    outcomes = {"loaded": 0, "refused": 0}
    for i, (kind, b) in enumerate(_mutations(data, header_end, 40, seed=7 if which == "target" else 8)):
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(b)
        try:
            if which == "target":
                e = bonsai.Engine(p, device="cpu", threads=1)
            else:
                e = bonsai.Engine(tiny_q1, device="cpu", threads=1, draft=p, speculative="always")
            e.complete([1, 2, 3, 4], max_tokens=3, temperature=0, ignore_eos=True)
            outcomes["loaded"] += 1
        except BonsaiError as err:
            assert str(err), f"mutation {i} ({kind}): an empty message"
            outcomes["refused"] += 1
        p.unlink()
    assert outcomes["refused"] > 0, outcomes
    still_works(eng, ref)
