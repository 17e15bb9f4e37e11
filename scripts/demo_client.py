"""The demo's client: ask one streamed chat question, print the answer as it arrives, then one summary line
(tokens, time, speculative-decoding acceptance from the server's ``/metrics``).

    python scripts/demo_client.py --url http://127.0.0.1:8000 [--model NAME] [--question TEXT] [--max-tokens N]

Plain HTTP (httpx) and prometheus-client's text parser, both dependencies of ``flexspec[serve]``. The acceptance
numbers are the server's counters since it started (the demo's server answers only this request): mean
acceptance length (MAL) = 1 + accepted / drafts, as vLLM defines it. Exit code 1 when the request fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODE_STEPS = "flexspec:execution_mode_steps"
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def stream_chat(client: httpx.Client, model: str, question: str, max_tokens: int) -> dict:
    """Stream one chat completion, writing its text to stdout as it arrives.

    Returns:
        ``{"text", "completion_tokens", "seconds", "ttft_s", "finish_reason"}``.

    Raises:
        RuntimeError: an HTTP error status or an error event in the stream (the server's message).
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    usage: dict = {}
    finish = None
    ttft = None
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", str(chunk["error"])))
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(text)
                    sys.stdout.write(text)
                    sys.stdout.flush()
                finish = choice.get("finish_reason") or finish
    return {
        "text": "".join(parts),
        "completion_tokens": usage.get("completion_tokens", 0),
        "seconds": time.perf_counter() - t0,
        "ttft_s": ttft,
        "finish_reason": finish,
    }


def spec_counters(metrics_text: str) -> dict[str, float]:
    """The speculative-decoding counters of a ``/metrics`` page, summed over engines; {} without speculation."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        values = [s.value for s in family.samples if s.name.endswith("_total")]
        if family.name in SPEC_COUNTERS and values:  # declared without samples when speculation is off
            totals[family.name] = sum(values)
        if family.name == MODE_STEPS:  # steps per execution mode the policy chose: "mode:plain" -> count
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = f"mode:{sample.labels.get('mode', '?')}"
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def spec_summary(counters: dict[str, float]) -> str:
    """``speculative decoding: mean acceptance length 2.05 (accepted 101 of 615 draft tokens in 98 verifications)``."""
    drafts = counters.get("vllm:spec_decode_num_drafts")
    if drafts is None:
        return "speculative decoding: off"
    if drafts == 0:
        return "speculative decoding: no drafts yet"
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    draft_tokens = counters.get("vllm:spec_decode_num_draft_tokens", 0.0)
    modes = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("mode:")}
    steps = sum(modes.values())
    plain = modes.get("plain", 0.0)
    share = (
        f"; the policy speculated in {steps - plain:.0f} of {steps:.0f} steps (each speculative stretch starts "
        "with a step that has no drafts to verify; plain decoding where it expected that to be faster)"
        if steps
        else ""
    )
    return (
        f"speculative decoding: mean acceptance length {1 + accepted / drafts:.2f} "
        f"(accepted {accepted:.0f} of {draft_tokens:.0f} draft tokens in {drafts:.0f} verifications){share}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Server base URL.")
    parser.add_argument("--model", default=None, help="Served model name (default: the first of /v1/models).")
    parser.add_argument(
        "--question", default="Write a Python function that returns the n-th Fibonacci number."
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    key = os.environ.get("FLEXSPEC_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        print(f"Q: {args.question}\nA: ", end="", flush=True)
        try:
            model = args.model or client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            out = stream_chat(client, model, args.question, args.max_tokens)
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
        metrics = client.get("/metrics")
        spec = spec_summary(spec_counters(metrics.text)) if metrics.status_code == 200 else "no /metrics"
    rate = out["completion_tokens"] / out["seconds"] if out["seconds"] > 0 else 0.0
    ttft = f", first token after {out['ttft_s']:.2f} s" if out["ttft_s"] is not None else ""
    print(
        f"\n\n{out['completion_tokens']} tokens in {out['seconds']:.2f} s ({rate:.1f} tokens/s{ttft}, "
        f"finish: {out['finish_reason']}); {spec}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
