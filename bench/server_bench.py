"""Server-level mode of ``bench.spec_bench``: HTTP load with concurrency C against running OpenAI-compatible
servers (our Serve app, vLLM's server, ...), one ``--url LABEL=URL`` per server; the first is the baseline of
the throughput ratio (e.g. ``plain=http://host:8000 ngram=http://host:8001``).

Each point keeps C streaming requests in flight (closed loop) over ``max(num_prompts, C)`` prompts: chat
prompts go to ``/v1/chat/completions``, raw prompts (HumanEval) to ``/v1/completions``, with
``stream_options.include_usage`` so output tokens come from the exact usage. TTFT = first content chunk - send
time; ITL = gaps between content chunks (a chunk may carry several tokens); TPOT = (last - first) / (n - 1).
Spec-decode counters (``vllm:spec_decode_*``) and our step counters (``flexspec:engine_step*``) are scraped
from ``/metrics`` before and after each point; fields stay null when the server does not export them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from bench.common import Budget, JsonReport, cycle_to, log, progress, prompt_texts, short_error, summarize_ms

_SAMPLE = re.compile(r"^(?:ray_)?([a-zA-Z_:][a-zA-Z0-9_:]*?)(?:_total)?(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format -> ``{name: [(labels, value)]}``; ``ray_`` prefixes and ``_total`` suffixes
    are dropped so vLLM's names match however they are exported."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group(2) or ""))
            out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def _sum(metrics: dict[str, Any], name: str) -> float | None:
    series = metrics.get(name)
    return sum(v for _, v in series) if series else None


def _by_label(metrics: dict[str, Any], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in metrics.get(name, []):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + v
    return out


def server_spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    drafts = (_sum(after, "vllm:spec_decode_num_drafts") or 0) - (
        _sum(before, "vllm:spec_decode_num_drafts") or 0
    )
    if _sum(after, "vllm:spec_decode_num_drafts") is None:
        return None
    dt = (_sum(after, "vllm:spec_decode_num_draft_tokens") or 0) - (
        _sum(before, "vllm:spec_decode_num_draft_tokens") or 0
    )
    acc = (_sum(after, "vllm:spec_decode_num_accepted_tokens") or 0) - (
        _sum(before, "vllm:spec_decode_num_accepted_tokens") or 0
    )
    pa = _by_label(after, "vllm:spec_decode_num_accepted_tokens_per_pos", "position")
    pb = _by_label(before, "vllm:spec_decode_num_accepted_tokens_per_pos", "position")
    per_pos = [pa[k] - pb.get(k, 0.0) for k in sorted(pa, key=lambda x: int(x) if x.isdigit() else 0)]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(dt),
        "num_accepted_tokens": int(acc),
        "num_accepted_tokens_per_pos": [int(x) for x in per_pos],
        "mean_acceptance_length": round(1 + acc / drafts, 4) if drafts else 1.0,
        "acceptance_rate": round(acc / dt, 4) if dt else 0.0,
        "per_position_acceptance": [round(x / drafts, 4) if drafts else 0.0 for x in per_pos],
    }


def server_step_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    steps_a = _by_label(after, "flexspec:engine_steps", "mode")
    if not steps_a:
        return None
    steps_b = _by_label(before, "flexspec:engine_steps", "mode")
    sec_a = _by_label(after, "flexspec:engine_step_seconds", "mode")
    sec_b = _by_label(before, "flexspec:engine_step_seconds", "mode")
    out = {}
    for mode, n in steps_a.items():
        dn = n - steps_b.get(mode, 0.0)
        if dn > 0:
            ds = sec_a.get(mode, 0.0) - sec_b.get(mode, 0.0)
            out[mode] = {"num_steps": int(dn), "step_ms": round(ds / dn * 1e3, 4)}
    return out or None


async def _one_request(client: Any, url: str, model: str, row: dict, args: Any, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": seed,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if row["chat"]:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": row["prompt"]}]
    else:
        path, body["prompt"] = "/v1/completions", row["prompt"]
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if row["chat"] else ch.get("text")
                if piece:
                    times.append(time.perf_counter())
    n = (usage or {}).get("completion_tokens", len(times))
    return {"t0": t0, "times": times, "tokens": n}


async def _load(
    url: str, model: str, rows: list[dict], concurrency: int, args: Any, desc: str
) -> dict[str, Any]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for i, r in enumerate(rows):
        queue.put_nowait((i, r))
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    bar = progress(len(rows), desc, not args.no_progress)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency)
    ) as c:

        async def worker() -> None:
            while not queue.empty():
                i, row = queue.get_nowait()
                try:
                    results.append(await _one_request(c, url, model, row, args, args.seed + i))
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(short_error(e, 300))
                bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    bar.close()
    return {"results": results, "errors": errors, "wall": wall}


def _get(url: str, path: str) -> str | None:
    import httpx

    try:
        r = httpx.get(url + path, timeout=30.0)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def run_server(args: Any, report: JsonReport, budget: Budget) -> None:
    """Measure every ``--url`` at every dataset x concurrency; points go to ``report.doc["runs"]``."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise SystemExit("server mode needs httpx (pip install httpx)") from None
    if not args.url:
        raise SystemExit("server mode needs at least one --url LABEL=URL")
    servers = []
    for item in args.url:
        label, _, url = item.partition("=") if "=" in item else ("server", "", item)
        servers.append((label, url.rstrip("/")))
    baseline = servers[0][0]
    report.doc["config"]["servers"] = dict(servers)
    for label, url in servers:
        model = args.served_model
        if model is None:
            models = _get(url, "/v1/models")
            if models is None:
                report.doc["errors"].append(
                    {"system": label, "stage": "GET /v1/models", "error": f"{url} unreachable"}
                )
                continue
            model = json.loads(models)["data"][0]["id"]
        for dataset in args.dataset:
            rows = prompt_texts(dataset, args.num_prompts)
            for b in args.batch_sizes:
                point: dict[str, Any] = {
                    "mode": "server",
                    "dataset": dataset,
                    "system": label,
                    "url": url,
                    "served_model": model,
                    "batch_size": b,
                    "concurrency": b,
                    "baseline": baseline,
                }
                if budget.exhausted():
                    report.doc["runs"].append({**point, "skipped": "time budget exhausted"})
                    continue
                m0 = parse_prometheus(_get(url, "/metrics") or "")
                try:
                    res = asyncio.run(
                        _load(
                            url,
                            model,
                            cycle_to(rows, max(args.num_prompts, b)),
                            b,
                            args,
                            f"{label} {dataset} C={b}",
                        )
                    )
                except Exception as e:  # noqa: BLE001
                    report.doc["runs"].append({**point, "error": short_error(e)})
                    report.save()
                    continue
                m1 = parse_prometheus(_get(url, "/metrics") or "")
                ok = res["results"]
                tokens = sum(r["tokens"] for r in ok)
                ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
                itl = [b2 - a for r in ok for a, b2 in zip(r["times"], r["times"][1:])]
                tpot = [
                    (r["times"][-1] - r["times"][0]) / (r["tokens"] - 1)
                    for r in ok
                    if len(r["times"]) > 1 and r["tokens"] > 1
                ]
                e2e = [r["times"][-1] - r["t0"] for r in ok if r["times"]]
                point.update(
                    num_requests=len(ok) + len(res["errors"]),
                    num_errors=len(res["errors"]),
                    first_errors=res["errors"][:3],
                    output_tokens=tokens,
                    wall_s=round(res["wall"], 4),
                    output_tokens_per_s=round(tokens / res["wall"], 3) if res["wall"] > 0 else None,
                    spec_decode=server_spec_delta(m0, m1),
                    step_time=server_step_delta(m0, m1),
                    latency={
                        "ttft_ms": summarize_ms(ttft),
                        "itl_ms": summarize_ms(itl),
                        "tpot_ms": summarize_ms(tpot),
                        "e2e_ms": summarize_ms(e2e),
                    },
                )
                report.doc["runs"].append(point)
                report.save()
                log(f"server {label} {dataset} C={b}: {point['output_tokens_per_s']} tok/s")
