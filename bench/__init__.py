"""Benchmark harness: one command per claim, JSON out (issues 2 and 7).

Modules (each runnable as ``python -m bench.<name>``; argparse only, so they run where typer/rich are absent):

- ``engine_bench``: output tokens/s of our engine vs transformers ``generate`` (dynamic cache; static cache +
  torch.compile) at batch 1/8/32/64, and our batch-1 decode step time (issue 2).
- ``spec_bench``: plain vs speculative decoding on real prompt sets: throughput ratio, MAL, acceptance,
  per-position acceptance, step-time split, TTFT / ITL percentiles; engine-level or server-level.
- ``synthetic``: projected throughput ratio of a Qwen3-8B-shaped target with random weights, acceptance
  replayed from a per-position profile (a projection, not a measurement).
- ``plots``: PNGs from the JSON files.

Shared pieces: ``common`` (environment record, JSON report, percentiles, prompts, progress bars),
``engine_load`` (closed-loop driver of ``LLMEngine`` with step timers), ``hf_peers`` (transformers peers),
``vllm_peer`` (vLLM in a subprocess), ``server_bench`` (HTTP load against an OpenAI-compatible server).
"""
