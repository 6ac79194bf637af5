"""Pure tests of bonsai.openai: request validation and response/chunk shapes, no engine."""

from __future__ import annotations

import itertools
import json
import random
from types import SimpleNamespace

import pytest

from bonsai import openai as oa

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return oa.parse_chat_request({"messages": MSG, **kw}, n_vocab=100)


def bad_chat(param, **kw):
    with pytest.raises(oa.RequestError) as ei:
        oa.parse_chat_request({"messages": MSG, **kw} if "messages" not in kw else kw, n_vocab=100)
    assert ei.value.param == param, ei.value.message
    assert ei.value.status == 400
    assert ei.value.body() == {
        "error": {"message": ei.value.message, "type": "invalid_request_error", "param": param, "code": 400}
    }
    return ei.value


def chunk(text="", ids=(), lps=(), top=(), finish=None, usage=None):
    return SimpleNamespace(
        text=text,
        token_ids=list(ids),
        logprobs=list(lps),
        top_logprobs=[list(t) for t in top],
        finish_reason=finish,
        usage=usage,
    )


# ---- request parsing ------------------------------------------------------------------------------


def test_chat_defaults_pass_only_what_was_set():
    r = chat()
    assert r.gen == {} and not r.stream and not r.include_usage and r.enable_thinking and not r.logprobs
    assert r.messages == [{"role": "user", "content": "hi"}]


def test_chat_sampling_fields_map_to_engine_kwargs():
    r = chat(
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        seed=-1,
        stop="END",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repeat_penalty=1.1,
        logit_bias={"3": 5, "4": -100},
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
        chat_template_kwargs={"enable_thinking": False, "foo": 1},
        ignore_eos=True,
    )
    assert r.gen == {
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 0,
        "min_p": 0.1,
        "seed": (1 << 64) - 1,
        "stop": ["END"],
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {3: 5.0, 4: -100.0},
        "logprobs": 3,
        "ignore_eos": True,
    }
    assert r.stream and r.include_usage and r.logprobs and r.top_logprobs == 3
    assert r.enable_thinking is False and r.chat_template_kwargs == {"foo": 1}


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=9).gen["max_tokens"] == 9
    assert chat(stop=["a", "", "b"]).gen["stop"] == ["a", "b"]


@pytest.mark.parametrize(
    "param,kw",
    [
        ("temperature", {"temperature": -1}),
        ("temperature", {"temperature": "hot"}),
        ("temperature", {"temperature": True}),
        ("top_p", {"top_p": 0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": 2.5}),
        ("min_p", {"min_p": 2}),
        ("presence_penalty", {"presence_penalty": 3}),
        ("frequency_penalty", {"frequency_penalty": "x"}),
        ("repeat_penalty", {"repeat_penalty": 0}),
        ("seed", {"seed": 1.5}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_completion_tokens", {"max_completion_tokens": "10"}),
        ("n", {"n": 2}),
        ("stop", {"stop": 3}),
        ("stop", {"stop": ["a", 1]}),
        ("stop", {"stop": ["x"] * 17}),
        ("logit_bias", {"logit_bias": [1, 2]}),
        ("logit_bias", {"logit_bias": {"abc": 1}}),
        ("logit_bias", {"logit_bias": {"100": 1}}),
        ("logit_bias", {"logit_bias": {"1": 101}}),
        ("logprobs", {"logprobs": 1}),
        ("top_logprobs", {"top_logprobs": 2}),
        ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
        ("stream", {"stream": "yes"}),
        ("stream_options", {"stream_options": {"include_usage": 1}}),
        ("chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": "no"}}),
        ("chat_template_kwargs", {"chat_template_kwargs": []}),
        ("tools", {"tools": "x"}),
        ("response_format", {"response_format": {"type": "json_object"}}),
        ("model", {"model": 3}),
    ],
)
def test_chat_validation_names_the_field(param, kw):
    e = bad_chat(param, **kw)
    assert param.split("_")[0] in e.message


@pytest.mark.parametrize(
    "messages",
    [None, [], "hi", [1], [{"role": "robot", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 3}]],
)
def test_bad_messages(messages):
    bad_chat("messages", messages=messages)


def test_message_normalisation():
    r = oa.parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ]
        }
    )
    assert r.messages[0] == {"role": "system", "content": "be brief"}
    assert r.messages[2]["content"] == ""
    assert r.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert r.messages[3]["tool_call_id"] == "c1"
    e = bad_chat("messages", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert "image_url" in e.message


def test_body_must_be_an_object():
    for body in ([], "x", 3, None):
        with pytest.raises(oa.RequestError):
            oa.parse_chat_request(body)
        with pytest.raises(oa.RequestError):
            oa.parse_completion_request(body)


def test_completion_request():
    r = oa.parse_completion_request({"prompt": "abc", "max_tokens": 3, "logprobs": 2, "stream": True}, 100)
    assert r.prompt == "abc" and r.gen == {"max_tokens": 3, "logprobs": 2} and r.logprobs == 2 and r.stream
    assert oa.parse_completion_request({"prompt": [1, 2, 3]}, 100).prompt == [1, 2, 3]
    assert oa.parse_completion_request({"prompt": ["x"]}).prompt == "x"
    assert oa.parse_completion_request({"prompt": [[5, 6]]}).prompt == [5, 6]
    assert oa.parse_completion_request({"prompt": "x"}).logprobs is None
    assert oa.parse_completion_request({"prompt": "x", "logprobs": 0}).logprobs == 0
    for body, param in [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 200]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": "x", "n": 3}, "n"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ]:
        with pytest.raises(oa.RequestError) as ei:
            oa.parse_completion_request(body, 100)
        assert ei.value.param == param, (body, ei.value.message)


def test_guess_param():
    assert oa.guess_param("invalid request: temperature: -1 is outside [0, inf)") == "temperature"
    assert oa.guess_param("invalid request: logit_bias: token id 5000 is outside [0, 1536)") == "logit_bias"
    assert oa.guess_param("prompt token id 9 is out of range") == "prompt"
    assert oa.guess_param("something else") is None


# ---- reasoning split ------------------------------------------------------------------------------


def test_thinking_open():
    assert oa.thinking_open("<|im_start|>assistant\n<think>\n")
    assert not oa.thinking_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not oa.thinking_open("<|im_start|>assistant\n")
    assert oa.thinking_open("<think>a</think> x <think>\n")


@pytest.mark.parametrize(
    "text,thinking,expected",
    [
        ("plan\n</think>\n\nanswer", True, ("plan", "answer")),
        ("\nplan a\nplan b\n\n</think>\n\nans</think>wer\n", True, ("plan a\nplan b", "ans</think>wer\n")),
        ("no close yet", True, ("no close yet", "")),
        ("ends in partial </thi", True, ("ends in partial </thi", "")),
        ("</think>", True, ("", "")),
        ("plain</think> text", False, ("", "plain</think> text")),
        ("  leading", False, ("", "  leading")),
    ],
)
def test_split_reasoning(text, thinking, expected):
    assert oa.split_reasoning(text, thinking) == expected


def test_splitter_streaming_equals_whole_at_every_split():
    rng = random.Random(0)
    texts = [
        "plan\n</think>\n\nanswer",
        "\n a </thin k> b \n</think>  \n c </think> d \n",
        "x</think>",
        "reason only  \n ",
        "</",
    ]
    for text in texts:
        whole = oa.split_reasoning(text, True)
        cuts_all = [sorted(rng.sample(range(1, len(text)), k)) for k in range(min(4, len(text) - 1)) for _ in range(20)]
        cuts_all += [[i] for i in range(1, len(text))]
        for cuts in cuts_all:
            pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
            s = oa.ReasoningSplitter(True)
            r, c = "", ""
            for p in pieces:
                dr, dc = s.feed(p)
                r, c = r + dr, c + dc
            dr, dc = s.flush()
            assert (r + dr, c + dc) == whole, (text, pieces)


def test_splitter_holds_partial_close_tag():
    s = oa.ReasoningSplitter(True)
    assert s.feed("abc</th") == ("abc", "")
    assert s.in_reasoning
    assert s.feed("ink>\n\nX") == ("", "X")
    assert not s.in_reasoning


# ---- response shapes ------------------------------------------------------------------------------

TB = {1: b"a", 2: b"</think>", 3: b"b", 4: b"\xe4\xbd", 5: b"\xa0"}
USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "prefill_seconds": 0.1, "decode_seconds": 0.2}


def _chat_stream(shaper):
    chunks = [
        chunk("a", [1], [-0.5], [[(1, -0.5), (3, -1.5)]]),
        chunk("</think>", [2], [-0.1], [[(2, -0.1), (1, -3.0)]]),
        chunk("", [4], [-0.2], [[(4, -0.2), (1, -2.0)]]),  # text held back (partial UTF-8)
        chunk("你", [5], [-0.3], [[(5, -0.3), (3, -2.0)]]),
        chunk("", finish="length", usage=USAGE),
    ]
    out = [shaper.role_chunk()]
    for c in chunks:
        out += shaper.feed(c)
    return out


def test_chat_stream_shapes():
    sh = oa.ChatShaper(model="m", thinking=True, logprobs=True, token_bytes=TB.__getitem__, id="chatcmpl-x", created=7)
    out = _chat_stream(sh) + sh.finish_chunks(include_usage=True)
    for o in out:
        assert o["id"] == "chatcmpl-x" and o["object"] == "chat.completion.chunk" and o["created"] == 7
        assert o["model"] == "m" and "system_fingerprint" in o
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [o["choices"][0]["delta"] for o in out[1:-2]]
    assert deltas == [{"reasoning_content": "a"}, {"content": "你"}]  # no empty deltas mid-stream
    # logprobs: each token exactly once, in order, attached to the next emitted chunk
    lps = [e for o in out[1:-2] for e in (o["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert len(out[2]["choices"][0]["logprobs"]["content"]) == 3
    assert [e["bytes"] for e in lps] == [list(TB[i]) for i in (1, 2, 4, 5)]
    assert lps[0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]},
            {"token": "b", "logprob": -1.5, "bytes": [98]},
        ],
    }
    fin = out[-2]
    assert fin["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert all(o["usage"] is None for o in out[:-1])
    last = out[-1]
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == 5 and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == 9
    assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}


def test_chat_response_matches_stream():
    sh = oa.ChatShaper(model="m", thinking=True, logprobs=True, token_bytes=TB.__getitem__, id="i", created=1)
    _chat_stream(sh)
    r = sh.response()
    assert r["object"] == "chat.completion" and r["id"] == "i" and r["model"] == "m"
    (c,) = r["choices"]
    assert c["message"] == {"role": "assistant", "content": "你", "reasoning_content": "a"}
    assert c["finish_reason"] == "length"
    assert len(c["logprobs"]["content"]) == 4
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
    # without thinking and logprobs: no reasoning_content key, logprobs null, finish "stop"
    sh = oa.ChatShaper(model="m", thinking=False)
    sh.feed(chunk("hey", [1], [-1.0]))
    sh.feed(chunk("", finish="stop", usage=USAGE))
    r = sh.response()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    assert r["choices"][0]["logprobs"] is None and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_completion_shapes():
    sh = oa.CompletionShaper(model="m", logprobs=1, token_bytes=TB.__getitem__, id="cmpl-1", created=3)
    out = []
    for c in [
        chunk("a", [1], [-0.5], [[(1, -0.5)]]),
        chunk("b", [3], [-0.25], [[(3, -0.25)]]),
        chunk("", finish="stop", usage=USAGE),
    ]:
        out += sh.feed(c)
    out += sh.finish_chunks(include_usage=True)
    assert [o["object"] for o in out] == ["text_completion"] * 4
    assert [o["choices"][0]["text"] for o in out[:3]] == ["a", "b", ""]
    assert out[1]["choices"][0]["logprobs"] == {
        "tokens": ["b"],
        "token_logprobs": [-0.25],
        "top_logprobs": [{"b": -0.25}],
        "text_offset": [1],
    }
    assert out[2]["choices"][0]["finish_reason"] == "stop"
    assert out[3]["choices"] == [] and out[3]["usage"]["total_tokens"] == 9
    r = sh.response()
    assert r["choices"][0]["text"] == "ab"
    assert r["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert r["choices"][0]["logprobs"]["tokens"] == ["a", "b"]
    assert r["usage"]["prompt_tokens"] == 5


def test_sse_and_misc():
    assert oa.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert oa.SSE_DONE == b"data: [DONE]\n\n"
    assert oa.error_body("m", "t", "p", 400) == {"error": {"message": "m", "type": "t", "param": "p", "code": 400}}
    m = oa.models_list("bonsai", 5, {"n_ctx": 4})
    assert m == {
        "object": "list",
        "data": [{"id": "bonsai", "object": "model", "created": 5, "owned_by": "bonsai", "meta": {"n_ctx": 4}}],
    }
    u = oa.make_usage({"prompt_tokens": 2, "completion_tokens": 3, "speculative": {"accepted_tokens": 1}}, 1)
    assert u["total_tokens"] == 5 and u["speculative"] == {"accepted_tokens": 1}
    assert json.loads(json.dumps(u)) == u


def test_prometheus_text():
    text = oa.prometheus(
        [
            ("x_total", "counter", "X.", 3, {"k": "a"}),
            ("x_total", "counter", "X.", 4, {"k": "b"}),
            ("y", "gauge", "Y.", 0.5, None),
        ]
    )
    assert text == (
        "# HELP x_total X.\n# TYPE x_total counter\n"
        'x_total{k="a"} 3\nx_total{k="b"} 4\n'
        "# HELP y Y.\n# TYPE y gauge\ny 0.5\n"
    )


def test_held_back_logprobs_go_to_the_finish_chunk():
    sh = oa.ChatShaper(model="m", thinking=False, logprobs=True, token_bytes=TB.__getitem__)
    assert sh.feed(chunk("", [4], [-0.2], [[(4, -0.2)]])) == []  # text held back: nothing to send yet
    sh.feed(chunk("", finish="length", usage=USAGE))
    fin = sh.finish_chunks()
    assert len(fin) == 1 and fin[0]["choices"][0]["finish_reason"] == "length"
    assert [e["bytes"] for e in fin[0]["choices"][0]["logprobs"]["content"]] == [[0xE4, 0xBD]]
