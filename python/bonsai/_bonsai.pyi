"""Typed stub of the compiled engine module ``bonsai._bonsai`` (crates/bonsai-py).

Use the public API in :mod:`bonsai` (``bonsai.Engine``); these classes are its thin backing.
"""

import os
from typing import Any, Literal, TypeAlias, final

__version__: str

# ---- exceptions ---------------------------------------------------------------------------------

class BonsaiError(Exception):
    """Base class of every bonsai error."""

class ModelError(BonsaiError):
    """The model file is unreadable, corrupt or unsupported."""

class InvalidRequestError(BonsaiError):
    """A request or argument is invalid."""

class ContextOverflowError(InvalidRequestError):
    """The prompt does not fit the context."""

class BackendUnavailableError(BonsaiError):
    """The requested device is not available."""

class EngineError(BonsaiError):
    """The engine failed while running a request."""

# ---- events -------------------------------------------------------------------------------------

FinishReason: TypeAlias = Literal["stop", "length", "cancelled"]

#: ``("token", id, text, logprob, [(id, logprob), ...])``: one generated token. ``text`` may be empty
#: while a partial UTF-8 sequence or a possible stop-string prefix is held back.
TokenEvent: TypeAlias = tuple[Literal["token"], int, str, float, list[tuple[int, float]]]
#: ``("text", text)``: held-back text released at the end, without a token of its own.
TextEvent: TypeAlias = tuple[Literal["text"], str]
#: ``("done", finish_reason, usage)``; usage keys: ``prompt_tokens``, ``cached_tokens`` (prompt
#: tokens resumed from the prompt cache), ``completion_tokens`` (int), ``prefill_seconds``,
#: ``decode_seconds``, ``ttft_seconds`` (float).
DoneEvent: TypeAlias = tuple[Literal["done"], FinishReason, dict[str, int | float]]
Event: TypeAlias = TokenEvent | TextEvent | DoneEvent

@final
class Stream:
    """A request's event stream. Iterating yields events until (and including) the ``"done"`` event;
    an error of the request is raised from ``__next__``. Dropping the stream cancels the request."""

    def __iter__(self) -> Stream: ...
    def __next__(self) -> Event: ...
    def next_batch(self, timeout: float = 0.05) -> list[Event]:
        """Wait up to ``timeout`` seconds for at least one event, then return every queued event
        (possibly none). Used by the asyncio bridge from a worker thread."""
    @property
    def finished(self) -> bool:
        """True once the final event has been delivered."""
    def cancel(self) -> None:
        """Stop generation within one step. Idempotent."""

# ---- engine -------------------------------------------------------------------------------------

@final
class RawEngine:
    """The compiled engine. Use ``bonsai.Engine``, which wraps this class.

    Raises ``ModelError`` (unreadable / invalid / unsupported file, a DSpark drafter given as the
    target), ``BackendUnavailableError`` (device not built or absent), ``InvalidRequestError`` (unknown
    device, n_ctx outside 2..=trained context)."""

    def __new__(
        cls,
        model: str | os.PathLike[str],
        device: str = "auto",
        n_ctx: int | None = None,
        threads: int | None = None,
        draft: str | None = None,
        speculative: str = "auto",
        rollback: str = "replay",
        kv_cache: str = "f16",
        prompt_cache: bool = True,
        prompt_cache_entries: int = 4,
        prefill_chunk: int = 512,
    ) -> RawEngine: ...
    def info(self) -> dict[str, Any]:
        """``path``, ``architecture``, ``name``, ``weight_type`` (str); ``n_layer``, ``n_embd``,
        ``n_vocab``, ``n_ctx``, ``n_ctx_train``, ``threads``, ``file_bytes`` (int); ``device`` (str);
        ``stop_ids`` (list[int])."""
    def tokenize(self, text: str, special: bool = True) -> list[int]: ...
    def detokenize(self, ids: list[int]) -> str: ...
    def token_bytes(self, id: int) -> bytes: ...
    def render_chat(
        self,
        messages_json: str,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools_json: str | None = None,
        extra_json: str | None = None,
    ) -> str:
        """Render a JSON list of ``{role, content, reasoning_content?, tool_calls?, name?}`` with the
        model's chat template."""
    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        presence_penalty: float,
        frequency_penalty: float,
        repetition_penalty: float,
        penalty_last_n: int,
        seed: int,
        n_logprobs: int,
        logit_bias: list[tuple[int, float]],
        stop: list[str],
        stop_ids: list[int],
        ignore_eos: bool,
        speculative: bool | None = None,
    ) -> Stream:
        """Validate and queue a generation (requests run one after another on the engine thread)."""
    def policy(self) -> dict[str, Any] | None:
        """The speculative-decoding policy (``None`` without a drafter): mode, R, tok/s each way,
        decisions with the numbers behind them."""
    def stats(self) -> dict[str, Any] | None:
        """Engine-wide speculative-decoding counters (``None`` without a drafter)."""
    def logits(self, ids: list[int], chunked: bool = True) -> bytes:
        """Logits of every row of a fresh sequence: little-endian f32 ``[len(ids), n_vocab]``."""

def inspect(path: str | os.PathLike[str]) -> str:
    """A human-readable report of a GGUF file: architecture, sizes, tensor types, memory estimate and
    the validation result. Raises ``ModelError`` only when the container itself cannot be read."""

__all__: list[str]
