"""The CPU forward's parallel loops give the same bits on the spinning pool and on rayon
(``BONSAI_CPU_SPIN=1`` / ``0``, read when an engine loads), at several thread counts: full-model
logits of a multi-row prefill, a greedy continuation, and a speculative (n-gram) continuation,
whose verify rows run the multi-row mat-vecs and the GDN / attention loops."""

from __future__ import annotations

import numpy as np
import pytest

import bonsai


def run(model, monkeypatch, spin: str, threads: int):
    monkeypatch.setenv("BONSAI_CPU_SPIN", spin)
    eng = bonsai.Engine(model, device="cpu", threads=threads)
    ids = [(7 * i + 3) % 1000 for i in range(40)]
    lg = np.asarray(eng.logits(ids), dtype=np.float32)
    gen = eng.complete(ids[:10], max_tokens=16, temperature=0, ignore_eos=True).token_ids
    del eng
    spec = bonsai.Engine(model, device="cpu", threads=threads, draft="ngram", speculative="always")
    sgen = spec.complete(ids[:10], max_tokens=16, temperature=0, ignore_eos=True).token_ids
    return lg, list(gen), list(sgen)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_spin_pool_same_bits_as_rayon(tiny_q1, tiny_q2g64, monkeypatch, threads):
    for model in (tiny_q1, tiny_q2g64):
        lg0, g0, s0 = run(model, monkeypatch, "0", threads)
        lg1, g1, s1 = run(model, monkeypatch, "1", threads)
        assert np.isfinite(lg0).all()
        assert np.array_equal(lg0.view(np.uint32), lg1.view(np.uint32)), f"{model.name}: logits differ"
        assert g0 == g1, f"{model.name}: greedy tokens differ"
        assert s1 == g1, f"{model.name}: speculative greedy differs from plain greedy"
        assert s0 == g0


def test_bad_spin_setting_is_a_clear_error(tiny_q1, monkeypatch):
    monkeypatch.setenv("BONSAI_CPU_SPIN", "1")
    monkeypatch.setenv("BONSAI_CPU_SPIN_US", "soon")
    with pytest.raises(Exception, match="BONSAI_CPU_SPIN_US"):
        bonsai.Engine(tiny_q1, device="cpu", threads=2)
