"""Load test of an OpenAI-compatible server (issue 9): C streaming clients in a closed loop for D seconds, and
every request checked, not just timed.

Each client sends streamed chat completions (T=0, ``logprobs``, ``stream_options.include_usage``) one after
the other until the duration is up; a request started before the end runs to completion. Each is counted as
exactly one of:

* ``ok``: HTTP 200, content chunks, a usage chunk, ``data: [DONE]``, ``usage.completion_tokens`` == logprob
  entries streamed, and the text equals the prompt's reference (when references are known);
* ``mismatched``: complete, but the text or the token count is wrong;
* ``lost``: no complete answer (transport error, non-200 status such as a 503 shed, an error event, a stream
  without usage or ``[DONE]``);
* ``hung``: no complete answer within ``--request-timeout-s``.

References: ``--check-exact`` first sends every prompt once, alone (concurrency 1), and takes those answers as
the references the loaded answers must equal (exact at T=0 whatever the batch); a test may pass its own
(e.g. the engine's offline output). The report (stdout and ``--output``) is JSON: the counts, p50/p90/p99
latency and TTFT in ms, throughput, and the first errors and mismatches.

    python -m bench.load_test --url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --concurrency 64 --duration-s 60 --max-tokens 16 --check-exact --output load_test.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.common import output_path, short_error, summarize_ms

DEFAULT_PROMPTS = [
    "What is 2+2?",
    "Name three colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List the first five prime numbers.",
    "What does a CPU do?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Name a planet in our solar system.",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "Count from 1 to 10.",
    "What is the opposite of cold?",
    "Write one sentence about dogs.",
    "What color is the sky on a clear day?",
]


@dataclass
class LoadConfig:
    """What to send. ``references`` maps a prompt to the text its answer must equal (None = not checked)."""

    url: str  # server root, e.g. http://127.0.0.1:8000
    model: str
    api_key: str | None = None
    concurrency: int = 64
    duration_s: float = 60.0
    max_tokens: int = 16
    request_timeout_s: float = 120.0
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    references: dict[str, str] | None = None


@dataclass
class _Result:
    outcome: str  # ok | mismatched | lost | hung
    prompt: str
    latency_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    status: int | None = None
    detail: str = ""


async def _stream_once(client: Any, cfg: LoadConfig, prompt: str) -> _Result:
    body = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
    }
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    t0 = time.perf_counter()
    ttft = None
    text, entries, usage, done, error = "", 0, None, False, None
    async with client.stream("POST", f"{cfg.url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:300]
            return _Result("lost", prompt, status=resp.status_code, detail=detail)
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += piece
                entries += len((c.get("logprobs") or {}).get("content") or [])
    latency = time.perf_counter() - t0
    if error is not None or usage is None or not done:
        detail = json.dumps(error) if error is not None else f"usage={usage is not None} done={done}"
        return _Result("lost", prompt, latency, ttft, entries, 200, detail)
    tokens = usage["completion_tokens"]
    want = None if cfg.references is None else cfg.references.get(prompt)
    if tokens != entries or tokens > cfg.max_tokens or (want is not None and text != want):
        detail = f"tokens {tokens} / entries {entries}; text {text!r} vs reference {want!r}"
        return _Result("mismatched", prompt, latency, ttft, tokens, 200, detail)
    return _Result("ok", prompt, latency, ttft, tokens, 200, text)


async def _one(client: Any, cfg: LoadConfig, prompt: str) -> _Result:
    try:
        return await asyncio.wait_for(_stream_once(client, cfg, prompt), cfg.request_timeout_s)
    except TimeoutError:
        return _Result("hung", prompt, cfg.request_timeout_s, detail=f"no answer in {cfg.request_timeout_s}s")
    except Exception as e:  # noqa: BLE001 - counted and reported
        return _Result("lost", prompt, detail=short_error(e, 300))


async def reference_texts(cfg: LoadConfig) -> dict[str, str]:
    """Every prompt once, alone (concurrency 1): its T=0 answer. Raises if one does not complete."""
    import httpx

    refs: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s)) as client:
        for p in cfg.prompts:
            r = await _one(client, LoadConfig(**(asdict(cfg) | {"references": None})), p)
            if r.outcome != "ok":
                raise RuntimeError(f"reference request for {p!r} failed: {r.outcome} {r.detail}")
            refs[p] = r.detail
    return refs


async def run_load(cfg: LoadConfig) -> dict[str, Any]:
    """Run the closed loop; returns the report (see the module docstring)."""
    import httpx

    results: list[_Result] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s), limits=limits) as client:
        t0 = time.perf_counter()
        end = t0 + cfg.duration_s

        async def user(i: int) -> None:
            k = 0
            while time.perf_counter() < end:
                prompt = cfg.prompts[(i + k * cfg.concurrency) % len(cfg.prompts)]
                results.append(await _one(client, cfg, prompt))
                k += 1

        await asyncio.gather(*(user(i) for i in range(cfg.concurrency)))
        wall = time.perf_counter() - t0
    return report(cfg, results, wall)


def report(cfg: LoadConfig, results: list[_Result], wall_s: float) -> dict[str, Any]:
    counts = Counter(r.outcome for r in results)
    ok = [r for r in results if r.outcome == "ok"]
    tokens = sum(r.tokens for r in ok)
    return {
        "config": asdict(cfg)
        | {"api_key": "***" if cfg.api_key else None, "references": cfg.references is not None},
        "requests": len(results),
        **{k: counts.get(k, 0) for k in ("ok", "mismatched", "lost", "hung")},
        "statuses": dict(Counter(str(r.status) for r in results)),
        "latency_ms": summarize_ms(r.latency_s for r in ok),
        "ttft_ms": summarize_ms(r.ttft_s for r in ok if r.ttft_s is not None),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "throughput_tok_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "errors": [f"{r.outcome}: {r.detail}" for r in results if r.outcome in ("lost", "hung")][:10],
        "mismatches": [f"{r.prompt!r}: {r.detail}" for r in results if r.outcome == "mismatched"][:10],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="Server root (the API is under /v1).")
    ap.add_argument("--model", required=True, help="Served model name.")
    ap.add_argument(
        "--api-key", default=os.environ.get("FLEXSPEC_API_KEY"), help="Bearer key (default: env)."
    )
    ap.add_argument("--concurrency", type=int, default=64, help="Concurrent streaming clients.")
    ap.add_argument("--duration-s", type=float, default=60.0, help="How long clients keep sending.")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--request-timeout-s", type=float, default=120.0, help="A request slower than this is hung."
    )
    ap.add_argument("--prompts", help="JSON list of prompts (default: 16 built-in questions).")
    ap.add_argument("--check-exact", action="store_true", help="Answers must equal those at concurrency 1.")
    ap.add_argument("--output", type=output_path, help="Also write the JSON report here.")
    args = ap.parse_args(argv)
    cfg = LoadConfig(
        url=args.url.rstrip("/"),
        model=args.model,
        api_key=args.api_key,
        concurrency=args.concurrency,
        duration_s=args.duration_s,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout_s,
    )
    if args.prompts:
        with open(args.prompts) as f:
            cfg.prompts = list(json.load(f))
    if args.check_exact:
        cfg.references = asyncio.run(reference_texts(cfg))
    result = asyncio.run(run_load(cfg))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0 if result["lost"] == result["hung"] == result["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
