"""The q8_0 KV-cache option: same model, attention K/V stored as ggml q8_0 blocks instead of f16.

Tolerance: q8_0 rounds each K/V value to 1/254 of its 32-block's max (relative error ≤ 0.4%), far
below the int8 activation noise every matmul already adds (simulated by ``reference.Reference(...,
"q8_0")``). So logits with a q8_0 cache must stay within that activation noise of the f16-cache
logits, and as close to the exact float64 reference as the f16 cache is (same 4x bound the oracle
tests use).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as R

import bonsai


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return [int(t) for t in np.random.default_rng(11).integers(0, 256, 96)]


@pytest.mark.parametrize("variant", ["tiny_q1", "tiny_q2g64"])
def test_q8_0_kv_cache_close_to_f16_and_reference(variant, ids, request):
    path = str(request.getfixturevalue(variant))
    f16 = bonsai.Engine(path, device="cpu", threads=2, n_ctx=256)
    q8 = bonsai.Engine(path, device="cpu", threads=2, n_ctx=256, kv_cache="q8_0")
    a = f16.logits(ids).astype(np.float64)
    b = q8.logits(ids).astype(np.float64)
    assert np.isfinite(b).all()
    assert not np.array_equal(a, b), "the q8_0 cache must actually be used"
    X = R.Reference(path).logits(ids)
    Q = R.Reference(path, "q8_0").logits(ids)
    noise = R.nmse(Q, X)
    assert R.nmse(b, a) <= noise, (R.nmse(b, a), noise)
    assert R.nmse(b, X) <= 4 * noise, (R.nmse(b, X), noise)
    # decode and chunked prefill agree with the q8_0 cache too
    c = q8.logits(ids, chunked=False).astype(np.float64)
    assert R.nmse(b, c) <= noise


def test_q8_0_kv_cache_generates_and_bad_value_is_refused(tiny_q1):
    eng = bonsai.Engine(tiny_q1, device="cpu", threads=2, kv_cache="q8_0")
    out = eng.complete("Hello", max_tokens=16, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 16
    again = eng.complete("Hello", max_tokens=16, temperature=0, ignore_eos=True)
    assert again.token_ids == out.token_ids
    with pytest.raises(bonsai.InvalidRequestError, match="kv_cache"):
        bonsai.Engine(tiny_q1, device="cpu", kv_cache="q4")
