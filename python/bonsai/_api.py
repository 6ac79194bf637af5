"""The public Python API on top of the compiled engine (`bonsai._bonsai`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _bonsai

#: Sampling defaults recommended for Bonsai (MODEL.md §5.4).
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.95,
    "min_p": 0.0,
}


@dataclass
class Chunk:
    """One streamed piece of output: usually one token.

    ``text`` may be empty while a multi-byte character or a possible stop string is held back.
    The last chunk of a request has ``finish_reason`` ("stop", "length" or "cancelled") and
    ``usage`` set, and no token.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def token_id(self) -> int | None:
        """The chunk's token id (``None`` for the final chunk and released text)."""
        return self.token_ids[0] if self.token_ids else None


@dataclass
class Completion:
    """A whole generation, collected."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    usage: dict[str, Any]


def demo_model_path(preset: str = "tiny", variant: str = "q1", seed: int = 0) -> Path:
    """Path of a generated demo model (random weights), created on first use in the cache dir
    (``$BONSAI_CACHE`` or ``~/.cache/bonsai``)."""
    from . import synth

    cache = Path(os.environ.get("BONSAI_CACHE", Path.home() / ".cache" / "bonsai"))
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"demo-{preset}-{variant}-seed{seed}.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        synth.make_target(tmp, preset=preset, variant=variant, seed=seed, progress=False)
        tmp.replace(path)
    return path


_U32_MAX = (1 << 32) - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _sampling_args(
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    presence_penalty: float,
    frequency_penalty: float,
    repetition_penalty: float,
    penalty_last_n: int,
    seed: int | None,
    logprobs: int,
    logit_bias: dict[int, float] | None,
) -> dict[str, Any]:
    def num(name: str, v: Any, default: Any) -> Any:
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _bonsai.InvalidRequestError(f"{name} must be a number, got {type(v).__name__}")
        return v

    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    if not isinstance(seed, int) or seed < 0:
        raise _bonsai.InvalidRequestError(f"seed must be a non-negative integer, got {seed!r}")
    if not _is_int(logprobs) or not 0 <= logprobs <= _U32_MAX:
        raise _bonsai.InvalidRequestError(f"logprobs must be an integer in 0..=20, got {logprobs!r}")
    for name, v in (("top_k", top_k), ("penalty_last_n", penalty_last_n)):
        if v is not None and (not _is_int(v) or not 0 <= v <= _U32_MAX):
            raise _bonsai.InvalidRequestError(f"{name} must be a non-negative integer, got {v!r}")
    if not isinstance(logit_bias, (dict, type(None))):
        raise _bonsai.InvalidRequestError("logit_bias must be a dict {token_id: bias}")
    for k in logit_bias or {}:
        if not _is_int(k) or not 0 <= k <= _U32_MAX:
            raise _bonsai.InvalidRequestError(f"logit_bias: token id {k!r} is not a valid token id")
    return {
        "temperature": float(num("temperature", temperature, DEFAULT_SAMPLING["temperature"])),
        "top_k": int(num("top_k", top_k, DEFAULT_SAMPLING["top_k"])),
        "top_p": float(num("top_p", top_p, DEFAULT_SAMPLING["top_p"])),
        "min_p": float(num("min_p", min_p, DEFAULT_SAMPLING["min_p"])),
        "presence_penalty": float(num("presence_penalty", presence_penalty, 0.0)),
        "frequency_penalty": float(num("frequency_penalty", frequency_penalty, 0.0)),
        "repetition_penalty": float(num("repetition_penalty", repetition_penalty, 1.0)),
        "penalty_last_n": int(penalty_last_n),
        "seed": seed % (1 << 64),
        "n_logprobs": logprobs,
        "logit_bias": [(int(k), float(v)) for k, v in (logit_bias or {}).items()],
    }


class Engine:
    """A loaded Bonsai model.

    Args:
        model: path to a ``qwen35`` GGUF (Q1_0, Q2_0 in either block layout, or PQ2_0). ``None``
            uses a generated demo model with random weights (and says so on stderr).
        device: ``"auto"`` (CUDA → Vulkan → CPU, whichever is available), ``"cpu"``, ``"cuda"``,
            ``"vulkan"``.
        n_ctx: context length (default min(trained context, 4096)).
        threads: CPU worker threads (default: all cores).
        draft: speculative decoding: a DSpark drafter GGUF (arch ``dspark``) made for this model, or
            ``"ngram"`` for n-gram self-speculation (no weights). ``None``: plain decoding.
        speculative: with ``draft``: ``"auto"`` (draft only while it measurably pays; see
            :attr:`policy`), ``"always"`` or ``"never"``. Output is identical either way.
        rollback: GDN rollback after a partial accept: ``"replay"`` (default) or ``"reforward"``.
        kv_cache: attention KV cache storage, ``"f16"`` (default) or ``"q8_0"`` (CPU and Vulkan;
            ~47% less memory per context token).
        prompt_cache: resume a request whose prompt starts with a cached prompt's tokens (the next
            turn of a chat, a repeated request, another user of a long system prompt) from the state
            saved at that prompt's last prefill-chunk boundary (on the CPU also its last multiple of
            64 tokens), or at the last boundary of a prefix it shared with an earlier prompt,
            instead of prefilling it again. Output is bit-identical to a fresh prefill;
            ``usage["cached_tokens"]`` says how many prompt tokens were resumed.
        prompt_cache_entries: with ``prompt_cache``, how many other conversations (or earlier
            branches of one) are kept besides the live one, so that interleaved conversations each
            resume their own history; the least recently used goes first. Each costs a copy of its
            KV rows and up to three copies of the GDN state (~157 MB each for the 27B) in the
            backend's memory. ``0`` keeps only the live conversation.
        prefill_chunk: prompt tokens per prefill forward (default 512). The prompt cache's
            boundaries are its multiples: a smaller chunk re-prefills less of a resumed prompt, at
            some prefill speed.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        device: str = "auto",
        n_ctx: int | None = None,
        threads: int | None = None,
        draft: str | os.PathLike[str] | None = None,
        speculative: str = "auto",
        rollback: str = "replay",
        kv_cache: str = "f16",
        prompt_cache: bool = True,
        prompt_cache_entries: int = 4,
        prefill_chunk: int = 512,
    ) -> None:
        if model is None:
            model = demo_model_path()
            print(
                f"bonsai: no model given; using a generated demo model with RANDOM weights: {model}",
                file=sys.stderr,
            )
        if not isinstance(device, str):
            raise _bonsai.InvalidRequestError(f"device must be a string, got {type(device).__name__}")
        for name, v in (("n_ctx", n_ctx), ("threads", threads), ("prefill_chunk", prefill_chunk)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise _bonsai.InvalidRequestError(f"{name} must be a positive integer, got {v!r}")
        if draft is not None and not isinstance(draft, (str, os.PathLike)):
            raise _bonsai.InvalidRequestError(f'draft must be a path or "ngram", got {type(draft).__name__}')
        for name, v in (("speculative", speculative), ("rollback", rollback), ("kv_cache", kv_cache)):
            if not isinstance(v, str):
                raise _bonsai.InvalidRequestError(f"{name} must be a string, got {type(v).__name__}")
        if not isinstance(prompt_cache, bool):
            raise _bonsai.InvalidRequestError(f"prompt_cache must be a bool, got {type(prompt_cache).__name__}")
        entries = prompt_cache_entries
        if not isinstance(entries, int) or isinstance(entries, bool) or entries < 0:
            raise _bonsai.InvalidRequestError(f"prompt_cache_entries must be a non-negative integer, got {entries!r}")
        self._raw = _bonsai.RawEngine(
            os.fspath(model),
            device,
            n_ctx,
            threads,
            None if draft is None else os.fspath(draft),
            speculative,
            rollback,
            kv_cache,
            prompt_cache,
            prompt_cache_entries,
            prefill_chunk,
        )
        self.info: dict[str, Any] = dict(self._raw.info())

    @property
    def policy(self) -> dict[str, Any] | None:
        """The speculative-decoding policy (``None`` without ``draft``): ``mode``, ``enabled``,
        ``R`` (round cost in plain decode steps), ``tok_per_s_spec`` / ``tok_per_s_plain``,
        ``acceptance``, and ``decisions`` (each with the numbers behind it)."""
        p = self._raw.policy()
        return None if p is None else dict(p)

    @property
    def stats(self) -> dict[str, Any] | None:
        """Engine-wide speculative counters (``None`` without ``draft``): rounds, drafted and
        accepted tokens, acceptance rate, tokens per round, time in rounds and plain steps."""
        st = self._raw.stats()
        return None if st is None else dict(st)

    def __repr__(self) -> str:
        i = self.info
        return (
            f"<bonsai.Engine {Path(i['path']).name} {i['architecture']} {i['weight_type']} "
            f"layers={i['n_layer']} n_ctx={i['n_ctx']} device={i['device']!r}>"
        )

    # ---- tokens ---------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text``; with ``special`` the control strings (``<|im_start|>`` …) are parsed."""
        return list(self._raw.tokenize(text, special))

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        if not all(_is_int(t) and 0 <= t <= _U32_MAX for t in ids):
            raise _bonsai.InvalidRequestError("detokenize: ids must be non-negative integer token ids")
        return self._raw.detokenize(ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._raw.token_bytes(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the model's own ``tokenizer.chat_template``."""
        kwargs = dict(chat_template_kwargs or {})
        if "enable_thinking" in kwargs:
            enable_thinking = bool(kwargs.pop("enable_thinking"))
        return self._raw.render_chat(
            json.dumps(list(messages)),
            add_generation_prompt,
            enable_thinking,
            None if tools is None else json.dumps(tools),
            json.dumps(kwargs) if kwargs else None,
        )

    # ---- generation -----------------------------------------------------------------------------
    def _submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        penalty_last_n: int = 64,
        seed: int | None = None,
        logprobs: int = 0,
        logit_bias: dict[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        speculative: bool | None = None,
    ) -> Any:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, special=True)
        elif isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise _bonsai.InvalidRequestError("prompt must be a string or a list of token ids")
        n_vocab = self.info["n_vocab"]
        for t in ids:
            if not 0 <= t < n_vocab:
                raise _bonsai.InvalidRequestError(
                    f"prompt token id {t} is out of range (vocabulary has {n_vocab} rows)"
                )
        if not _is_int(max_tokens) or not 0 < max_tokens <= _U32_MAX:
            raise _bonsai.InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)):
            stops = list(stop)
        else:
            stops = [stop]
        if not all(isinstance(s, str) for s in stops):
            raise _bonsai.InvalidRequestError("stop must be a string or a list of strings")
        if not isinstance(stop_token_ids, (list, tuple, type(None))):
            raise _bonsai.InvalidRequestError("stop_token_ids must be a list of token ids")
        for t in stop_token_ids or []:
            if not _is_int(t) or not 0 <= t < n_vocab:
                raise _bonsai.InvalidRequestError(
                    f"stop_token_ids: {t!r} is not a token id of this model (vocabulary has {n_vocab} rows)"
                )
        s = _sampling_args(
            temperature,
            top_k,
            top_p,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            penalty_last_n,
            seed,
            logprobs,
            logit_bias,
        )
        return self._raw.submit(
            ids,
            max_tokens,
            s["temperature"],
            s["top_k"],
            s["top_p"],
            s["min_p"],
            s["presence_penalty"],
            s["frequency_penalty"],
            s["repetition_penalty"],
            s["penalty_last_n"],
            s["seed"],
            s["n_logprobs"],
            s["logit_bias"],
            stops,
            list(stop_token_ids or []),
            bool(ignore_eos),
            None if speculative is None else bool(speculative),
        )

    @staticmethod
    def _chunk(ev: tuple[Any, ...]) -> Chunk:
        kind = ev[0]
        if kind == "token":
            _, tid, text, lp, top = ev
            return Chunk(text=text, token_ids=[tid], logprobs=[lp], top_logprobs=[list(top)])
        if kind == "text":
            return Chunk(text=ev[1])
        _, reason, usage = ev
        return Chunk(text="", finish_reason=reason, usage=dict(usage))

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> Iterator[Chunk]:
        """Stream a raw completion of ``prompt`` (text, parsed with special tokens, or token ids).

        Keyword arguments: ``max_tokens`` (256), ``temperature`` (0.7; 0 = greedy), ``top_k`` (20),
        ``top_p`` (0.95), ``min_p`` (0), ``presence_penalty``, ``frequency_penalty``,
        ``repetition_penalty``, ``penalty_last_n``, ``seed``, ``logprobs`` (top-N alternatives,
        0–20), ``logit_bias``, ``stop`` (strings), ``stop_token_ids``, ``ignore_eos``, ``speculative`` (``None``: the
        engine's policy; ``False``: plain decoding; ``True``: draft every step; output is the same).

        Invalid arguments raise :class:`InvalidRequestError` here, before any generation.
        """
        stream = self._submit(prompt, **kwargs)
        return self._iterate(stream)

    def _iterate(self, stream: Any) -> Iterator[Chunk]:
        try:
            for ev in stream:
                yield self._chunk(ev)
        finally:
            stream.cancel()

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        enable_thinking: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Iterator[Chunk]:
        """Stream the assistant's reply to ``messages`` (OpenAI-style dicts), rendered with the
        model's chat template. Thinking is on by default; ``enable_thinking=False`` turns it off."""
        prompt = self.apply_chat_template(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.generate(prompt, **kwargs)

    def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> Completion:
        """Generate and collect the whole output."""
        text: list[str] = []
        ids: list[int] = []
        lps: list[float] = []
        reason, usage = "stop", {}
        for c in self.generate(prompt, **kwargs):
            text.append(c.text)
            ids += c.token_ids
            lps += c.logprobs
            if c.finish_reason is not None:
                reason, usage = c.finish_reason, c.usage or {}
        return Completion("".join(text), ids, lps, reason, usage)

    async def agenerate(self, prompt: str | Sequence[int], **kwargs: Any) -> AsyncIterator[Chunk]:
        """asyncio variant of :meth:`generate`. Cancelling the consuming task cancels the request."""
        stream = self._submit(prompt, **kwargs)
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = await loop.run_in_executor(None, stream.next_batch, 0.05)
                for ev in batch:
                    yield self._chunk(ev)
                if stream.finished:
                    return
        finally:
            stream.cancel()

    async def achat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Chunk]:
        """asyncio variant of :meth:`chat`."""
        template_keys = ("enable_thinking", "tools", "chat_template_kwargs")
        tkw = {k: kwargs.pop(k) for k in template_keys if k in kwargs}
        prompt = self.apply_chat_template(messages, **tkw)
        async for c in self.agenerate(prompt, **kwargs):
            yield c

    # ---- oracle / debugging -----------------------------------------------------------------------
    def logits(self, ids: Sequence[int], chunked: bool = True) -> Any:
        """Logits ``[len(ids), n_vocab]`` (float32 numpy array) of every row of a fresh sequence:
        chunked prefill (``chunked=True``) or one token at a time."""
        import numpy as np

        raw = self._raw.logits(list(ids), chunked)
        return np.frombuffer(raw, dtype="<f4").reshape(len(ids), self.info["n_vocab"]).copy()
