"""Seeded synthetic Bonsai-27B GGUF files (arch ``qwen35``) with the real keys, tensor names, order and
types (MODEL.md §0, §1.5, §2.1–2.4, §5), at three sizes:

- ``tiny``  : seconds to make; for tests (n_embd 256, 8 layers, vocab 1536 rows). Its GDN has 2 k-heads
  and 6 v-heads (3 per k-head, like the real 16/48): with 4 v-heads ``ssm_beta`` [256, 4] would be 272 B
  as g128 and 288 B as g64, and 272 rounds up to the same 288 B extent, so the id-42 extent test of
  MODEL.md §1.4 could not tell the two layouts apart on that tensor. With 6 the extents are 416 vs 448.
- ``small`` : interactive on a 2-core CPU; for benchmarks (n_embd 1024, 16 layers, vocab 8320 rows).
- ``27b``   : the exact real shapes (851 tensors, 248320 vocab rows), written streaming.

Variants: ``q1`` (Q1_0, id 41), ``q2`` (legacy Q2_0 g128, id 42, 34 B), ``pq2`` (PQ2_0, id 142),
``q2g64`` (upstream Q2_0 g64, id 42, 18 B).

Usage::

    python -m bonsai.synth --preset tiny --variant q1 --out /tmp/tiny-q1.gguf [--seed 0] [--sparse]

    from bonsai import synth
    synth.make_target("/tmp/x.gguf", "tiny", "q1", seed=0)

This module imports nothing from the compiled extension.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:  # package import (bonsai.synth) or plain module import from python/bonsai
    from . import _quant as q
    from . import gguf_io as gio
except ImportError:  # pragma: no cover
    import _quant as q  # type: ignore
    import gguf_io as gio  # type: ignore

# ------------------------------------------------------------------------------------------------
# Presets and variants
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    name: str
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    head_dim: int
    n_head_kv: int
    rope_dims: int
    rope_sections: tuple
    ssm_conv: int
    ssm_state: int
    ssm_groups: int
    ssm_rank: int
    ssm_inner: int
    n_vocab_rows: int  # embedding rows (= length of tokenizer.ggml.tokens)
    n_bpe: int  # byte tokens + merge tokens (specials start at this id)
    context_length: int
    interval: int = 4
    rms_eps: float = 1e-6
    rope_base: float = 1.0e7


PRESETS = {
    "tiny": Preset(
        "tiny",
        n_embd=256,
        n_layer=8,
        n_ff=512,
        n_head=4,
        head_dim=64,
        n_head_kv=2,
        rope_dims=16,
        rope_sections=(3, 3, 2, 0),
        ssm_conv=4,
        ssm_state=64,
        ssm_groups=2,
        ssm_rank=6,
        ssm_inner=384,
        n_vocab_rows=1536,
        n_bpe=1408,
        context_length=8192,
    ),
    "small": Preset(
        "small",
        n_embd=1024,
        n_layer=16,
        n_ff=2816,
        n_head=8,
        head_dim=128,
        n_head_kv=2,
        rope_dims=32,
        rope_sections=(6, 5, 5, 0),
        ssm_conv=4,
        ssm_state=128,
        ssm_groups=4,
        ssm_rank=8,
        ssm_inner=1024,
        n_vocab_rows=8320,
        n_bpe=8192,
        context_length=32768,
    ),
    "27b": Preset(
        "27b",
        n_embd=5120,
        n_layer=64,
        n_ff=17408,
        n_head=24,
        head_dim=256,
        n_head_kv=4,
        rope_dims=64,
        rope_sections=(11, 11, 10, 0),
        ssm_conv=4,
        ssm_state=128,
        ssm_groups=16,
        ssm_rank=48,
        ssm_inner=6144,
        n_vocab_rows=248320,
        n_bpe=248044,
        context_length=262144,
    ),
}

# variant -> (resolved format, ggml id, general.file_type)
VARIANTS = {
    "q1": ("Q1_0", 41, 40),
    "q2": ("Q2_0G128", 42, 41),
    "pq2": ("PQ2_0", 142, 41),
    "q2g64": ("Q2_0G64", 42, 41),
}

# Real sizes of the published files (MODEL.md §0), for checks.
REAL_SIZES = {"q1": 3_803_452_480, "q2": 7_165_121_600, "pq2": 7_165_121_600, "q2g64": 7_585_330_240}

# MODEL.md §5.2, in id order starting at n_bpe. Type 3 = control, 4 = user-defined.
SPECIALS = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<|object_ref_start|>", 3),
    ("<|object_ref_end|>", 3),
    ("<|box_start|>", 3),
    ("<|box_end|>", 3),
    ("<|quad_start|>", 3),
    ("<|quad_end|>", 3),
    ("<|vision_start|>", 3),
    ("<|vision_end|>", 3),
    ("<|vision_pad|>", 3),
    ("<|image_pad|>", 3),
    ("<|video_pad|>", 3),
    ("<tool_call>", 4),
    ("</tool_call>", 4),
    ("<|fim_prefix|>", 4),
    ("<|fim_middle|>", 4),
    ("<|fim_suffix|>", 4),
    ("<|fim_pad|>", 4),
    ("<|repo_name|>", 4),
    ("<|file_sep|>", 4),
    ("<tool_response>", 4),
    ("</tool_response>", 4),
    ("<think>", 4),
    ("</think>", 4),
]
TT_NORMAL, TT_CONTROL, TT_USER, TT_UNUSED = 1, 3, 4, 5

QWEN35_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEMPLATE_PATH = Path(__file__).resolve().parent / "templates" / "qwen35.jinja"
CHATML_FALLBACK = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def chat_template() -> str:
    """The qwen35 template from python/bonsai/templates/qwen35.jinja, or a minimal ChatML fallback."""
    if TEMPLATE_PATH.is_file():
        return TEMPLATE_PATH.read_text(encoding="utf-8")
    return CHATML_FALLBACK


# ------------------------------------------------------------------------------------------------
# Byte-level BPE: GPT-2 byte map, qwen35 pre-tokenizer, trainer, encoder
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable code point map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@functools.lru_cache(maxsize=1)
def unicode_to_bytes() -> dict:
    return {c: b for b, c in bytes_to_unicode().items()}


@functools.lru_cache(maxsize=1)
def _pretok_re():
    try:
        import regex  # type: ignore

        return regex.compile(QWEN35_PRETOKENIZE)
    except ImportError:  # approximation with the stdlib: letters/marks ~ [^\W\d_]
        import re

        pat = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|_+|\s*[\r\n]+|\s+(?!\S)|\s+"
        return re.compile(pat)


def pretokenize(text: str) -> list:
    return _pretok_re().findall(text)


def _to_symbols(word: str) -> str:
    m = bytes_to_unicode()
    return "".join(m[b] for b in word.encode("utf-8"))


CORPUS = r"""
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the tokens
before it. When the model is small, it runs quickly on a laptop; when it is large, it needs a GPU with a
lot of memory. We measure the speed in tokens per second, and we check that the answers are correct.
In the beginning there was a plan, and the plan was simple: read the file, parse the header, map the
weights, and run the layers one after another. Every layer has a norm, a mixer and a feed-forward block.
The attention layers keep a cache of keys and values; the recurrent layers keep a small state instead.
She said that the weather would be nice tomorrow, so they decided to walk to the river and have lunch
under the old trees. The children played near the water while their parents talked about work, travel,
books, music and the news of the week. It was a quiet afternoon, and nobody wanted it to end.
Please write a short summary of the following article. Explain your reasoning step by step, then give
the final answer. What is the capital of France? The capital of France is Paris. How many days are
there in a week? There are seven days in a week. Thank you for your help! You're welcome, I'm glad it
worked. Don't forget to save your changes before you close the editor. They'll arrive at 10:30 on Monday.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828 1e-6 -1 +1 50% $20.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Tokenizer:
    def __init__(self, vocab, merges):
        self.vocab = vocab
        self.merges = {pair: rank for rank, pair in enumerate(merges)}

    def encode(self, text: str) -> list[int]:
        return [self.vocab[t] for t in self.split(text)]

for i in range(10):
    print(f"step {i}: loss = {1.0 / (i + 1):.4f}")

import numpy as np
x = np.zeros((4, 128), dtype=np.float32)
y = x @ x.T + 1.0
assert y.shape == (4, 4)

fn main() {
    let mut total: u64 = 0;
    for i in 0..100 {
        total += i * i;
    }
    println!("total = {}", total);
}

pub struct Engine { layers: Vec<Layer>, cache: KvCache }
impl Engine {
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Error> {
        let x = self.embed(tokens)?;
        Ok(self.head(&x))
    }
}

#include <stdio.h>
int main(void) { printf("hello, world\n"); return 0; }

SELECT name, count(*) FROM users WHERE age > 21 GROUP BY name ORDER BY count(*) DESC;
{"role": "user", "content": "Hello!"} {"role": "assistant", "content": "Hi! How can I help you today?"}
<html><body><h1>Title</h1><p>Some text in a paragraph.</p></body></html>
Le petit chat dort sur le canapé pendant que la pluie tombe doucement. Nous allons au marché demain matin.
Der schnelle braune Fuchs springt über den faulen Hund. Ich möchte eine Tasse Kaffee, bitte. Schön!
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca? Mañana será otro día.
O rápido cão castanho. A informação está disponível no relatório. Obrigado pela atenção.
Быстрая коричневая лиса прыгает через ленивую собаку. Спасибо за помощь, до свидания.
敏捷的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。语言模型可以回答问题。
素早い茶色の狐がのろまな犬を飛び越える。今日はいい天気ですね。ありがとうございます。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 감사합니다. 안녕하세요.
الثعلب البني السريع يقفز فوق الكلب الكسول. شكرا جزيلا.
नमस्ते, आप कैसे हैं? धन्यवाद।  Xin chào, cảm ơn bạn rất nhiều.  Καλημέρα, ευχαριστώ πολύ.
Emoji: 🙂 🚀 ✅ ❤️ 👍🏽 — “quotes”, ‘single’, ellipsis… and tabs	between	words.
The model thinks first, then answers. <think> reasoning goes here </think> and then the final answer.
Training a tokenizer: count the pairs of adjacent symbols in every word, merge the most frequent pair,
and repeat until the vocabulary is large enough. The merges are applied in the same order when encoding.
"""


@functools.lru_cache(maxsize=4)
def train_bpe(max_merges: int = 2000, corpus: str = CORPUS) -> tuple:
    """Greedy byte-level BPE over ``corpus`` split by the qwen35 pre-tokenizer. Returns merges as a
    tuple of (left, right) symbol strings in rank order. Deterministic: ties break by the pair's text."""
    counts: dict = {}
    for w in pretokenize(corpus * 3):
        s = _to_symbols(w)
        counts[s] = counts.get(s, 0) + 1
    words = [list(w) for w in counts]  # symbol lists
    freq = list(counts.values())
    pair_count: dict = {}
    where: dict = {}
    for wi, syms in enumerate(words):
        for a, b in zip(syms, syms[1:], strict=False):
            p = (a, b)
            pair_count[p] = pair_count.get(p, 0) + freq[wi]
            where.setdefault(p, set()).add(wi)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges = []
    vocab = set(bytes_to_unicode().values())
    while heap and len(merges) < max_merges:
        negc, p = heapq.heappop(heap)
        c = pair_count.get(p, 0)
        if c != -negc:
            if c > 0:
                heapq.heappush(heap, (-c, p))
            continue
        if c < 2:
            break
        new = p[0] + p[1]
        if new in vocab:  # already a token via another split; skip to keep tokens unique
            pair_count[p] = 0
            continue
        merges.append(p)
        vocab.add(new)
        touched = {}
        for wi in sorted(where.pop(p, ())):
            syms = words[wi]
            f = freq[wi]
            for a, b in zip(syms, syms[1:], strict=False):
                pair_count[(a, b)] -= f
            out = []
            i = 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == p[0] and syms[i + 1] == p[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[wi] = out
            for a, b in zip(out, out[1:], strict=False):
                pp = (a, b)
                pair_count[pp] = pair_count.get(pp, 0) + f
                where.setdefault(pp, set()).add(wi)
                touched[pp] = True
        pair_count[p] = 0
        for pp in touched:
            if pair_count.get(pp, 0) > 0:
                heapq.heappush(heap, (-pair_count[pp], pp))
    return tuple(merges)


@dataclass
class Vocab:
    tokens: list  # token strings, len = n_vocab_rows
    token_types: np.ndarray  # int32 per token
    merges: list  # "a b" strings in rank order
    n_bpe: int
    eos_id: int
    pad_id: int

    def id_of(self, s: str) -> int:
        return self.tokens.index(s)


@functools.lru_cache(maxsize=4)
def build_vocab(n_bpe: int, n_rows: int, train_merges: int = 2000) -> Vocab:
    """Bytes (GPT-2 order), trained merges, synthetic merges up to ``n_bpe`` tokens, the specials of
    MODEL.md §5.2, then ``[PAD<id>]`` rows up to ``n_rows``. Independent of the weight seed."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in sorted(b2u, key=lambda b: ord(b2u[b]))]
    seen = set(tokens)
    merges = []
    for a, b in train_bpe(train_merges)[: max(0, n_bpe - 256)]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        seen.add(a + b)
    base = list(tokens)  # short tokens to extend with
    rng = np.random.Generator(np.random.SFC64(0x5EED))
    while len(tokens) < n_bpe:
        need = n_bpe - len(tokens)
        ia = rng.integers(0, len(tokens), size=need * 2 + 64)
        ib = rng.integers(0, len(base), size=need * 2 + 64)
        for i, j in zip(ia.tolist(), ib.tolist(), strict=True):
            a, b = tokens[i], base[j]
            s = a + b
            if len(s) > 12 or s in seen:
                continue
            seen.add(s)
            tokens.append(s)
            merges.append(f"{a} {b}")
            if len(tokens) == n_bpe:
                break
    types = [TT_NORMAL] * len(tokens)
    for s, t in SPECIALS:
        if s in seen:
            raise AssertionError(f"special {s} collides with a BPE token")
        tokens.append(s)
        types.append(t)
    for i in range(len(tokens), n_rows):
        tokens.append(f"[PAD{i}]")
        types.append(TT_UNUSED)
    if len(tokens) != n_rows:
        raise ValueError(f"vocab has {len(tokens)} tokens for {n_rows} rows")
    return Vocab(
        tokens=tokens,
        token_types=np.asarray(types, dtype=np.int32),
        merges=merges,
        n_bpe=n_bpe,
        eos_id=n_bpe + 2,
        pad_id=n_bpe,
    )


class Tokenizer:
    """Reference byte-level BPE encoder/decoder for a ``Vocab`` (or a GGUF's tokenizer metadata)."""

    def __init__(self, tokens, merges, token_types):
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {}
        for r, m in enumerate(merges):
            a, b = m.split(" ", 1)
            self.ranks[(a, b)] = r
        tt = list(token_types)
        self.specials = sorted(
            (t for t, ty in zip(self.tokens, tt, strict=True) if ty in (TT_CONTROL, TT_USER)), key=len, reverse=True
        )
        self._cache: dict = {}

    @classmethod
    def from_vocab(cls, v: Vocab) -> Tokenizer:
        return cls(v.tokens, v.merges, v.token_types)

    @classmethod
    def from_gguf(cls, path) -> Tokenizer:
        g = gio.read_gguf(path)
        return cls(g.kv["tokenizer.ggml.tokens"], g.kv["tokenizer.ggml.merges"], g.kv["tokenizer.ggml.token_type"])

    def _bpe(self, word: str) -> list:
        if word in self._cache:
            return self._cache[word]
        syms = list(word)
        while len(syms) > 1:
            best, bi = None, -1
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            syms[bi : bi + 2] = [syms[bi] + syms[bi + 1]]
        ids = [self.ids[s] for s in syms]
        self._cache[word] = ids
        return ids

    def encode(self, text: str, special: bool = True) -> list:
        out = []
        parts = [text]
        if special and self.specials:
            parts = []
            i = 0
            while i < len(text):
                j = min((k for k in (text.find(s, i) for s in self.specials) if k >= 0), default=-1)
                if j < 0:
                    parts.append(text[i:])
                    break
                if j > i:
                    parts.append(text[i:j])
                s = next(s for s in self.specials if text.startswith(s, j))
                parts.append((s,))
                i = j + len(s)
        for p in parts:
            if isinstance(p, tuple):
                out.append(self.ids[p[0]])
                continue
            for w in pretokenize(p):
                out.extend(self._bpe(_to_symbols(w)))
        return out

    def decode_bytes(self, ids) -> bytes:
        u2b = unicode_to_bytes()
        out = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t in self.specials:
                out += t.encode("utf-8")
            else:
                out += bytes(u2b[c] for c in t) if all(c in u2b for c in t) else t.encode("utf-8")
        return bytes(out)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------
# Tensor plan
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple  # ggml order
    fmt: str  # resolved format name (see _quant.BLOCK)
    init: str  # generator kind
    scale: float = 1.0  # target element RMS for low-bit matrices
    quiet_from_row: int | None = None  # rows >= this get 1/1000 of the scale (padding rows of the head)

    @property
    def nbytes(self) -> int:
        return q.tensor_bytes(self.fmt, self.shape)


def is_attention_layer(il: int, interval: int = 4) -> bool:
    return (il + 1) % interval == 0


def plan_tensors(p: Preset, fmt: str, mixer_gain: float = 1.0) -> list:
    """All target tensors in file order with shapes, formats and init kinds (MODEL.md §2.3).

    ``mixer_gain`` scales the matrices that write into the residual stream (``attn_output``,
    ``ssm_out``, ``ffn_down``). Below 1 the residual stays close to the current token's embedding, so
    the greedy next token is mostly a function of the previous token (while every layer still runs):
    the target an agreeing drafter (:func:`make_drafter` with ``next_token``) can predict."""
    E, V = p.n_embd, p.n_vocab_rows
    key_dim = p.ssm_state * p.ssm_groups
    value_dim = p.ssm_state * p.ssm_rank
    conv_dim = 2 * key_dim + value_dim
    qdim = p.n_head * p.head_dim
    kvdim = p.n_head_kv * p.head_dim

    def lin(name, n_in, n_out, gain=1.0):
        return TensorSpec(name, (n_in, n_out), fmt, "lowbit", gain / math.sqrt(n_in))

    ts = [
        TensorSpec("token_embd.weight", (E, V), fmt, "lowbit", 1.0),
        TensorSpec("output_norm.weight", (E,), "F32", "norm1p"),
        # Logits std ~3.5 for real tokens; padding rows (never real tokens, incl. the DSpark mask row)
        # get near-zero logits so greedy decoding never picks them.
        TensorSpec("output.weight", (E, V), fmt, "lowbit", 3.5 / math.sqrt(E), p.n_bpe + len(SPECIALS)),
    ]
    for il in range(p.n_layer):
        b = f"blk.{il}."
        ts.append(TensorSpec(b + "attn_norm.weight", (E,), "F32", "norm1p"))
        if is_attention_layer(il, p.interval):
            ts += [
                lin(b + "attn_q.weight", E, 2 * qdim),
                lin(b + "attn_k.weight", E, kvdim),
                lin(b + "attn_v.weight", E, kvdim),
                TensorSpec(b + "attn_q_norm.weight", (p.head_dim,), "F32", "norm1p"),
                TensorSpec(b + "attn_k_norm.weight", (p.head_dim,), "F32", "norm1p"),
                lin(b + "attn_output.weight", qdim, E, mixer_gain),
            ]
        else:
            ts += [
                lin(b + "attn_qkv.weight", E, conv_dim),
                lin(b + "attn_gate.weight", E, value_dim),
                lin(b + "ssm_beta.weight", E, p.ssm_rank),
                lin(b + "ssm_alpha.weight", E, p.ssm_rank),
                TensorSpec(b + "ssm_conv1d.weight", (p.ssm_conv, conv_dim), "F32", "conv"),
                TensorSpec(b + "ssm_dt.bias", (p.ssm_rank,), "F32", "dt_bias"),
                TensorSpec(b + "ssm_a", (p.ssm_rank,), "F32", "ssm_a"),
                TensorSpec(b + "ssm_norm.weight", (p.ssm_state,), "F32", "norm1p"),
                lin(b + "ssm_out.weight", value_dim, E, mixer_gain),
            ]
        ts += [
            TensorSpec(b + "post_attention_norm.weight", (E,), "F32", "norm1p"),
            lin(b + "ffn_gate.weight", E, p.n_ff),
            lin(b + "ffn_up.weight", E, p.n_ff),
            lin(b + "ffn_down.weight", p.n_ff, E, mixer_gain),
        ]
    for t in ts:
        if t.fmt != "F32" and t.shape[0] % q.BLOCK[t.fmt][0]:
            raise AssertionError(f"{t.name}: ne0 {t.shape[0]} not a multiple of the block")
    return ts


# ------------------------------------------------------------------------------------------------
# Weight generation (streaming, deterministic per (seed, tensor index))
# ------------------------------------------------------------------------------------------------

_M55 = np.uint64(0x5555555555555555)
CHUNK_BYTES = 32 << 20


def _rng(seed: int, idx: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([int(seed), int(idx), 0xB0A5])))


def _raw_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniformly random bytes (fast path through the bit generator's raw 64-bit output)."""
    w = rng.bit_generator.random_raw((n + 7) // 8)
    return w.view(np.uint8)[:n]


def _ternary_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n bytes of four 2-bit codes each in {0,1,2} with P = 1/4, 1/2, 1/4 (sum of two fair bits)."""
    k = (n + 7) // 8
    a = rng.bit_generator.random_raw(k)
    b = rng.bit_generator.random_raw(k)
    a &= _M55
    b &= _M55
    a += b
    return a.view(np.uint8)[:n]


def _scale_lut(rng: np.random.Generator, base: float) -> np.ndarray:
    """256 f16 block scales base·exp(0.1·z) (z normal) as uint16 bits, indexed by a random byte."""
    z = rng.standard_normal(256)
    return (base * np.exp(0.1 * z)).astype("<f2").view("<u2")


def lowbit_chunks(spec: TensorSpec, rng: np.random.Generator, chunk_bytes: int = CHUNK_BYTES):
    """Yield the packed bytes of a low-bit matrix in row chunks ([rows·blocks, block_bytes] uint8).

    Q1_0: random signs, element RMS = d, so d = scale. Q2: codes {0,1,2} w.p. 1/4,1/2,1/4 give element
    RMS d/sqrt(2), so d = scale·sqrt(2). Never code 3. Each block's d is scale·exp(0.1·z)."""
    be, bb = q.BLOCK[spec.fmt]
    n_in, n_out = spec.shape
    nb = n_in // be
    ternary = spec.fmt != "Q1_0"
    base = spec.scale * (math.sqrt(2.0) if ternary else 1.0)
    lut = _scale_lut(rng, base)
    rows_per = max(1, chunk_bytes // (nb * bb))
    hw = bb // 2  # block size in u16 words (18 -> 9, 34 -> 17); d is word 0
    for r0 in range(0, n_out, rows_per):
        r = min(rows_per, n_out - r0)
        nblk = r * nb
        blk = np.empty((nblk, hw), dtype="<u2")  # [blocks, words]
        qsn = nblk * (hw - 1)
        src = _ternary_bytes(rng, 2 * qsn) if ternary else _raw_bytes(rng, 2 * qsn)
        blk[:, 1:] = src.view("<u2").reshape(nblk, hw - 1)
        d = lut[_raw_bytes(rng, nblk)]
        if spec.quiet_from_row is not None and r0 + r > spec.quiet_from_row:
            first = max(0, spec.quiet_from_row - r0) * nb
            d[first:] = (d[first:].view("<f2").astype(np.float32) * 1e-3).astype("<f2").view("<u2")
        blk[:, 0] = d
        yield blk.view(np.uint8)


def f32_tensor(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(spec.shape))
    if spec.init == "norm1p":
        x = 1.0 + 0.05 * rng.standard_normal(n)
    elif spec.init == "conv":
        x = rng.uniform(-0.5, 0.5, n)  # U(±1/sqrt(4))
    elif spec.init == "ssm_a":
        x = -rng.uniform(1.0, 16.0, n)  # -exp(A_log), A_log = log U(1,16)
    elif spec.init == "dt_bias":
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(0.1), n))
        x = np.log(np.expm1(dt))  # softplus^-1(dt)
    else:
        raise ValueError(spec.init)
    return x.astype("<f4")


def tensor_chunks(spec: TensorSpec, seed: int, idx: int):
    rng = _rng(seed, idx)
    if spec.init == "lowbit":
        yield from lowbit_chunks(spec, rng)
    else:
        yield f32_tensor(spec, rng).view(np.uint8)


# ------------------------------------------------------------------------------------------------
# Metadata and file writing
# ------------------------------------------------------------------------------------------------


def _add_tokenizer(w: gio.GGUFWriter, v: Vocab) -> None:
    w.add("tokenizer.ggml.model", "gpt2")
    w.add("tokenizer.ggml.pre", "qwen35")
    w.add_array("tokenizer.ggml.tokens", gio.STRING, v.tokens)
    w.add_array("tokenizer.ggml.token_type", gio.I32, v.token_types)
    w.add_array("tokenizer.ggml.merges", gio.STRING, v.merges)
    w.add_typed("tokenizer.ggml.eos_token_id", gio.U32, v.eos_id)
    w.add_typed("tokenizer.ggml.padding_token_id", gio.U32, v.pad_id)
    w.add_typed("tokenizer.ggml.bos_token_id", gio.U32, v.pad_id)
    w.add_typed("tokenizer.ggml.add_bos_token", gio.BOOL, False)
    w.add("tokenizer.chat_template", chat_template())


def target_writer(path, preset: str, variant: str, mixer_gain: float = 1.0) -> tuple:
    """A GGUFWriter with all target metadata and tensor infos added (header not yet written)."""
    p = PRESETS[preset]
    fmt, gid, ftype = VARIANTS[variant]
    specs = plan_tensors(p, fmt, mixer_gain)
    v = build_vocab(p.n_bpe, p.n_vocab_rows)
    w = gio.GGUFWriter(path, alignment=32)
    A = "qwen35"
    w.add("general.architecture", A)
    w.add("general.name", f"Bonsai synthetic {preset} {variant}")
    w.add_typed("general.file_type", gio.U32, ftype)
    w.add_typed("general.quantization_version", gio.U32, 2)
    w.add_typed("general.alignment", gio.U32, 32)
    u32 = [
        ("block_count", p.n_layer),
        ("context_length", p.context_length),
        ("embedding_length", p.n_embd),
        ("feed_forward_length", p.n_ff),
        ("attention.head_count", p.n_head),
        ("attention.head_count_kv", p.n_head_kv),
        ("attention.key_length", p.head_dim),
        ("attention.value_length", p.head_dim),
        ("rope.dimension_count", p.rope_dims),
        ("full_attention_interval", p.interval),
        ("ssm.conv_kernel", p.ssm_conv),
        ("ssm.state_size", p.ssm_state),
        ("ssm.group_count", p.ssm_groups),
        ("ssm.time_step_rank", p.ssm_rank),
        ("ssm.inner_size", p.ssm_inner),
    ]
    for k, val in u32:
        w.add_typed(f"{A}.{k}", gio.U32, val)
    w.add_typed(f"{A}.attention.layer_norm_rms_epsilon", gio.F32, p.rms_eps)
    w.add_typed(f"{A}.rope.freq_base", gio.F32, p.rope_base)
    w.add_array(f"{A}.rope.dimension_sections", gio.I32, list(p.rope_sections))
    _add_tokenizer(w, v)
    for s in specs:
        w.add_tensor_info(s.name, s.shape, gid if s.fmt != "F32" else 0, s.nbytes)
    return w, specs


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        self.enabled = enabled
        self.total = total
        self.done = 0
        self.last = -1
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
            except ImportError:
                sys.stderr.write(f"{desc}: 0%")

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            pct = 100 * self.done // max(1, self.total)
            if pct != self.last:
                self.last = pct
                sys.stderr.write(f"\r{pct:3d}%")
                sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


def _all_chunks(specs, seed):
    for idx, s in enumerate(specs):
        for chunk in tensor_chunks(s, seed, idx):
            yield s.name, chunk


def _prefetch(it, depth: int = 3):
    """Run a generator in a background thread so data generation overlaps the file writes."""
    import queue
    import threading

    qu: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def run():
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        qu.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            qu.put(done)
        except BaseException as e:  # pragma: no cover - re-raised in the consumer
            qu.put(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        while True:
            item = qu.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        th.join()


def make_target(
    path,
    preset: str = "tiny",
    variant: str = "q1",
    seed: int = 0,
    sparse: bool = False,
    progress: bool = True,
    max_bytes: int | None = None,
    mixer_gain: float = 1.0,
) -> Path:
    """Write a synthetic qwen35 target GGUF and return its path.

    ``path`` may be a directory (the file is then named ``bonsai-{preset}-{variant}-s{seed}.gguf``).
    ``sparse=True`` writes only the header and leaves the data section as a hole.
    ``max_bytes`` (for throughput measurements) stops generating data after that many bytes and leaves
    the rest as a hole. ``mixer_gain`` < 1 makes a target whose greedy continuation is dominated by the
    previous token (see :func:`plan_tensors`); the file name is the caller's choice."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; one of {sorted(PRESETS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {sorted(VARIANTS)}")
    path = Path(path)
    if path.is_dir():
        path = path / f"bonsai-{preset}-{variant}-s{seed}.gguf"
    w, specs = target_writer(path, preset, variant, mixer_gain)
    w.write_header()
    if not sparse:
        total = sum(s.nbytes for s in specs)
        if max_bytes is not None:
            total = min(total, max_bytes)
        bar = _Progress(total, progress, f"{preset}-{variant}")
        written = 0
        try:
            for name, chunk in _prefetch(_all_chunks(specs, seed)):
                if max_bytes is not None and written >= max_bytes:
                    sparse = True
                    break
                w.write_tensor_data(name, chunk)
                written += chunk.nbytes
                bar.update(chunk.nbytes)
        finally:
            bar.close()
    w.close(sparse=sparse)
    return path


def expected_size(preset: str, variant: str) -> int:
    """File size of a target without writing it (header + aligned data)."""
    w, _ = target_writer("/dev/null", preset, variant)
    w.header_bytes()
    return w.total_size


# ------------------------------------------------------------------------------------------------
# DSpark drafter (arch ``dspark``, MODEL.md §4.2-4.3)
# ------------------------------------------------------------------------------------------------

DRAFTER_GEOM = {  # preset -> (n_head, n_head_kv, head_dim, markov_rank)
    "tiny": (4, 2, 64, 32),
    "small": (8, 2, 128, 64),
    "27b": (40, 4, 128, 256),
}


def drafter_target_layers(n_layer: int) -> list:
    """Five tap layers spread like the real [1, 16, 31, 46, 61] for 64 layers."""
    return [int(round(x)) for x in np.linspace(1, n_layer - 3, 5)]


def plan_drafter(preset: str, variant: str) -> list:
    p = PRESETS[preset]
    E, V = p.n_embd, p.n_vocab_rows
    nh, nkv, hd, rank = DRAFTER_GEOM[preset]
    tfmt = VARIANTS[variant][0]
    # the ternary drafter's token_embd is id 42 g128 whatever the target's Q2 layout (MODEL.md §1.4)
    efmt = "Q1_0" if tfmt == "Q1_0" else "Q2_0G128"

    def m(name, n_in, n_out, fmt="Q4_1", gain=1.0):
        return TensorSpec(name, (n_in, n_out), fmt, "float", gain / math.sqrt(n_in))

    ts = [
        TensorSpec("token_embd.weight", (E, V), efmt, "lowbit", 1.0),
        TensorSpec("output.weight", (E, V), "Q4_1", "head_copy", 3.5 / math.sqrt(E), p.n_bpe + len(SPECIALS)),
        TensorSpec("output_norm.weight", (E,), "F32", "norm"),
        m("dspark.fc.weight", 5 * E, E),
        TensorSpec("dspark.hidden_norm.weight", (E,), "F32", "norm"),
        m("dspark.log_snr_fc1.weight", 128, E, "BF16"),
        TensorSpec("dspark.log_snr_fc1.bias", (E,), "F32", "bias"),
        m("dspark.log_snr_fc2.weight", E, E, "BF16"),
        TensorSpec("dspark.log_snr_fc2.bias", (E,), "F32", "bias"),
        m("dspark.markov_head_a.weight", rank, V, "BF16", math.sqrt(rank)),
        m("dspark.markov_head_b.weight", rank, V, "BF16"),
        m("dspark.confidence_head.weight", E, 1, "F32"),
        TensorSpec("dspark.confidence_head.bias", (1,), "F32", "bias"),
    ]
    for i in range(6):
        b = f"blk.{i}."
        ts += [
            TensorSpec(b + "attn_norm.weight", (E,), "F32", "norm"),
            m(b + "attn_q.weight", E, nh * hd),
            m(b + "attn_k.weight", E, nkv * hd),
            m(b + "attn_v.weight", E, nkv * hd),
            TensorSpec(b + "attn_q_norm.weight", (hd,), "F32", "norm"),
            TensorSpec(b + "attn_k_norm.weight", (hd,), "F32", "norm"),
            m(b + "attn_output.weight", nh * hd, E),
            TensorSpec(b + "ffn_norm.weight", (E,), "F32", "norm"),
            m(b + "ffn_gate.weight", E, E),
            m(b + "ffn_up.weight", E, E),
            m(b + "ffn_down.weight", E, E),
        ]
    return ts


#: Markov-table gain of the agreeing drafter: the chosen token's score is ``AGREE_GAIN`` and any
#: other token's at most ``AGREE_GAIN`` times the largest overlap of two random unit vectors.
AGREE_GAIN = 200.0


def next_token_map(sequences) -> dict:
    """The majority next token after each token in ``sequences`` (lists of token ids): the greedy
    next-token map an agreeing drafter encodes."""
    counts: dict = {}
    for seq in sequences:
        for a, b in zip(seq[:-1], seq[1:], strict=True):
            c = counts.setdefault(int(a), {})
            c[int(b)] = c.get(int(b), 0) + 1
    return {a: max(c.items(), key=lambda kv: (kv[1], -kv[0]))[0] for a, c in counts.items()}


def learn_next_token_map(engine, n_tokens: int, sequences=(), seed: int = 0, chunk: int = 512) -> dict:
    """The target's next-token map learnt from engine runs, for EVERY token below ``n_tokens``:
    each token is fed once inside a random permutation of ``range(n_tokens)`` (chunked prefill,
    ``engine.logits``) and votes for the argmax of its row; the transitions of ``sequences`` (e.g.
    greedy outputs on other prompts: the contexts decoding really visits) vote twice. The majority
    wins. On ``small`` this predicts about 3 of 4 greedy steps on unseen prompts, where the map of
    a few greedy outputs alone covers only the tokens it saw (about half)."""
    votes: dict = {}

    def vote(a: int, b: int, w: int) -> None:
        c = votes.setdefault(int(a), {})
        c[int(b)] = c.get(int(b), 0) + w

    perm = np.random.default_rng([int(seed), 0x6E78]).permutation(n_tokens)
    for c0 in range(0, n_tokens, chunk):
        ids = perm[c0 : c0 + chunk].tolist()
        for a, b in zip(ids, engine.logits(ids).argmax(axis=1).tolist(), strict=True):
            vote(a, b, 1)
    for seq in sequences:
        for a, b in zip(seq[:-1], seq[1:], strict=True):
            vote(a, b, 2)
    return {a: max(c.items(), key=lambda kv: (kv[1], -kv[0]))[0] for a, c in votes.items()}


def _agree_tables(spec: TensorSpec, seed: int, next_token: dict):
    """Markov tables with ``argmax_v b[v]·a[prev] = next_token[prev]``: ``b[v] = u_v`` (random unit
    vectors in R^rank) and ``a[p] = AGREE_GAIN·u_{next(p)}`` (0 for tokens without an entry)."""
    rank, n_vocab = spec.shape
    rng = np.random.default_rng([int(seed), 0xA62EE])
    u = rng.standard_normal((n_vocab, rank))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    if spec.name.endswith("markov_head_b.weight"):
        return u.astype(np.float32)
    a = np.zeros((n_vocab, rank), dtype=np.float32)
    for p_, n_ in next_token.items():
        if 0 <= p_ < n_vocab and 0 <= n_ < n_vocab:
            a[p_] = AGREE_GAIN * u[n_]
    return a


def drafter_chunks(spec: TensorSpec, seed: int, idx: int, preset: str, variant: str, next_token: dict | None = None):
    if next_token is not None and spec.name.startswith("dspark.markov_head_"):
        yield q.quantize(spec.fmt, _agree_tables(spec, seed, next_token)).reshape(-1)
        return
    if spec.init == "lowbit":  # same generator stream as the target's token_embd (tensor 0): same bytes
        yield from tensor_chunks(spec, seed, 0)
        return
    if spec.init == "head_copy":  # the target head, dequantized and stored Q4_1
        tspec = plan_tensors(PRESETS[preset], VARIANTS[variant][0])[2]
        for c in lowbit_chunks(tspec, _rng(seed, 2), chunk_bytes=8 << 20):
            w = q.dequantize(tspec.fmt, c, tspec.shape[0])
            yield q.quantize("Q4_1", w)
        return
    rng = _rng(seed, 10_000 + idx)
    n0 = spec.shape[0]
    n_rows = int(np.prod(spec.shape[1:])) if len(spec.shape) > 1 else 1
    if spec.init == "norm":  # drafter norms are plain w (no +1)
        yield (1.0 + 0.05 * rng.standard_normal(n0)).astype("<f4").view(np.uint8)
        return
    if spec.init == "bias":
        yield (0.02 * rng.standard_normal(n0)).astype("<f4").view(np.uint8)
        return
    rows_per = max(1, (4 << 20) // n0)
    for r0 in range(0, n_rows, rows_per):
        r = min(rows_per, n_rows - r0)
        x = (spec.scale * rng.standard_normal((r, n0))).astype(np.float32)
        yield q.quantize(spec.fmt, x).reshape(-1)


def make_drafter(
    path,
    preset: str = "tiny",
    variant: str = "q1",
    seed: int = 0,
    sparse: bool = False,
    progress: bool = True,
    next_token: dict | None = None,
) -> Path:
    """Write a synthetic DSpark drafter (arch ``dspark``, 79 tensors) matching ``make_target(preset,
    variant, seed)``: its ``token_embd`` has the target's bytes (Q1_0, or Q2_0 g128 for ternary targets;
    for a ``q2g64`` target it is the g128 re-encoding, so the bytes differ) and its ``output`` is the
    target head dequantized and re-quantized to Q4_1.

    Without ``next_token`` every weight is random: drafts almost never match (acceptance ≈ 0).

    With ``next_token`` (a dict prev id → next id, e.g. :func:`next_token_map` of the target's own greedy
    outputs) the drafter AGREES with the target: the sequential Markov head is built so that
    ``argmax_v (b[v]·a[prev]) = next_token[prev]`` with a margin (``b[v]`` random unit vectors in
    R^rank, ``a[prev] = AGREE_GAIN·b[next_token[prev]]``) that dominates the random transformer logits.
    Each draft then follows the map from the token just chosen, so where the target's greedy
    continuation is a function of the previous token (random synthetic targets settle into such
    cycles) the drafts match and acceptance is high."""
    p = PRESETS[preset]
    nh, nkv, hd, rank = DRAFTER_GEOM[preset]
    path = Path(path)
    if path.is_dir():
        path = path / f"bonsai-{preset}-{variant}-s{seed}-dspark.gguf"
    specs = plan_drafter(preset, variant)
    w = gio.GGUFWriter(path, alignment=32)
    A = "dspark"
    w.add("general.architecture", A)
    w.add("general.name", f"Bonsai synthetic {preset} {variant} dspark")
    w.add_typed("general.file_type", gio.U32, 3)
    w.add_typed("general.quantization_version", gio.U32, 2)
    w.add_typed("general.alignment", gio.U32, 32)
    for k, val in [
        ("block_count", 6),
        ("embedding_length", p.n_embd),
        ("feed_forward_length", p.n_embd),
        ("attention.head_count", nh),
        ("attention.head_count_kv", nkv),
        ("attention.key_length", hd),
        ("attention.value_length", hd),
        ("context_length", 4096),
        ("vocab_size", p.n_vocab_rows),
    ]:
        w.add_typed(f"{A}.{k}", gio.U32, val)
    w.add_typed(f"{A}.rope.freq_base", gio.F32, 1.0e7)
    w.add_typed(f"{A}.attention.layer_norm_rms_epsilon", gio.F32, 1e-6)
    w.add_typed(f"{A}.dspark.block_size", gio.U32, 4)
    w.add_typed(f"{A}.dspark.mask_token_id", gio.U32, p.n_vocab_rows - 1)
    w.add_array(f"{A}.dspark.target_layers", gio.I32, drafter_target_layers(p.n_layer))
    w.add_typed(f"{A}.dspark.markov_rank", gio.U32, rank)
    w.add_typed(f"{A}.dspark.confidence_head", gio.BOOL, True)
    w.add_typed(f"{A}.dspark.confidence_head_with_markov", gio.BOOL, False)
    w.add_typed(f"{A}.dspark.log_snr_conditioning", gio.BOOL, True)
    w.add_typed(f"{A}.dspark.min_log_snr", gio.F32, -9.0)
    w.add_typed(f"{A}.dspark.max_log_snr", gio.F32, 9.0)
    w.add("tokenizer.ggml.model", "none")
    for s in specs:
        w.add_tensor_info(s.name, s.shape, q.GGML_ID[s.fmt], s.nbytes)
    w.write_header()
    if not sparse:
        bar = _Progress(sum(s.nbytes for s in specs), progress, f"{preset}-{variant}-dspark")
        try:
            for idx, s in enumerate(specs):
                for chunk in drafter_chunks(s, seed, idx, preset, variant, next_token):
                    w.write_tensor_data(s.name, chunk)
                    bar.update(chunk.nbytes)
        finally:
            bar.close()
    w.close(sparse=sparse)
    return path


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bonsai.synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="q1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="output file or directory")
    ap.add_argument("--sparse", action="store_true", help="header only; data left as a file hole")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--drafter", action="store_true", help="write the matching DSpark drafter instead")
    a = ap.parse_args(argv)
    t0 = time.time()
    make = make_drafter if a.drafter else make_target
    out = make(a.out, a.preset, a.variant, seed=a.seed, sparse=a.sparse, progress=not a.no_progress)
    dt = time.time() - t0
    size = out.stat().st_size
    print(f"{out}: {size:,} bytes in {dt:.1f} s", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
