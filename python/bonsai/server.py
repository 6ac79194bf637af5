"""An OpenAI-compatible HTTP server (aiohttp) over a :class:`bonsai.Engine`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming over SSE or not),
``GET /v1/models``, ``GET /health`` (+ ``/v1/health``), ``GET /metrics`` (Prometheus),
``GET /v1/policy``, ``POST /tokenize``, ``POST /detokenize`` and a small chat page at ``/``.

Requests go through the engine's asyncio API (``Engine.agenerate``), so the event loop never
blocks; the engine queues concurrent requests. A client that disconnects cancels its request: the
disconnect is seen on the next write (or, with ``handler_cancellation=True``, at once) and the
generator is closed in ``finally``.

    >>> app = make_app(bonsai.Engine("model.gguf"))     # then aiohttp.web.run_app(app)
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from . import openai as oa

_WEBUI = Path(__file__).resolve().parent / "webui" / "index.html"

STATE: web.AppKey[_State] = web.AppKey("bonsai_state")


class _State:
    """Shared per-app state: the engine, its name, metrics counters and a token-bytes cache."""

    def __init__(self, engine: Any, model_name: str | None, default_max_tokens: int | None) -> None:
        self.engine = engine
        info = dict(getattr(engine, "info", {}) or {})
        self.info = info
        self.model_name = model_name or (Path(info["path"]).stem if info.get("path") else "bonsai")
        self.n_vocab: int | None = info.get("n_vocab")
        self.n_ctx: int | None = info.get("n_ctx")
        self.default_max_tokens = default_max_tokens or self.n_ctx or 256
        self.created = int(time.time())
        self.started = time.monotonic()
        self._tok_bytes: dict[int, bytes] = {}
        # metrics
        self.requests: dict[str, int] = {"chat": 0, "completions": 0}
        self.in_flight = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self.rejected = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.reasoning_tokens = 0
        self.prompt_seconds = 0.0
        self.generation_seconds = 0.0

    def token_bytes(self, tid: int) -> bytes:
        b = self._tok_bytes.get(tid)
        if b is None:
            b = self.engine.token_bytes(tid)
            self._tok_bytes[tid] = b
        return b

    def record_usage(self, usage: dict[str, Any] | None, reasoning_tokens: int = 0) -> None:
        u = usage or {}
        self.prompt_tokens += int(u.get("prompt_tokens", 0))
        self.cached_tokens += int(u.get("cached_tokens", 0))
        self.generated_tokens += int(u.get("completion_tokens", 0))
        self.prompt_seconds += float(u.get("prefill_seconds", 0.0))
        self.generation_seconds += float(u.get("decode_seconds", 0.0))
        self.reasoning_tokens += reasoning_tokens


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(obj, ensure_ascii=False, default=str), status=status, content_type="application/json"
    )


def _error_response(err: oa.RequestError) -> web.Response:
    return _json_response(err.body(), err.status)


def _map_engine_error(e: BaseException, prompt_param: str = "messages") -> oa.RequestError:
    """An engine exception as an OpenAI error (400 for bad requests, 500 otherwise)."""
    from . import _bonsai

    msg = str(e)
    if isinstance(e, _bonsai.ContextOverflowError):
        return oa.RequestError(msg, prompt_param, type="exceed_context_size_error")
    if isinstance(e, _bonsai.InvalidRequestError):
        return oa.RequestError(msg, oa.guess_param(msg))
    return oa.RequestError(msg or type(e).__name__, None, status=500, type="server_error")


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise oa.RequestError(f"the request body is not valid JSON: {e}") from None


def _gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


class _Generation:
    """One engine request: started (and validated) before any response byte is sent."""

    def __init__(self, state: _State, request: web.Request, prompt: str | list[int], gen: dict[str, Any]) -> None:
        self.state = state
        self.request = request
        gen = dict(gen)
        gen.setdefault("max_tokens", state.default_max_tokens)
        self.agen = state.engine.agenerate(prompt, **gen)
        self.first: Any = None
        self.done = False

    async def start(self) -> None:
        """Submits the request and waits for its first chunk; engine validation errors raise here."""
        try:
            self.first = await self.agen.__anext__()
        except StopAsyncIteration:
            raise oa.RequestError("the engine produced no output", status=500, type="server_error") from None

    async def chunks(self) -> AsyncIterator[Any]:
        c = self.first
        self.first = None
        if c is not None:
            yield c
            if c.finish_reason is not None:
                self.done = True
                return
        async for c in self.agen:
            if c.finish_reason is not None:
                self.done = True
            yield c
            if _gone(self.request):
                raise ConnectionResetError("client disconnected")

    async def close(self) -> None:
        """Cancels the engine request unless it finished (idempotent)."""
        await self.agen.aclose()


async def _run(
    request: web.Request,
    kind: str,
    prompt: str | list[int],
    gen: dict[str, Any],
    shaper: Any,
    stream: bool,
    include_usage: bool,
) -> web.StreamResponse:
    state = request.app[STATE]
    state.requests[kind] += 1
    try:
        g = _Generation(state, request, prompt, gen)
    except Exception as e:
        state.finished["error"] += 1
        raise _map_engine_error(e) from None
    state.in_flight += 1
    resp: web.StreamResponse | None = None
    outcome = "error"
    try:
        try:
            await g.start()
        except oa.RequestError:
            raise
        except Exception as e:  # engine validation (400) or failure (500)
            err = _map_engine_error(e, "messages" if kind == "chat" else "prompt")
            outcome = "error" if err.status >= 500 else "rejected"
            return _error_response(err)
        if not stream:
            try:
                async for c in g.chunks():
                    shaper.feed(c)
            except (ConnectionResetError, asyncio.CancelledError):
                raise
            except Exception as e:  # a failure mid-generation
                return _error_response(_map_engine_error(e))
            outcome = shaper.finish_reason or "stop"
            state.record_usage(shaper.engine_usage, getattr(shaper, "reasoning_tokens", 0))
            return _json_response(shaper.response())

        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        if hasattr(shaper, "role_chunk"):
            await resp.write(oa.sse(shaper.role_chunk()))
        try:
            async for c in g.chunks():
                for obj in shaper.feed(c):
                    await resp.write(oa.sse(obj))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # a failure mid-stream: an error event, then the end of the stream
            err = _map_engine_error(e)
            outcome = "error"
            await resp.write(oa.sse(err.body()))
            await resp.write_eof()
            return resp
        for obj in shaper.finish_chunks(include_usage):
            await resp.write(oa.sse(obj))
        await resp.write(oa.SSE_DONE)
        await resp.write_eof()
        outcome = shaper.finish_reason or "stop"
        state.record_usage(shaper.engine_usage, getattr(shaper, "reasoning_tokens", 0))
        return resp
    except asyncio.CancelledError:  # handler cancellation: the client went away
        outcome = "cancelled"
        raise
    except ConnectionResetError:  # a write (or the transport check) found the client gone
        outcome = "cancelled"
        return resp if resp is not None else web.Response(status=499)
    finally:
        if not g.done:
            await g.close()
        state.in_flight -= 1
        if outcome == "rejected":
            state.rejected += 1
        else:
            state.finished[outcome if outcome in state.finished else "stop"] += 1


# ---- handlers -------------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = oa.parse_chat_request(await _read_json(request), state.n_vocab)
    try:
        prompt = state.engine.apply_chat_template(
            req.messages,
            enable_thinking=req.enable_thinking,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs or None,
        )
    except Exception as e:
        err = _map_engine_error(e)
        if err.status == 400 and err.param is None:
            err.param = "messages"
        raise err from None
    shaper = oa.ChatShaper(
        model=req.model or state.model_name,
        thinking=oa.thinking_open(prompt),
        logprobs=req.logprobs,
        token_bytes=state.token_bytes,
    )
    return await _run(request, "chat", prompt, req.gen, shaper, req.stream, req.include_usage)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = oa.parse_completion_request(await _read_json(request), state.n_vocab)
    shaper = oa.CompletionShaper(
        model=req.model or state.model_name, logprobs=req.logprobs, token_bytes=state.token_bytes
    )
    return await _run(request, "completions", req.prompt, req.gen, shaper, req.stream, req.include_usage)


async def models(request: web.Request) -> web.Response:
    s = request.app[STATE]
    meta = {k: s.info[k] for k in ("n_ctx", "n_ctx_train", "n_vocab", "weight_type", "device") if k in s.info}
    return _json_response(oa.models_list(s.model_name, s.created, meta))


async def health(request: web.Request) -> web.Response:
    return _json_response({"status": "ok"})


async def policy(request: web.Request) -> web.Response:
    eng = request.app[STATE].engine
    try:
        p = getattr(eng, "policy", None)
    except Exception as e:  # a backing call failed: report, don't crash
        return _json_response(oa.error_body(str(e), "server_error", None, 500), 500)
    if p is None:
        return _json_response({"speculative": "unavailable"})
    return _json_response({"speculative": "available", **dict(p)})


def _spec_stats(eng: Any) -> dict[str, Any]:
    try:
        st = getattr(eng, "stats", None)
    except Exception:
        return {}
    return dict(st) if st else {}


async def metrics(request: web.Request) -> web.Response:
    s = request.app[STATE]
    rows: list[tuple[str, str, str, float, dict[str, str] | None]] = []
    for kind, n in s.requests.items():
        rows.append(("bonsai_requests_total", "counter", "Generation requests received.", n, {"endpoint": kind}))
    rows.append(("bonsai_requests_in_flight", "gauge", "Generation requests being served now.", s.in_flight, None))
    for reason, n in s.finished.items():
        rows.append(("bonsai_requests_finished_total", "counter", "Requests ended, by reason.", n, {"reason": reason}))
    rows += [
        ("bonsai_requests_rejected_total", "counter", "Requests the engine rejected (400).", s.rejected, None),
        ("bonsai_prompt_tokens_total", "counter", "Prompt tokens processed.", s.prompt_tokens, None),
        (
            "bonsai_prompt_cached_tokens_total",
            "counter",
            "Prompt tokens resumed from the prompt cache instead of prefilled.",
            s.cached_tokens,
            None,
        ),
        ("bonsai_generation_tokens_total", "counter", "Tokens generated.", s.generated_tokens, None),
        ("bonsai_reasoning_tokens_total", "counter", "Generated tokens inside <think>.", s.reasoning_tokens, None),
        ("bonsai_prompt_seconds_total", "counter", "Seconds spent in prefill.", s.prompt_seconds, None),
        ("bonsai_generation_seconds_total", "counter", "Seconds spent decoding.", s.generation_seconds, None),
        ("bonsai_uptime_seconds", "gauge", "Seconds since the server started.", time.monotonic() - s.started, None),
    ]
    for k, v in _spec_stats(s.engine).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if k in ("acceptance_rate", "tokens_per_round"):
            rows.append((f"bonsai_spec_{k}", "gauge", f"Speculative decoding: {k}.", v, None))
        else:
            rows.append((f"bonsai_spec_{k}_total", "counter", f"Speculative decoding: {k}.", v, None))
    return web.Response(
        text=oa.prometheus(rows), content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"}
    )


async def tokenize(request: web.Request) -> web.Response:
    s = request.app[STATE]
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise oa.RequestError("the request body must be a JSON object")
    text = body.get("content", body.get("prompt"))
    if not isinstance(text, str):
        raise oa.RequestError("content must be a string", "content")
    special = body.get("parse_special", True)
    if not isinstance(special, bool):
        raise oa.RequestError("parse_special must be a boolean", "parse_special")
    ids = s.engine.tokenize(text, special=special)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": s.n_ctx}
    if body.get("with_pieces"):
        out["pieces"] = [s.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
    return _json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    s = request.app[STATE]
    body = await _read_json(request)
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise oa.RequestError("tokens must be a list of token ids", "tokens")
    if s.n_vocab is not None and any(not 0 <= t < s.n_vocab for t in ids):
        raise oa.RequestError(f"tokens: ids must be in [0, {s.n_vocab})", "tokens")
    try:
        text = s.engine.detokenize(ids)
    except Exception as e:
        raise _map_engine_error(e) from None
    return _json_response({"content": text, "prompt": text})


async def index(request: web.Request) -> web.StreamResponse:
    if _WEBUI.exists():
        return web.FileResponse(_WEBUI, headers={"Content-Type": "text/html; charset=utf-8"})
    return web.Response(text="bonsai server: POST /v1/chat/completions", content_type="text/plain")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure as an OpenAI error body; the server keeps serving."""
    try:
        return await handler(request)
    except oa.RequestError as e:
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
            e.status, "server_error" if e.status >= 500 else "invalid_request_error"
        )
        msg = f"{e.reason}: {request.method} {request.path}"
        return _json_response(oa.error_body(msg, kind, None, e.status), e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # a bug or an engine failure: 500, logged, and keep serving
        print(f"bonsai server: {request.method} {request.path}: {type(e).__name__}: {e}", file=sys.stderr)
        return _json_response(oa.error_body(f"{type(e).__name__}: {e}", "server_error", None, 500), 500)


def make_app(
    engine: Any,
    model_name: str | None = None,
    *,
    default_max_tokens: int | None = None,
    client_max_size: int = 16 * 1024 * 1024,
) -> web.Application:
    """The aiohttp application serving ``engine`` (a :class:`bonsai.Engine`).

    Args:
        model_name: the id in ``/v1/models`` and responses (default: the model file's stem).
        default_max_tokens: the generation limit when a request sets none (default: the context size).
    """
    app = web.Application(middlewares=[_errors], client_max_size=client_max_size)
    app[STATE] = _State(engine, model_name, default_max_tokens)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/completions", completions)
    r.add_get("/v1/models", models)
    r.add_get("/models", models)
    r.add_get("/health", health)
    r.add_get("/v1/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/policy", policy)
    r.add_post("/tokenize", tokenize)
    r.add_post("/v1/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/v1/detokenize", detokenize)
    r.add_get("/", index)
    return app


def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str | None = None,
    *,
    default_max_tokens: int | None = None,
) -> None:
    """Serve ``engine`` until interrupted. Handler cancellation is on, so a client that disconnects
    cancels its request at once, even while it waits for the next token."""
    app = make_app(engine, model_name, default_max_tokens=default_max_tokens)
    name = app[STATE].model_name
    print(f"bonsai: serving {name} on http://{host}:{port} (OpenAI API at /v1, chat page at /)", file=sys.stderr)
    web.run_app(app, host=host, port=port, handler_cancellation=True, print=None)
