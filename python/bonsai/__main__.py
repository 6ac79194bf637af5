"""Command line: ``python -m bonsai {generate,chat,serve,inspect,synth,bench}``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _engine(args: argparse.Namespace) -> Any:
    from . import Engine, demo_model_path

    model = args.model
    if model is None:
        model = demo_model_path(args.demo_preset)
        print(
            f"bonsai: no --model given; using a generated demo model ({args.demo_preset}, Q1_0) whose "
            f"weights are RANDOM, so its text is gibberish: {model}",
            file=sys.stderr,
        )
    return Engine(model, device=args.device, n_ctx=args.n_ctx, threads=args.threads)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": args.max_tokens, "seed": args.seed}
    for k in ("temperature", "top_k", "top_p", "min_p"):
        v = getattr(args, k)
        if v is not None:
            out[k] = v
    if args.stop:
        out["stop"] = args.stop
    return out


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="path to a qwen35 GGUF (default: a generated demo model)")
    p.add_argument("--demo-preset", default="tiny", choices=["tiny", "small"], help=argparse.SUPPRESS)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | vulkan (default auto)")
    p.add_argument("--n-ctx", type=int, default=None, help="context length (default min(trained, 4096))")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0.7)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def cmd_generate(args: argparse.Namespace) -> int:
    eng = _engine(args)
    if args.raw:
        it = eng.generate(args.prompt, **_sampling(args))
    else:
        msgs = [{"role": "user", "content": args.prompt}]
        it = eng.chat(msgs, enable_thinking=not args.no_think, **_sampling(args))
    usage: dict[str, Any] = {}
    reason = None
    for c in it:
        sys.stdout.write(c.text)
        sys.stdout.flush()
        if c.finish_reason:
            reason, usage = c.finish_reason, c.usage or {}
    sys.stdout.write("\n")
    n = usage.get("completion_tokens", 0)
    dt = usage.get("decode_seconds", 0.0)
    print(
        f"[{reason}] prompt {usage.get('prompt_tokens', 0)} tok in {usage.get('prefill_seconds', 0):.3f}s, "
        f"{n} tok generated in {dt:.3f}s ({(n - 1) / dt if n > 1 and dt > 0 else 0:.1f} tok/s), "
        f"TTFT {usage.get('ttft_seconds', 0) * 1000:.0f} ms — {eng.info['device']}",
        file=sys.stderr,
    )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    eng = _engine(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("bonsai chat — empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply: list[str] = []
        t0 = time.perf_counter()
        try:
            for c in eng.chat(messages, enable_thinking=not args.no_think, **_sampling(args)):
                sys.stdout.write(c.text)
                sys.stdout.flush()
                reply.append(c.text)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
        sys.stdout.write("\n")
        text = "".join(reply)
        if "</think>" in text:
            text = text.split("</think>", 1)[1].lstrip("\n")
        messages.append({"role": "assistant", "content": text})
        print(f"[{time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import _bonsai

    try:
        report = _bonsai.inspect(args.file)
    except _bonsai.BonsaiError as e:
        print(f"bonsai inspect: {e}", file=sys.stderr)
        return 1
    print(report)
    # a readable container holding an invalid model: the report says why; the exit status says so too
    return 1 if "\nvalidation:   FAILED" in report else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from . import Engine, demo_model_path
    from .server import serve

    model = args.model
    if model is None:
        model = demo_model_path(args.demo_preset)
        print(
            f"bonsai: no --model given; serving a generated demo model ({args.demo_preset}, Q1_0) whose "
            f"weights are RANDOM, so its text is gibberish: {model}",
            file=sys.stderr,
        )
    kw: dict[str, Any] = {
        "device": args.device,
        "n_ctx": args.n_ctx,
        "threads": args.threads,
        "prompt_cache": not args.no_prompt_cache,
        "prompt_cache_entries": args.prompt_cache_entries,
    }
    if args.draft is not None:
        kw.update(draft=args.draft, speculative=args.speculative)
    eng = Engine(model, **kw)
    serve(eng, host=args.host, port=args.port, model_name=args.name, default_max_tokens=args.max_tokens)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "synth":
        from . import synth

        return synth.main(argv[1:]) or 0
    if argv and argv[0] == "bench":
        from . import bench

        return bench.main(argv[1:]) or 0

    ap = argparse.ArgumentParser(prog="python -m bonsai", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from a prompt (chat-templated unless --raw)")
    _add_common(g)
    g.add_argument("prompt", nargs="?", default="Write a haiku about a small tree.")
    g.add_argument("--raw", action="store_true", help="no chat template: complete the prompt as is")
    g.add_argument("--no-think", action="store_true", help="enable_thinking=False")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="interactive streaming chat")
    _add_common(c)
    c.add_argument("--system", default=None)
    c.add_argument("--no-think", action="store_true")
    c.set_defaults(fn=cmd_chat)
    i = sub.add_parser("inspect", help="architecture, sizes, types, memory estimate, validation")
    i.add_argument("file")
    i.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (+ a chat page at /)")
    s.add_argument("--model", "-m", help="path to a qwen35 GGUF (default: a generated demo model)")
    s.add_argument("--demo-preset", default="tiny", choices=["tiny", "small"], help=argparse.SUPPRESS)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--name", default=None, help="model id in the API (default: the file name)")
    s.add_argument("--device", default="auto", help="auto | cpu | cuda | vulkan (default auto)")
    s.add_argument("--n-ctx", type=int, default=None, help="context length (default min(trained, 4096))")
    s.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    s.add_argument("--draft", default=None, help='speculative decoding: a DSpark drafter GGUF or "ngram"')
    s.add_argument("--speculative", default="auto", choices=["auto", "always", "never"])
    s.add_argument("--max-tokens", type=int, default=None, help="default limit per request (default: n_ctx)")
    s.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="prefill every prompt from scratch (default: resume one that starts with a cached prompt)",
    )
    s.add_argument(
        "--prompt-cache-entries",
        type=int,
        default=4,
        metavar="N",
        help="conversations the prompt cache keeps besides the live one (default 4; 0: only the live one)",
    )
    s.set_defaults(fn=cmd_serve)
    sub.add_parser("synth", help="generate synthetic models (python -m bonsai synth --help)")
    sub.add_parser("bench", help="benchmarks (python -m bonsai bench --help)")
    args = ap.parse_args(argv)
    from . import _bonsai

    try:
        return int(args.fn(args) or 0)
    except _bonsai.BonsaiError as e:
        print(f"bonsai: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
