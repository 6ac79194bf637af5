"""The Vulkan backend end to end against the exact NumPy reference (tests/reference.py).

Its low-bit mat-vecs take f32 or int8 activations (`BONSAI_VK_ACT`; by default int8 where the driver
accelerates packed int8 dot products, as NVIDIA's does, f32 elsewhere, lavapipe included); both are
tested here. With f32 activations (no int8 rounding before the low-bit dot products) Vulkan must sit
far closer to the exact forward than the CPU engine and llama.cpp do. Measured on lavapipe: NMSE ≈ 6e-9
against the exact reference, where Q8_0 activation rounding alone costs ≈ 1e-3. Bounds:
- NMSE(vulkan, exact) ≤ 1e-3 · NMSE(ref_q8, exact): at most a thousandth of the int8 rounding noise
  (what remains: the f16 KV cache and f32 summation order);
- every argmax equal to the exact reference's unless its top-1 leads by less than τ/100
  (τ = the q8 near-tie threshold of `reference.tie_threshold`);
- chunked prefill equals token-by-token decode bit for bit (every shader computes a row the same way
  whatever the row count).
With int8 activations (the CPU engine's quantization and float order) the bounds are the CPU engine's
in test_oracle.py: NMSE(vulkan, exact) ≤ 4 · NMSE(ref_q8, exact), every argmax within τ.

These run on any Vulkan 1.2 device with bufferDeviceAddress; `make test` installs lavapipe
(mesa-vulkan-drivers) where there is no GPU. Without a Vulkan device they fail, saying so.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import reference as R
from test_reference import ref_for

VARIANTS = ["tiny_q1", "tiny_q2", "tiny_pq2", "tiny_q2g64", "small_q1"]


@functools.cache
def vk_engine(path: str, act: str = "auto"):
    """A Vulkan engine whose low-bit mat-vecs take `act` activations ("auto", "f32", "int8")."""
    import bonsai

    old = os.environ.get("BONSAI_VK_ACT")
    os.environ["BONSAI_VK_ACT"] = act  # read once, when the backend is created
    try:
        return bonsai.Engine(path, device="vulkan", n_ctx=256)
    except Exception as e:  # the message names what is missing
        pytest.fail(f"no Vulkan device (apt-get install mesa-vulkan-drivers libvulkan1, as `make test` does): {e}")
    finally:
        if old is None:
            del os.environ["BONSAI_VK_ACT"]
        else:
            os.environ["BONSAI_VK_ACT"] = old


def _ids(n_vocab: int, n: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729 + 11) % n_vocab for i in range(n)]


@pytest.mark.parametrize("act", ["f32", "int8"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_vulkan_vs_exact_reference(variant, act, request):
    path = str(request.getfixturevalue(variant))
    eng = vk_engine(path, act)
    assert eng.info["device"].startswith("vulkan"), eng.info["device"]
    assert eng.info["device"].endswith(f"{act} activations"), eng.info["device"]
    ref, ref_q8 = ref_for(path), ref_for(path, "q8_0")
    err = sim = sq = 0.0
    for seed in range(2):
        ids = _ids(ref.n_vocab, 24 + 9 * seed, seed)
        V = np.asarray(eng.logits(ids), dtype=np.float64)
        X = ref.logits(ids)
        Q = ref_q8.logits(ids)
        assert V.shape == X.shape and np.all(np.isfinite(V))
        tau = R.tie_threshold(R.q8_logit_sigma(X, Q)) / (100.0 if act == "f32" else 1.0)
        bad = R.choice_violations(V.argmax(1), X, tau)
        assert not bad, f"{variant}: Vulkan top-1 trails the exact reference's: {bad[:5]}"
        err += float(np.sum((V - X) ** 2))
        sim += float(np.sum((Q - X) ** 2))
        sq += float(np.sum(X**2))
    print(f"\n{variant} {act}: NMSE(vulkan, exact)={err / sq:.3e} NMSE(ref_q8, exact)={sim / sq:.3e}")
    if act == "f32":
        assert err / sq <= 1e-3 * sim / sq
    else:
        assert err / sq <= 4.0 * sim / sq + 1e-7


@pytest.mark.parametrize("act", ["f32", "int8"])
@pytest.mark.parametrize("variant", ["tiny_q1", "tiny_q2g64"])
def test_vulkan_chunked_equals_token_by_token(variant, act, request):
    path = str(request.getfixturevalue(variant))
    eng = vk_engine(path, act)
    ids = _ids(eng.info["n_vocab"], 30, 3)
    a = eng.logits(ids, chunked=True)
    b = eng.logits(ids, chunked=False)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_vulkan_generate_streams_and_refuses_bad_input(tiny_q1):
    eng = vk_engine(str(tiny_q1))
    out = list(eng.generate(_ids(eng.info["n_vocab"], 5, 1), max_tokens=6, temperature=0, ignore_eos=True))
    assert sum(len(c.token_ids) for c in out) == 6
    assert out[-1].finish_reason == "length"
    with pytest.raises(Exception, match="(?i)context"):
        eng.logits(list(range(10, 10 + 300)))
    # still serving after the refusal
    assert eng.logits([1, 2, 3]).shape == (3, eng.info["n_vocab"])


def test_vulkan_server_serves_concurrent_requests(tiny_q1):
    """The OpenAI-compatible server on a Vulkan engine: two concurrent greedy chat requests (one
    streamed) both answer, each equal to the engine's own completion of the same prompt."""
    import asyncio
    import json

    from aiohttp.test_utils import TestClient, TestServer

    from bonsai.server import make_app

    eng = vk_engine(str(tiny_q1))
    msgs = [{"role": "user", "content": "Tell me about trees."}]
    prompt = eng.apply_chat_template(msgs, enable_thinking=False)
    want = eng.complete(prompt, temperature=0, max_tokens=10)
    body = {"model": "tiny", "messages": msgs, "max_tokens": 10, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip

    async def main():
        async with TestClient(TestServer(make_app(eng, "tiny"))) as c:
            plain = c.post("/v1/chat/completions", json=body)
            streamed = c.post("/v1/chat/completions", json={**body, "stream": True})
            r1, r2 = await asyncio.gather(plain, streamed)
            assert r1.status == 200 and r2.status == 200
            text1 = (await r1.json())["choices"][0]["message"]["content"]
            events = [
                json.loads(b[len("data: ") :])
                for b in (await r2.text()).split("\n\n")
                if b.startswith("data: ") and b != "data: [DONE]"
            ]
            text2 = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
            return text1, text2

    text1, text2 = asyncio.run(main())
    assert text1 == want.text and text2 == want.text, (text1, text2, want.text)


@pytest.mark.parametrize("variant", ["tiny_q1", "tiny_q2g64"])
def test_vulkan_q8_0_kv_cache(variant, request):
    """``kv_cache="q8_0"`` on Vulkan: the CPU backend's q8_0 rounding of K/V (≤ 0.4 % of a block's
    max). Its logits stay within the int8 activation noise of the f16-cache logits and within 4× that
    noise of the exact reference (the bounds of test_kv_cache.py), and chunked prefill equals
    token-by-token decode bit for bit."""
    import bonsai

    path = str(request.getfixturevalue(variant))
    ids = [(i * 7919 + 5) % 256 for i in range(96)]
    f16 = vk_engine(path)
    q8 = bonsai.Engine(path, device="vulkan", n_ctx=256, kv_cache="q8_0")
    a = f16.logits(ids).astype(np.float64)
    b = q8.logits(ids).astype(np.float64)
    assert np.isfinite(b).all()
    assert not np.array_equal(a, b), "the q8_0 cache must actually be used"
    X = ref_for(path).logits(ids)
    noise = R.nmse(ref_for(path, "q8_0").logits(ids), X)
    print(
        f"\n{variant}: NMSE(q8 KV, f16 KV)={R.nmse(b, a):.3e} NMSE(q8 KV, exact)={R.nmse(b, X):.3e} noise={noise:.3e}"
    )
    assert R.nmse(b, a) <= noise
    assert R.nmse(b, X) <= 4 * noise
    c = q8.logits(ids, chunked=False)
    assert np.array_equal(b.astype(np.float32).view(np.uint32), c.view(np.uint32))
