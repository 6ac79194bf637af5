"""Shared pytest fixtures: session-scoped synthetic model files made by ``bonsai.synth``.

Fixtures (all ``pathlib.Path`` to a GGUF file, made once per session in a temp dir, seed 0):

- ``tiny_q1``, ``tiny_q2`` (Q2_0 g128, id 42), ``tiny_pq2`` (id 142), ``tiny_q2g64`` (id 42, g64)
- ``small_q1``, ``small_q2`` (made lazily, only when a test asks; ~30 / 60 MB)
- ``synth_model(preset, variant, seed=0)``: factory for any other combination (cached per session)
- ``tiny_tokenizer``: the reference ``bonsai.synth.Tokenizer`` of the tiny vocabulary
- ``synth``: the ``bonsai.synth`` module itself
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
_PY = _ROOT / "python"
_TESTS = Path(__file__).resolve().parent
for _p in (str(_PY), str(_TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _import_synth():
    try:
        return importlib.import_module("bonsai.synth")
    except ImportError:
        # The package __init__ could not be imported (e.g. the extension is missing and the init is
        # not tolerant): register a bare package so the pure-Python submodules still import.
        for k in [k for k in sys.modules if k == "bonsai" or k.startswith("bonsai.")]:
            del sys.modules[k]
        pkg = types.ModuleType("bonsai")
        pkg.__path__ = [str(_PY / "bonsai")]
        sys.modules["bonsai"] = pkg
        return importlib.import_module("bonsai.synth")


_synth = _import_synth()


@pytest.fixture(scope="session")
def synth():
    return _synth


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("synth")


@pytest.fixture(scope="session")
def synth_model(synth_dir):
    cache: dict = {}

    def make(preset: str, variant: str, seed: int = 0) -> Path:
        key = (preset, variant, seed)
        if key not in cache:
            cache[key] = _synth.make_target(
                synth_dir / f"{preset}-{variant}-s{seed}.gguf", preset, variant, seed=seed, progress=False
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_q1(synth_model) -> Path:
    return synth_model("tiny", "q1")


@pytest.fixture(scope="session")
def tiny_q2(synth_model) -> Path:
    return synth_model("tiny", "q2")


@pytest.fixture(scope="session")
def tiny_pq2(synth_model) -> Path:
    return synth_model("tiny", "pq2")


@pytest.fixture(scope="session")
def tiny_q2g64(synth_model) -> Path:
    return synth_model("tiny", "q2g64")


@pytest.fixture(scope="session")
def small_q1(synth_model) -> Path:
    return synth_model("small", "q1")


@pytest.fixture(scope="session")
def small_q2(synth_model) -> Path:
    return synth_model("small", "q2")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    p = _synth.PRESETS["tiny"]
    return _synth.Tokenizer.from_vocab(_synth.build_vocab(p.n_bpe, p.n_vocab_rows))
