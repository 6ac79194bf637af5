"""bonsai — a fast, faithful engine for PrismML's Bonsai-27B models (qwen35 Q1_0 / Q2_0 + DSpark).

    >>> import bonsai
    >>> eng = bonsai.Engine("Bonsai-27B-Q1_0.gguf")           # or bonsai.Engine() for a demo model
    >>> for chunk in eng.chat([{"role": "user", "content": "Hi!"}], max_tokens=64):
    ...     print(chunk.text, end="", flush=True)

Everything heavy runs on the engine's own Rust thread, without the GIL. Iterators stream one
chunk per generated token; closing or dropping an iterator cancels its request within one step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "Engine",
    "Chunk",
    "Completion",
    "BonsaiError",
    "ModelError",
    "InvalidRequestError",
    "ContextOverflowError",
    "BackendUnavailableError",
    "EngineError",
    "demo_model_path",
]

if TYPE_CHECKING:  # pragma: no cover
    from ._api import Chunk, Completion, Engine, demo_model_path
    from ._bonsai import (
        BackendUnavailableError,
        BonsaiError,
        ContextOverflowError,
        EngineError,
        InvalidRequestError,
        ModelError,
    )


def __getattr__(name: str) -> Any:
    # Lazy: `bonsai.synth` and `python -m bonsai.synth` work even where the compiled extension is
    # not built (e.g. on a machine that only generates model files).
    if name in ("Engine", "Chunk", "Completion", "demo_model_path"):
        from . import _api

        return getattr(_api, name)
    if name in (
        "BonsaiError",
        "ModelError",
        "InvalidRequestError",
        "ContextOverflowError",
        "BackendUnavailableError",
        "EngineError",
        "__version__",
    ):
        from . import _bonsai

        return getattr(_bonsai, name)
    raise AttributeError(f"module 'bonsai' has no attribute {name!r}")
