"""llama.cpp as an independent oracle (through llama-cpp-python): tokenize, per-step logits, greedy.

llama.cpp's CPU backend rounds the input of every low-bit matmul to Q8_0 per 32 elements and keeps the KV
cache in f16, so its logits are close to, not equal to, an exact forward (MODEL.md §1.3). This llama.cpp
build knows Q1_0 (id 41, group 128) and upstream Q2_0 (id 42, **group 64**); it cannot read the legacy
g128 id-42 files or PQ2_0 (id 142), so only the `q1` and `q2g64` variants can be checked against it.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

try:
    import llama_cpp
except ImportError:  # pragma: no cover - the tests that need it fail with a clear message
    llama_cpp = None


@contextlib.contextmanager
def _quiet():
    """Silence llama.cpp's C-level stderr chatter while loading."""
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as dn:
            os.dup2(dn.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


class LlamaOracle:
    """One llama.cpp context over a GGUF file."""

    def __init__(self, path: str | os.PathLike, n_ctx: int = 512, n_threads: int = 2):
        if llama_cpp is None:
            raise RuntimeError("llama-cpp-python is not installed")
        with _quiet():
            self.llm = llama_cpp.Llama(
                model_path=os.fspath(path),
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                logits_all=True,
                verbose=False,
            )
        self.n_vocab = self.llm.n_vocab()

    def _clear(self) -> None:
        """Forget the sequence: KV cache and the recurrent (GDN/conv) state."""
        self.llm.reset()
        mem = llama_cpp.llama_get_memory(self.llm._ctx.ctx)
        llama_cpp.llama_memory_clear(mem, True)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer, no BOS."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special))

    def logits(self, ids, batch: bool = True) -> np.ndarray:
        """Fresh sequence: logits of every row, [n, n_vocab] float32.

        batch=True evaluates the whole sequence in one ubatch (llama.cpp's chunked GDN prefill);
        batch=False feeds one token per decode call.
        """
        ids = [int(t) for t in ids]
        self._clear()
        if batch:
            self.llm.eval(ids)
        else:
            for t in ids:
                self.llm.eval([t])
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def generate(self, prompt_ids, n_tokens: int) -> tuple[list[int], np.ndarray]:
        """Greedy continuation of a fresh sequence. Returns (tokens, logits [n_tokens, n_vocab]) where
        logits[i] is the distribution token i was chosen from."""
        ids = [int(t) for t in prompt_ids]
        self._clear()
        self.llm.eval(ids)
        out, rows = [], []
        for i in range(n_tokens):
            lg = np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)
            rows.append(lg)
            t = int(np.argmax(lg))
            out.append(t)
            if i + 1 < n_tokens:
                self.llm.eval([t])
        return out, np.stack(rows)

    def close(self) -> None:
        self.llm.close()
