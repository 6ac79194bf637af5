"""OpenAI-compatible request parsing and response shaping, as pure functions (no engine, no aiohttp).

The server (:mod:`bonsai.server`) glues these to an :class:`bonsai.Engine`. Everything here works on
plain dicts and on duck-typed chunks (objects with ``text``, ``token_ids``, ``logprobs``,
``top_logprobs``, ``finish_reason``, ``usage``: :class:`bonsai.Chunk`), so it is tested without a model.

Shapes follow the OpenAI API (``chat.completion``, ``chat.completion.chunk``, ``text_completion``),
with the llama.cpp/DeepSeek extension ``reasoning_content`` for text the model wrote inside
``<think>…</think>``.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16

#: The message roles the chat endpoint accepts (``developer`` is rendered as ``system``).
ROLES = ("system", "developer", "user", "assistant", "tool")

#: Request fields that an engine error message may name (used to fill ``error.param``).
_KNOWN_PARAMS = (
    "max_completion_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "top_logprobs",
    "logprobs",
    "messages",
    "prompt",
)


# ---- errors ---------------------------------------------------------------------------------------


class RequestError(Exception):
    """A request the server rejects; carries the OpenAI error fields and the HTTP status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = status if code is None else code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def guess_param(message: str) -> str | None:
    """The request field an (engine) error message is about, if it names one."""
    m = re.match(r"^(?:invalid request: )?([a-z_]+):", message)
    if m and m.group(1) in _KNOWN_PARAMS:
        return m.group(1)
    for p in _KNOWN_PARAMS:
        if re.search(rf"\b{p}\b", message):
            return p
    return None


# ---- request parsing ------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _get_num(
    body: dict[str, Any],
    key: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    integer: bool = False,
) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if integer:
        if not _is_int(v):
            raise RequestError(f"{key} must be an integer, got {json.dumps(v)}", key)
    elif not _is_num(v):
        raise RequestError(f"{key} must be a finite number, got {json.dumps(v)}", key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise RequestError(f"{key} must be {'>' if lo_open else '>='} {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise RequestError(f"{key} must be <= {hi}, got {v}", key)
    return v


def _get_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be a boolean, got {json.dumps(v)}", key)
    return v


def _parse_stop(body: dict[str, Any]) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(v) > MAX_STOP:
        raise RequestError(f"stop may hold at most {MAX_STOP} strings, got {len(v)}", "stop")
    stops = [s for s in v if s]
    return stops or None


def _parse_logit_bias(body: dict[str, Any], n_vocab: int | None) -> dict[int, float] | None:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise RequestError("logit_bias must be an object {token_id: bias}", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias: key {k!r} is not a token id", "logit_bias") from None
        if tid < 0 or (n_vocab is not None and tid >= n_vocab):
            raise RequestError(f"logit_bias: token id {tid} is outside [0, {n_vocab})", "logit_bias")
        if not _is_num(b) or not -100 <= b <= 100:
            raise RequestError(f"logit_bias: bias of token {tid} must be a number in [-100, 100]", "logit_bias")
        out[tid] = float(b)
    return out


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get_bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError("stream_options must be an object", "stream_options")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise RequestError("stream_options.include_usage must be a boolean", "stream_options")
        include_usage = iu
    return stream, include_usage


def _parse_sampling(body: dict[str, Any], n_vocab: int | None) -> dict[str, Any]:
    """The engine keyword arguments shared by both endpoints (only the keys the request sets)."""
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise RequestError(f"n: only n=1 is supported, got {json.dumps(n)}", "n")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise RequestError("best_of: only best_of=1 is supported", "best_of")
    gen: dict[str, Any] = {}
    mct = _get_num(body, "max_completion_tokens", lo=1, integer=True)
    mt = _get_num(body, "max_tokens", lo=1, integer=True)
    if mct is not None or mt is not None:
        gen["max_tokens"] = mct if mct is not None else mt
    for key, kw in (
        ("temperature", {"lo": 0.0}),
        ("top_p", {"lo": 0.0, "lo_open": True, "hi": 1.0}),
        ("min_p", {"lo": 0.0, "hi": 1.0}),
        ("presence_penalty", {"lo": -2.0, "hi": 2.0}),
        ("frequency_penalty", {"lo": -2.0, "hi": 2.0}),
    ):
        v = _get_num(body, key, **kw)
        if v is not None:
            gen[key] = float(v)
    top_k = _get_num(body, "top_k", lo=-1, integer=True)
    if top_k is not None:
        gen["top_k"] = max(top_k, 0)  # -1 / 0: off (vLLM / llama.cpp)
    rep_key = "repetition_penalty" if body.get("repetition_penalty") is not None else "repeat_penalty"
    rep = _get_num(body, rep_key, lo=0.0, lo_open=True)
    if rep is not None:
        gen["repetition_penalty"] = float(rep)
    last_key = "penalty_last_n" if body.get("penalty_last_n") is not None else "repeat_last_n"
    last_n = _get_num(body, last_key, lo=0, integer=True)
    if last_n is not None:
        gen["penalty_last_n"] = last_n
    seed = _get_num(body, "seed", integer=True)
    if seed is not None:
        gen["seed"] = seed % (1 << 64)
    stop = _parse_stop(body)
    if stop is not None:
        gen["stop"] = stop
    bias = _parse_logit_bias(body, n_vocab)
    if bias:
        gen["logit_bias"] = bias
    if _get_bool(body, "ignore_eos"):
        gen["ignore_eos"] = True
    sti = body.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(_is_int(t) and t >= 0 for t in sti):
            raise RequestError("stop_token_ids must be a list of token ids", "stop_token_ids")
        gen["stop_token_ids"] = list(sti)
    return gen


def _text_of(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RequestError(f"{where}: content part of type {kind!r} is not supported (text only)", "messages")
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string, a list of text parts or null", "messages")


def _parse_messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise RequestError("messages must be a non-empty list of message objects", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}; got {json.dumps(role)}", "messages")
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _text_of(m.get("content"), where) or ""
        if "reasoning_content" in m:
            msg["reasoning_content"] = _text_of(m["reasoning_content"], where) or ""
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls must be a list", "messages")
            fixed = []
            for c in calls:
                c = dict(c) if isinstance(c, dict) else {}
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):  # OpenAI sends JSON text; the template iterates a mapping
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass
                c["function"] = fn
                fixed.append(c)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


@dataclass
class ChatRequest:
    """A validated ``/v1/chat/completions`` request."""

    messages: list[dict[str, Any]]
    gen: dict[str, Any]  # keyword arguments for Engine.agenerate (only those the request set)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    enable_thinking: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    model: str | None = None


@dataclass
class CompletionRequest:
    """A validated ``/v1/completions`` request."""

    prompt: str | list[int]
    gen: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    model: str | None = None


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str | None:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise RequestError("model must be a string", "model")
    return m


def parse_chat_request(body: Any, n_vocab: int | None = None) -> ChatRequest:
    """Validate a chat request body; raises :class:`RequestError` naming the offending field."""
    body = _require_object(body)
    messages = _parse_messages(body.get("messages"))
    stream, include_usage = _parse_stream(body)
    gen = _parse_sampling(body, n_vocab)
    logprobs = _get_bool(body, "logprobs")
    top = _get_num(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    if top is not None and top > 0 and not logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    top = top or 0
    if logprobs:
        gen["logprobs"] = top
    ctk = body.get("chat_template_kwargs")
    if ctk is None:
        ctk = {}
    if not isinstance(ctk, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    ctk = dict(ctk)
    enable_thinking = True
    if "enable_thinking" in ctk:
        et = ctk.pop("enable_thinking")
        if not isinstance(et, bool):
            raise RequestError("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
        enable_thinking = et
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of objects", "tools")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type", "text") != "text"):
        raise RequestError("response_format: only {'type': 'text'} is supported", "response_format")
    return ChatRequest(
        messages=messages,
        gen=gen,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top,
        enable_thinking=enable_thinking,
        chat_template_kwargs=ctk,
        tools=tools or None,
        model=_model(body),
    )


def parse_completion_request(body: Any, n_vocab: int | None = None) -> CompletionRequest:
    """Validate a legacy completions request body; raises :class:`RequestError`."""
    body = _require_object(body)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        prompt: str | list[int] = p
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        if any(t < 0 or (n_vocab is not None and t >= n_vocab) for t in p):
            raise RequestError(f"prompt: token ids must be in [0, {n_vocab})", "prompt")
        prompt = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise RequestError("prompt: only one prompt per request is supported", "prompt")
    else:
        raise RequestError("prompt must be a string or a non-empty list of token ids", "prompt")
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    if _get_bool(body, "echo"):
        raise RequestError("echo is not supported", "echo")
    if body.get("suffix"):
        raise RequestError("suffix is not supported", "suffix")
    stream, include_usage = _parse_stream(body)
    gen = _parse_sampling(body, n_vocab)
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        lp = _get_num(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        gen["logprobs"] = lp
    elif lp is True:  # lenient: treat `true` as 0 alternatives
        lp = 0
        gen["logprobs"] = 0
    else:
        lp = None
    return CompletionRequest(
        prompt=prompt, gen=gen, stream=stream, include_usage=include_usage, logprobs=lp, model=_model(body)
    )


# ---- reasoning split ------------------------------------------------------------------------------


def thinking_open(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` block (the generation prompt
    opened thinking), so the model's text up to ``</think>`` is reasoning."""
    i = prompt.rfind(THINK_OPEN)
    return i >= 0 and prompt.find(THINK_CLOSE, i) < 0


def _partial_suffix(s: str, token: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``token``."""
    for n in range(min(len(s), len(token) - 1), 0, -1):
        if s.endswith(token[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits streamed text into reasoning (before ``</think>``) and content (after it).

    In reasoning mode it holds back a possible partial ``</think>`` and trailing whitespace, so
    ``reasoning_content`` has no leading/trailing blank lines around the tags, and the blank lines
    the model writes right after ``</think>`` are dropped from ``content``. Feeding the whole text
    at once gives exactly the concatenation of the streamed pieces.
    """

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._buf = ""
        self._reasoning_started = False
        self._strip_content = False

    def feed(self, text: str) -> tuple[str, str]:
        """Returns ``(reasoning_delta, content_delta)`` for the next piece of text."""
        if not self.in_reasoning:
            return "", self._content(text)
        buf = self._buf + text
        idx = buf.find(THINK_CLOSE)
        if idx >= 0:
            reasoning = self._reasoning(buf[:idx].rstrip())
            self.in_reasoning = False
            self._buf = ""
            self._strip_content = True
            return reasoning, self._content(buf[idx + len(THINK_CLOSE) :])
        keep = _partial_suffix(buf, THINK_CLOSE)
        emit = buf[: len(buf) - keep].rstrip()
        self._buf = buf[len(emit) :]
        return self._reasoning(emit), ""

    def flush(self) -> tuple[str, str]:
        """The held-back text at the end of generation."""
        buf, self._buf = self._buf, ""
        if self.in_reasoning:
            return self._reasoning(buf), ""
        return "", ""

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        return text

    def _content(self, text: str) -> str:
        if self._strip_content:
            text = text.lstrip()
            self._strip_content = not text
        return text


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """``(reasoning, content)`` of a whole generated text (see :class:`ReasoningSplitter`)."""
    s = ReasoningSplitter(thinking)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return r1 + r2, c1 + c2


# ---- response shaping -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

#: Engine usage keys that are not OpenAI's; kept under ``usage`` as extras.
_USAGE_EXTRAS = ("prefill_seconds", "decode_seconds", "ttft_seconds", "speculative")


def make_usage(engine_usage: dict[str, Any] | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI ``usage`` from the engine's final-chunk usage."""
    u = engine_usage or {}
    p = int(u.get("prompt_tokens", 0))
    c = int(u.get("completion_tokens", 0))
    out: dict[str, Any] = {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0))},
    }
    for k in _USAGE_EXTRAS:
        if u.get(k) is not None:
            out[k] = u[k]
    return out


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


TokenBytes = Callable[[int], bytes]


def chat_logprob_entries(chunk: Any, token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """``logprobs.content`` entries ``{token, logprob, bytes, top_logprobs}`` of a chunk's tokens."""
    out = []
    tops = list(getattr(chunk, "top_logprobs", []) or [])
    for i, (tid, lp) in enumerate(zip(chunk.token_ids, chunk.logprobs, strict=False)):
        top = tops[i] if i < len(tops) else []
        b = token_bytes(tid)
        out.append(
            {
                "token": b.decode("utf-8", errors="replace"),
                "logprob": float(lp),
                "bytes": list(b),
                "top_logprobs": [
                    {"token": tb.decode("utf-8", errors="replace"), "logprob": float(tlp), "bytes": list(tb)}
                    for tb, tlp in ((token_bytes(t), tl) for t, tl in top)
                ],
            }
        )
    return out


class ChatShaper:
    """Turns engine chunks into ``chat.completion.chunk`` dicts or one ``chat.completion``."""

    def __init__(
        self,
        *,
        model: str,
        thinking: bool,
        logprobs: bool = False,
        token_bytes: TokenBytes | None = None,
        id: str | None = None,
        created: int | None = None,
    ) -> None:
        self.id = id or new_id("chatcmpl")
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.splitter = ReasoningSplitter(thinking)
        self.logprobs = logprobs
        self.token_bytes = token_bytes or (lambda t: b"")
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.lp_entries: list[dict[str, Any]] = []
        self._lp_pending: list[dict[str, Any]] = []
        self.reasoning_tokens = 0
        self.finish_reason: str | None = None
        self.engine_usage: dict[str, Any] | None = None

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            "usage": None,
        }

    def role_chunk(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def _delta(self, r: str, c: str) -> dict[str, Any] | None:
        if r:
            self.reasoning.append(r)
        if c:
            self.content.append(c)
        delta: dict[str, Any] = {}
        if r:
            delta["reasoning_content"] = r
        if c:
            delta["content"] = c
        if not delta:  # nothing to show yet: logprobs wait for the next delta (or the finish chunk)
            return None
        lp = None
        if self._lp_pending:
            lp = {"content": self._lp_pending, "refusal": None}
            self._lp_pending = []
        return self._chunk(delta, logprobs=lp)

    def feed(self, chunk: Any) -> list[dict[str, Any]]:
        """Chunks to stream for one engine chunk (none while text is held back)."""
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.engine_usage = chunk.usage
            return []
        if chunk.token_ids and self.splitter.in_reasoning:
            self.reasoning_tokens += len(chunk.token_ids)
        if self.logprobs and chunk.token_ids:
            entries = chat_logprob_entries(chunk, self.token_bytes)
            self.lp_entries += entries
            self._lp_pending += entries
        r, c = self.splitter.feed(chunk.text)
        d = self._delta(r, c)
        return [] if d is None else [d]

    def usage(self) -> dict[str, Any]:
        return make_usage(self.engine_usage, self.reasoning_tokens)

    def finish_chunks(self, include_usage: bool = False) -> list[dict[str, Any]]:
        """Held-back text, the finish chunk (empty delta) and, optionally, the usage chunk."""
        out = []
        d = self._delta(*self.splitter.flush())
        if d is not None:
            out.append(d)
        lp = {"content": self._lp_pending, "refusal": None} if self._lp_pending else None
        self._lp_pending = []
        out.append(self._chunk({}, finish=_finish(self.finish_reason), logprobs=lp))
        if include_usage:
            u = self._chunk({})
            u["choices"] = []
            u["usage"] = self.usage()
            out.append(u)
        return out

    def response(self) -> dict[str, Any]:
        """The whole non-streaming ``chat.completion`` (call after the final chunk was fed)."""
        self._delta(*self.splitter.flush())
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        reasoning = "".join(self.reasoning)
        if reasoning or self.reasoning_tokens:
            msg["reasoning_content"] = reasoning
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "logprobs": {"content": self.lp_entries, "refusal": None} if self.logprobs else None,
                    "finish_reason": _finish(self.finish_reason),
                }
            ],
            "usage": self.usage(),
        }


class CompletionShaper:
    """Turns engine chunks into ``text_completion`` chunks or one ``text_completion``."""

    def __init__(
        self,
        *,
        model: str,
        logprobs: int | None = None,
        token_bytes: TokenBytes | None = None,
        id: str | None = None,
        created: int | None = None,
    ) -> None:
        self.id = id or new_id("cmpl")
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.logprobs = logprobs
        self.token_bytes = token_bytes or (lambda t: b"")
        self.text: list[str] = []
        self._offset = 0
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.finish_reason: str | None = None
        self.engine_usage: dict[str, Any] | None = None

    def _tok(self, tid: int) -> str:
        return self.token_bytes(tid).decode("utf-8", errors="replace")

    def _chunk_lp(self, chunk: Any) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        tops = list(getattr(chunk, "top_logprobs", []) or [])
        for i, (tid, lp) in enumerate(zip(chunk.token_ids, chunk.logprobs, strict=False)):
            out["tokens"].append(self._tok(tid))
            out["token_logprobs"].append(float(lp))
            top = tops[i] if i < len(tops) else []
            out["top_logprobs"].append({self._tok(t): float(tl) for t, tl in top})
            out["text_offset"].append(self._offset)
        return out

    def _obj(self, text: str, finish: str | None, logprobs: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": None,
        }

    def feed(self, chunk: Any) -> list[dict[str, Any]]:
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.engine_usage = chunk.usage
            return []
        lp = None
        if self.logprobs is not None and chunk.token_ids:
            lp = self._chunk_lp(chunk)
            for k in self.lp:
                self.lp[k] += lp[k]
        self.text.append(chunk.text)
        self._offset += len(chunk.text)
        if not chunk.text and lp is None:
            return []
        return [self._obj(chunk.text, None, lp)]

    def usage(self) -> dict[str, Any]:
        return make_usage(self.engine_usage)

    def finish_chunks(self, include_usage: bool = False) -> list[dict[str, Any]]:
        out = [self._obj("", _finish(self.finish_reason), None)]
        if include_usage:
            u = self._obj("", None, None)
            u["choices"] = []
            u["usage"] = self.usage()
            out.append(u)
        return out

    def response(self) -> dict[str, Any]:
        r = self._obj("".join(self.text), _finish(self.finish_reason), self.lp if self.logprobs is not None else None)
        r["usage"] = self.usage()
        return r


def models_list(model_id: str, created: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``GET /v1/models`` body."""
    entry: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "bonsai"}
    if meta:
        entry["meta"] = meta
    return {"object": "list", "data": [entry]}


def prometheus(metrics: Sequence[tuple[str, str, str, float, dict[str, str] | None]]) -> str:
    """Prometheus text exposition: ``(name, type, help, value, labels)`` rows (same-name rows
    with different labels must be adjacent)."""
    lines: list[str] = []
    seen: set[str] = set()
    for name, kind, help_, value, labels in metrics:
        if name not in seen:
            seen.add(name)
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
        lab = ""
        if labels:
            lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        v = float(value)
        s = str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)
        lines.append(f"{name}{lab} {s}")
    return "\n".join(lines) + "\n"
