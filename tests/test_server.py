"""End-to-end tests of the OpenAI-compatible server on the tiny synthetic Q1_0 model (CPU)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import bonsai
from bonsai import openai as oa
from bonsai.server import make_app

CHAT = "/v1/chat/completions"
THINK_CLOSE_TOKEN = "</think>"


@pytest.fixture(scope="module")
def engine(tiny_q1):
    return bonsai.Engine(tiny_q1, device="cpu")


class _Server(TestServer):
    """aiohttp's TestServer always turns handler cancellation on; this one lets a test choose, so
    the default of ``web.run_app``/``AppRunner`` (off: a disconnect is seen on the next write) is
    tested too."""

    def __init__(self, app, handler_cancellation: bool = True):
        super().__init__(app)
        self._handler_cancellation = handler_cancellation

    async def _make_runner(self, **kwargs):
        kwargs["handler_cancellation"] = self._handler_cancellation
        return web.AppRunner(self.app, **kwargs)


def serve(engine, fn, handler_cancellation: bool = True):
    """Run ``await fn(client)`` against a fresh app on 127.0.0.1 (ephemeral port)."""

    async def main():
        async with TestClient(_Server(make_app(engine, "tiny"), handler_cancellation)) as client:
            return await fn(client)

    return asyncio.run(main())


def parse_sse(text: str) -> list:
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def msgs(text="hi"):
    return [{"role": "user", "content": text}]


def expected_chat(engine, messages, thinking=True, **kw):
    prompt = engine.apply_chat_template(messages, enable_thinking=thinking)
    return prompt, engine.complete(prompt, temperature=0, **kw)


# ---- chat -----------------------------------------------------------------------------------------


def test_chat_non_streaming_equals_engine(engine):
    m = msgs("Tell me about trees.")
    _, off = expected_chat(engine, m, thinking=False, max_tokens=12)
    prompt_on, on = expected_chat(engine, m, thinking=True, max_tokens=12)

    async def go(c):
        r1 = await c.post(
            CHAT,
            json={
                "model": "whatever",
                "messages": m,
                "max_tokens": 12,
                "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        r2 = await c.post(CHAT, json={"messages": m, "max_completion_tokens": 12, "temperature": 0})
        return r1.status, await r1.json(), r2.status, await r2.json()

    s1, off_r, s2, on_r = serve(engine, go)
    assert s1 == 200 and s2 == 200
    assert off_r["object"] == "chat.completion" and off_r["model"] == "whatever"
    (ch,) = off_r["choices"]
    assert ch["message"] == {"role": "assistant", "content": off.text}
    assert ch["finish_reason"] == off.finish_reason == "length"
    assert off_r["usage"]["prompt_tokens"] == off.usage["prompt_tokens"]
    assert (
        off_r["usage"]["completion_tokens"] == 12 and off_r["usage"]["total_tokens"] == 12 + off.usage["prompt_tokens"]
    )
    assert off_r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    # thinking on: the prompt opened <think>, so the text before </think> is reasoning
    assert oa.thinking_open(prompt_on)
    reasoning, content = oa.split_reasoning(on.text, True)
    msg = on_r["choices"][0]["message"]
    assert msg["reasoning_content"] == reasoning and msg["content"] == content
    assert on_r["model"] == "tiny"
    if THINK_CLOSE_TOKEN not in on.text:
        assert on_r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12


def test_reasoning_split_with_a_generated_close_tag(engine):
    """Bias ``</think>`` until the greedy output closes thinking mid-way, then check the split."""
    close_id = engine.tokenize(THINK_CLOSE_TOKEN)[0]
    m = msgs("Think first.")
    prompt = engine.apply_chat_template(m)
    chosen = None
    for bias in [x / 2 for x in range(2, 40)]:
        c = engine.complete(prompt, temperature=0, max_tokens=24, logit_bias={close_id: bias})
        ids = c.token_ids
        if close_id in ids and 2 <= ids.index(close_id) <= 16 and c.text.split(THINK_CLOSE_TOKEN, 1)[1].strip():
            chosen = (bias, c)
            break
    assert chosen is not None, "no bias closes thinking mid-way; the synthetic model changed?"
    bias, c = chosen
    body = {"messages": m, "max_tokens": 24, "temperature": 0, "logit_bias": {str(close_id): bias}}

    async def go(client):
        r = await client.post(CHAT, json=body)
        rs = await client.post(CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        return await r.json(), parse_sse(await rs.text())

    resp, events = serve(engine, go)
    reasoning, content = oa.split_reasoning(c.text, True)
    assert reasoning and content
    msg = resp["choices"][0]["message"]
    assert msg["reasoning_content"] == reasoning and msg["content"] == content
    n_reason = c.token_ids.index(close_id) + 1
    assert resp["usage"]["completion_tokens_details"]["reasoning_tokens"] == n_reason
    deltas = [e["choices"][0]["delta"] for e in events[1:-3]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == content
    # reasoning deltas all come before content deltas
    kinds = [k for d in deltas for k in d]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")
    assert events[-2]["usage"]["completion_tokens_details"]["reasoning_tokens"] == n_reason


def test_chat_streaming_shapes_and_usage(engine):
    m = msgs("Stream please.")
    _, exp = expected_chat(engine, m, thinking=False, max_tokens=10)

    async def go(c):
        body = {
            "messages": m,
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        r1 = await c.post(CHAT, json={**body, "stream_options": {"include_usage": True}})
        r2 = await c.post(CHAT, json=body)
        return r1.status, r1.headers["Content-Type"], await r1.text(), await r2.text()

    status, ctype, t1, t2 = serve(engine, go)
    assert status == 200 and ctype.startswith("text/event-stream")
    ev = parse_sse(t1)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    body = chunks[1:-2]
    assert body and all(c["choices"][0]["finish_reason"] is None for c in body)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == exp.text
    assert all("reasoning_content" not in c["choices"][0]["delta"] for c in body)
    fin = chunks[-2]
    assert fin["choices"][0]["delta"] == {} and fin["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    u = chunks[-1]
    assert u["choices"] == [] and u["usage"]["completion_tokens"] == 10
    assert u["usage"]["prompt_tokens"] == exp.usage["prompt_tokens"]
    # without include_usage: no usage chunk; the finish chunk comes right before [DONE]
    ev2 = parse_sse(t2)
    assert ev2[-1] == "[DONE]" and ev2[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"] for e in ev2[:-1])


def test_chat_logprobs(engine):
    m = msgs("lp")
    _, exp = expected_chat(engine, m, max_tokens=6, logprobs=3)

    async def go(c):
        body = {"messages": m, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
        r = await c.post(CHAT, json=body)
        rs = await c.post(CHAT, json={**body, "stream": True})
        return await r.json(), parse_sse(await rs.text())

    resp, events = serve(engine, go)
    content = resp["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx(exp.logprobs)
    assert [bytes(e["bytes"]) for e in content] == [engine.token_bytes(t) for t in exp.token_ids]
    for e in content:
        assert len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])  # greedy: chosen = best
    streamed = [x for ev in events[:-1] for x in ((ev["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == content


def test_stop_string(engine):
    m = msgs("stop test")
    prompt, full = expected_chat(engine, m, thinking=False, max_tokens=16)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop
    exp = engine.complete(prompt, temperature=0, max_tokens=16, stop=[stop])
    assert exp.finish_reason == "stop"
    body = {
        "messages": m,
        "max_tokens": 16,
        "temperature": 0,
        "stop": stop,
        "chat_template_kwargs": {"enable_thinking": False},
    }

    async def go(c):
        r = await c.post(CHAT, json=body)
        rs = await c.post(CHAT, json={**body, "stream": True})
        return await r.json(), parse_sse(await rs.text())

    resp, ev = serve(engine, go)
    assert resp["choices"][0]["message"]["content"] == exp.text
    assert stop not in exp.text
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-2]) == exp.text
    assert ev[-2]["choices"][0]["finish_reason"] == "stop"


# ---- completions ----------------------------------------------------------------------------------


def test_completions(engine):
    prompt = "The small tree"
    exp = engine.complete(prompt, temperature=0, max_tokens=8, logprobs=2)
    ids = engine.tokenize(prompt)

    async def go(c):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2}
        r = await c.post("/v1/completions", json=body)
        rt = await c.post("/v1/completions", json={**body, "prompt": ids})
        rs = await c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        return await r.json(), await rt.json(), parse_sse(await rs.text())

    resp, resp_ids, ev = serve(engine, go)
    for r in (resp, resp_ids):
        assert r["object"] == "text_completion"
        (ch,) = r["choices"]
        assert ch["text"] == exp.text and ch["finish_reason"] == "length"
        assert ch["logprobs"]["token_logprobs"] == pytest.approx(exp.logprobs)
        assert all(len(t) == 2 for t in ch["logprobs"]["top_logprobs"])
        assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 8
    assert ev[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == exp.text
    assert ev[-3]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 8


# ---- other endpoints ------------------------------------------------------------------------------


def test_models_health_metrics_policy_tokenize(engine):
    text = "hello <|im_start|>world"

    async def go(c):
        out = {}
        for path in ("/v1/models", "/health", "/v1/health", "/v1/policy"):
            r = await c.get(path)
            out[path] = (r.status, await r.json())
        await c.post(CHAT, json={"messages": msgs(), "max_tokens": 3, "temperature": 0})
        await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
        r = await c.get("/metrics")
        out["/metrics"] = (r.status, r.headers["Content-Type"], await r.text())
        r = await c.post("/tokenize", json={"content": text, "with_pieces": True})
        tok = await r.json()
        r = await c.post("/detokenize", json={"tokens": tok["tokens"]})
        out["tok"] = (tok, await r.json())
        r = await c.get("/")
        out["/"] = (r.status, r.headers["Content-Type"], await r.text())
        return out

    out = serve(engine, go)
    st, models = out["/v1/models"]
    assert st == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["object"] == "model"
    assert models["data"][0]["meta"]["n_ctx"] == engine.info["n_ctx"]
    assert out["/health"] == (200, {"status": "ok"}) and out["/v1/health"] == (200, {"status": "ok"})
    st, pol = out["/v1/policy"]
    assert st == 200
    if engine.policy is None:
        assert pol == {"speculative": "unavailable"}
    st, ctype, metrics = out["/metrics"]
    assert st == 200 and ctype.startswith("text/plain")
    vals = dict(re.findall(r"^(\S+) (\S+)$", metrics, re.M))
    assert vals['bonsai_requests_total{endpoint="chat"}'] == "1"
    assert vals['bonsai_requests_total{endpoint="completions"}'] == "1"
    assert vals["bonsai_requests_in_flight"] == "0"
    assert vals["bonsai_generation_tokens_total"] == "5"
    assert int(vals["bonsai_prompt_tokens_total"]) > 1
    assert float(vals["bonsai_generation_seconds_total"]) > 0
    assert "# TYPE bonsai_prompt_seconds_total counter" in metrics
    tok, detok = out["tok"]
    assert tok["tokens"] == engine.tokenize(text) and tok["count"] == len(tok["tokens"])
    assert "<|im_start|>" in tok["pieces"]
    assert detok["content"] == text
    st, ctype, html = out["/"]
    assert st == 200 and ctype.startswith("text/html") and "/v1/chat/completions" in html


def cpu_resume(eng, turn1, turn2):
    """Prompt tokens the CPU engine's prompt cache resumes for chat ``turn2`` after ``turn1`` (no
    thinking): the longest boundary the first prompt's prefill saved — its last 512-token chunk start
    or its last multiple of 64 (the CPU prefill granule) — inside the prefix the two prompts share."""
    ids = [eng.tokenize(eng.apply_chat_template(t, enable_thinking=False)) for t in (turn1, turn2)]
    common = next((i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids)))
    n1 = len(ids[0])
    fits = [b for b in (512 * ((n1 - 1) // 512), 64 * ((n1 - 1) // 64)) if 0 < b <= common and b < len(ids[1])]
    return max(fits, default=0)


def test_multi_turn_chat_resumes_from_the_prompt_cache(tiny_q1):
    """The second turn of a conversation with a long system prompt resumes the first turn's prompt
    (usage.prompt_tokens_details.cached_tokens, the metrics counter) and answers as an engine
    without a prompt cache does."""
    cached = bonsai.Engine(tiny_q1, device="cpu")
    fresh = bonsai.Engine(tiny_q1, device="cpu", prompt_cache=False)
    system = {"role": "system", "content": " ".join(f"rule {i}: be brief." for i in range(150))}
    turn1 = [system, {"role": "user", "content": "hi"}]
    n1 = len(fresh.tokenize(fresh.apply_chat_template(turn1, enable_thinking=False)))
    assert n1 > 512, n1

    async def go(c):
        out = []
        body = {"max_tokens": 6, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
        r = await (await c.post(CHAT, json={**body, "messages": turn1})).json()
        out.append(r)
        turn2 = [*turn1, r["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        out.append(await (await c.post(CHAT, json={**body, "messages": turn2})).json())
        out.append(turn2)
        out.append(await (await c.get("/metrics")).text())
        return out

    r1, r2, turn2, metrics = serve(cached, go)
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    resumed = cpu_resume(fresh, turn1, turn2)
    assert resumed >= 512, resumed
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == resumed
    _, exp = expected_chat(fresh, turn2, thinking=False, max_tokens=6)
    assert r2["choices"][0]["message"]["content"] == exp.text
    assert r2["usage"]["prompt_tokens"] == exp.usage["prompt_tokens"]
    vals = dict(re.findall(r"^(\S+) (\S+)$", metrics, re.M))
    assert vals["bonsai_prompt_cached_tokens_total"] == str(resumed)


def test_interleaved_conversations_each_resume_their_own_history(tiny_q1):
    """Two conversations with different long system prompts, alternating through the server: each
    second turn resumes its own first turn's prompt from the prompt cache's stash and answers as an
    engine without a cache does; with ``prompt_cache_entries=0`` the second turns start over."""
    fresh = bonsai.Engine(tiny_q1, device="cpu", prompt_cache=False)
    convs = []
    for who in ("an owl", "a fox"):
        system = {"role": "system", "content": " ".join(f"rule {i}: speak as {who}." for i in range(120))}
        convs.append([system, {"role": "user", "content": "hi"}])
    n1 = [len(fresh.tokenize(fresh.apply_chat_template(c, enable_thinking=False))) for c in convs]
    assert min(n1) > 512, n1
    body = {"max_tokens": 5, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}

    async def go(c):
        firsts = [await (await c.post(CHAT, json={**body, "messages": m})).json() for m in convs]
        seconds, turns = [], []
        for m, r in zip(convs, firsts, strict=True):
            turn2 = [*m, r["choices"][0]["message"], {"role": "user", "content": "and then?"}]
            turns.append(turn2)
            seconds.append(await (await c.post(CHAT, json={**body, "messages": turn2})).json())
        return firsts, seconds, turns

    for entries in (4, 0):
        cached = bonsai.Engine(tiny_q1, device="cpu", prompt_cache_entries=entries)
        firsts, seconds, turns = serve(cached, go)
        for conv, r1, r2, turn2 in zip(convs, firsts, seconds, turns, strict=True):
            assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            want = cpu_resume(fresh, conv, turn2) if entries else 0
            assert not entries or want >= 512, want
            assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == want, (entries, r2["usage"])
            _, exp = expected_chat(fresh, turn2, thinking=False, max_tokens=5)
            assert r2["choices"][0]["message"]["content"] == exp.text


# ---- errors ---------------------------------------------------------------------------------------


def test_errors_are_openai_bodies_and_server_keeps_serving(engine):
    n_ctx = engine.info["n_ctx"]

    async def go(c):
        out = []

        async def req(method, path, **kw):
            r = await c.request(method, path, **kw)
            out.append((path, r.status, await r.json()))

        await req("POST", CHAT, data=b"{not json", headers={"Content-Type": "application/json"})
        await req("POST", CHAT, json={"messages": msgs(), "n": 2})
        await req("POST", CHAT, json={"messages": msgs(), "temperature": -1})
        await req("POST", CHAT, json={"messages": msgs(), "temperature": "hot", "stream": True})
        await req("POST", "/v1/completions", json={"prompt": [1] * (n_ctx + 10), "max_tokens": 2})
        await req("POST", "/v1/completions", json={"prompt": [1] * (n_ctx + 10), "max_tokens": 2, "stream": True})
        await req("POST", CHAT, json={"messages": msgs("word " * (n_ctx + 10))})
        await req("POST", CHAT, json={"messages": [{"role": "assistant", "content": "no user"}]})
        await req("POST", "/v1/completions", json={"prompt": "x", "stop_token_ids": [10**6]})
        await req("GET", "/v1/nope")
        await req("GET", CHAT)
        await req("POST", CHAT, json={"messages": msgs(), "max_tokens": 2, "temperature": 0})
        await req("GET", "/health")
        return out

    out = serve(engine, go)
    for _path, status, body in out[:-2]:
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == status and body["error"]["message"]
    (_, s, b) = out[0]
    assert s == 400 and "JSON" in b["error"]["message"]
    assert out[1][1] == 400 and out[1][2]["error"]["param"] == "n"
    assert out[2][1] == 400 and out[2][2]["error"]["param"] == "temperature"
    assert out[3][1] == 400 and out[3][2]["error"]["param"] == "temperature"
    for i, param in ((4, "prompt"), (5, "prompt"), (6, "messages")):
        assert out[i][1] == 400, out[i]
        assert out[i][2]["error"]["type"] == "exceed_context_size_error", out[i]
        assert out[i][2]["error"]["param"] == param
    assert out[7][1] == 400 and out[7][2]["error"]["param"] == "messages"
    assert out[8][1] == 400 and out[8][2]["error"]["param"] == "stop_token_ids"
    assert out[9][1] == 404 and out[9][2]["error"]["type"] == "not_found_error"
    assert out[10][1] == 405
    assert out[11][1] == 200 and out[11][2]["choices"][0]["finish_reason"] == "length"
    assert out[12][1:] == (200, {"status": "ok"})


def test_engine_failure_is_500_and_server_keeps_serving(engine):
    class Broken:
        info = engine.info

        def __getattr__(self, name):
            return getattr(engine, name)

        def agenerate(self, prompt, **kw):
            raise bonsai.EngineError("backend exploded")

    async def main():
        async with TestClient(TestServer(make_app(Broken()))) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            r2 = await c.get("/health")
            m = await (await c.get("/metrics")).text()
            return r.status, await r.json(), r2.status, m

    status, body, h, m = asyncio.run(main())
    assert status == 500 and body["error"]["type"] == "server_error" and "exploded" in body["error"]["message"]
    assert h == 200
    assert "bonsai_requests_in_flight 0" in m and 'bonsai_requests_finished_total{reason="error"} 1' in m


def test_engine_failure_mid_stream_sends_an_error_event(engine):
    class FailsLater:
        info = engine.info

        def __getattr__(self, name):
            return getattr(engine, name)

        failures = 2

        async def agenerate(self, prompt, **kw):
            n = 0
            async for c in engine.agenerate(prompt, **kw):
                yield c
                n += 1
                if n == 2 and FailsLater.failures:
                    FailsLater.failures -= 1
                    raise bonsai.EngineError("device lost")

    async def main():
        async with TestClient(TestServer(make_app(FailsLater()))) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True})
            text = await r.text()
            r1 = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
            b1 = await r1.json()
            r2 = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            m = await (await c.get("/metrics")).text()
            return r.status, text, (r1.status, b1), r2.status, m

    status, text, (s1, b1), status2, m = asyncio.run(main())
    assert s1 == 500 and b1["error"]["type"] == "server_error" and "device lost" in b1["error"]["message"]
    assert 'bonsai_requests_finished_total{reason="error"} 2' in m and "bonsai_requests_in_flight 0" in m
    assert status == 200
    ev = parse_sse(text)
    assert ev[-1]["error"]["type"] == "server_error" and "device lost" in ev[-1]["error"]["message"]
    assert "[DONE]" not in ev and all("choices" in e for e in ev[:-1])
    assert status2 == 200


# ---- concurrency and disconnects ------------------------------------------------------------------


def test_concurrent_streaming_clients(engine):
    prompts = [f"client {i} says {'hello ' * i}" for i in range(5)]
    expected = [
        expected_chat(engine, msgs(p), thinking=False, max_tokens=20 + 3 * i)[1].text for i, p in enumerate(prompts)
    ]

    async def one(c, i):
        body = {
            "messages": msgs(prompts[i]),
            "max_tokens": 20 + 3 * i,
            "temperature": 0,
            "stream": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        r = await c.post(CHAT, json=body)
        ev = parse_sse(await r.text())
        assert ev[-1] == "[DONE]"
        return "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"])

    async def go(c):
        return await asyncio.gather(*(one(c, i) for i in range(5)))

    assert serve(engine, go) == expected


@pytest.mark.parametrize("handler_cancellation", [False, True])
def test_disconnect_cancels_request(engine, handler_cancellation):
    other_prompt = "the concurrent client"
    exp_other = expected_chat(engine, msgs(other_prompt), thinking=False, max_tokens=24)[1].text
    long_body = {
        "messages": msgs("a long one"),
        "max_tokens": 3000,  # ~10 s of decoding on the tiny model if it were not cancelled
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    async def read_other(c):
        r = await c.post(
            CHAT,
            json={
                "messages": msgs(other_prompt),
                "max_tokens": 24,
                "temperature": 0,
                "stream": True,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        ev = parse_sse(await r.text())
        return "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"])

    async def go(c):
        r = await c.post(CHAT, json=long_body)
        assert r.status == 200
        other = asyncio.create_task(read_other(c))  # queued behind the long request
        n = 0
        while n < 2:
            line = await r.content.readline()
            if line.startswith(b"data: "):
                n += 1
        r.close()  # disconnect mid-stream
        t0 = time.monotonic()
        other_text = await asyncio.wait_for(other, 30)
        q = await c.post(CHAT, json={"messages": msgs(), "max_tokens": 4, "temperature": 0})
        assert q.status == 200
        await q.json()
        dt = time.monotonic() - t0
        for _ in range(100):  # the cancelled handler finishes its bookkeeping
            m = await (await c.get("/metrics")).text()
            if 'bonsai_requests_finished_total{reason="cancelled"} 1' in m:
                break
            await asyncio.sleep(0.02)
        return other_text, dt, m

    other_text, dt, metrics = serve(engine, go, handler_cancellation=handler_cancellation)
    assert other_text == exp_other
    assert dt < 3.0, f"the engine was still busy with the disconnected request ({dt:.1f}s)"
    assert 'bonsai_requests_finished_total{reason="cancelled"} 1' in metrics
    assert "bonsai_requests_in_flight 0" in metrics


@pytest.mark.parametrize("handler_cancellation", [False, True])
def test_non_streaming_client_timeout_cancels_request(engine, handler_cancellation):
    import aiohttp

    body = {"messages": msgs("long"), "max_tokens": 3000, "ignore_eos": True, "temperature": 0}

    async def go(c):
        with pytest.raises(asyncio.TimeoutError):
            await c.post(CHAT, json=body, timeout=aiohttp.ClientTimeout(total=0.3))
        t0 = time.monotonic()
        r = await c.post(CHAT, json={"messages": msgs(), "max_tokens": 4, "temperature": 0})
        assert r.status == 200
        await r.json()
        dt = time.monotonic() - t0
        for _ in range(100):
            m = await (await c.get("/metrics")).text()
            if 'bonsai_requests_finished_total{reason="cancelled"} 1' in m:
                break
            await asyncio.sleep(0.02)
        return dt, m

    dt, metrics = serve(engine, go, handler_cancellation=handler_cancellation)
    assert dt < 3.0, f"the engine was still busy with the abandoned request ({dt:.1f}s)"
    assert 'bonsai_requests_finished_total{reason="cancelled"} 1' in metrics


def test_openai_client(engine):
    openai = pytest.importorskip("openai")
    m = msgs("official client")
    _, exp = expected_chat(engine, m, thinking=False, max_tokens=8)

    async def go(c):
        client = openai.AsyncOpenAI(base_url=str(c.make_url("/v1")), api_key="none")
        r = await client.chat.completions.create(
            model="tiny",
            messages=m,
            max_tokens=8,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=m,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        chunks = [ch async for ch in stream]
        parts = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        think = await client.chat.completions.create(model="tiny", messages=m, max_tokens=4, temperature=0)
        assert think.choices[0].message.model_extra["reasoning_content"]
        cmpl = await client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0)
        assert cmpl.choices[0].text == engine.complete("abc", max_tokens=3, temperature=0).text
        try:
            await client.chat.completions.create(model="tiny", messages=m, n=2)
        except openai.BadRequestError as e:
            err = e
        return r, "".join(parts), err

    r, streamed, err = serve(engine, go)
    assert r.choices[0].message.content == exp.text == streamed
    assert r.usage.completion_tokens == 8
    assert err.status_code == 400


def test_speculative_policy_metrics_and_usage(tiny_q1, engine):
    """With an n-gram drafter the server exposes the engine's policy, speculative counters in
    /metrics and per-request speculative usage; output is the same as plain decoding."""
    spec = bonsai.Engine(tiny_q1, device="cpu", draft="ngram", speculative="always")
    prompt = "one two three one two three one two"
    exp = engine.complete(prompt, max_tokens=16, temperature=0).text

    async def go(c):
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0})
        body = await r.json()
        pol = await (await c.get("/v1/policy")).json()
        m = await (await c.get("/metrics")).text()
        return body, pol, m

    async def main():
        async with TestClient(TestServer(make_app(spec))) as c:
            return await go(c)

    body, pol, metrics = asyncio.run(main())
    assert body["choices"][0]["text"] == exp
    assert pol["speculative"] == "available" and pol["kind"] == "ngram" and pol["mode"] == "always"
    sp = body["usage"]["speculative"]
    stats = spec.stats
    vals = dict(re.findall(r"^(\S+) (\S+)$", metrics, re.M))
    assert int(vals["bonsai_spec_drafted_tokens_total"]) == stats["drafted_tokens"] == sp["drafted_tokens"]
    assert int(vals["bonsai_spec_accepted_tokens_total"]) == stats["accepted_tokens"] == sp["accepted_tokens"]
    assert int(vals["bonsai_spec_plain_tokens_total"]) == stats["plain_tokens"] == sp["plain_tokens"] > 0
