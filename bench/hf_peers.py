"""transformers peers on the same prompts, dtype and sampling as our engine.

Systems (``HF_SYSTEMS``):

- ``hf_dynamic``: ``generate`` with the default dynamic cache, eager.
- ``hf_static_compile``: transformers' documented static-cache recipe, done explicitly so it finishes in bounded
  time: a ``StaticCache`` of fixed length per batch size (``max_cache_len`` = pad length + new tokens), reused
  across calls (fixed addresses: no CUDA-graph re-recording), and the decode forward compiled once per batch size
  with ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)``. The prefill runs
  eagerly (as in transformers' own auto-compile: it would otherwise compile once per prompt length). On CUDA every
  compiled call starts with ``torch.compiler.cudagraph_mark_step_begin()`` and the logits are cloned (the fix for
  "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run", DEVICE.md). Runs on CPU
  too (inductor + gcc; no CUDA graphs there).
- ``hf_static_compile_default`` / ``hf_static_compile_mnc``: the same with ``mode="default"`` /
  ``"max-autotune-no-cudagraphs"`` (no CUDA graphs; the latter autotunes GEMMs, long compile).
- ``hf_static_compile_auto``: ``cache_implementation="static"`` and transformers' own auto-compile (its
  ``CompileConfig`` default, reduce-overhead; CUDA only; a new cache per call).
- ``hf_prompt_lookup``: prompt lookup decoding (``prompt_lookup_num_tokens=K``); transformers supports it at batch 1.
- ``hf_assisted``: assisted generation with a draft model (``assistant_model``); batch 1.

Why the first H200 run of a compiled peer never finished: it compiled the whole ``model.forward`` (prefill
included) without ``fullgraph``, on transformers' fresh static cache of every ``generate`` call, under a run-wide
budget that is checked only between points, so one point's compile could outlast the device's limit.
Now each compiled system gets its own time budget (``SystemBudget``), enforced inside calls too: points that
cannot finish in it are recorded as skipped, with the reason.

Batches are left-padded to one common prompt length so compiled variants see a fixed shape per batch size.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

HF_SYSTEMS = (
    "hf_dynamic",
    "hf_static_compile",
    "hf_static_compile_default",
    "hf_static_compile_mnc",
    "hf_static_compile_auto",
    "hf_prompt_lookup",
    "hf_assisted",
)
COMPILE_MODES = {  # our explicit static-cache compile, by system
    "hf_static_compile": "reduce-overhead",
    "hf_static_compile_default": "default",
    "hf_static_compile_mnc": "max-autotune-no-cudagraphs",
}
AUTO_COMPILE = "hf_static_compile_auto"
COMPILED = (*COMPILE_MODES, AUTO_COMPILE)
BATCH1_ONLY = ("hf_prompt_lookup", "hf_assisted")
DEFAULT_SYSTEM_BUDGET_S = 300.0


class Unsupported(Exception):
    """This peer cannot run this configuration (recorded as skipped, with the reason)."""


class PeerTimeout(Exception):
    """A peer system ran past its own time budget (the point and the rest of the system are skipped)."""


class SystemBudget:
    """Wall-clock budget of one peer system (compile, warm-up and all its points), started at construction.

    ``guard()`` bounds a single call too: in the main thread a SIGALRM at the deadline raises ``PeerTimeout``
    inside it (a compile that would run for hours is interrupted); elsewhere only between calls.
    """

    def __init__(self, system: str, seconds: float | None) -> None:
        self.system = system
        self.seconds = seconds if seconds and seconds > 0 else None
        self.t0 = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float | None:
        return None if self.seconds is None else self.seconds - self.elapsed

    def reason(self) -> str:
        return f"{self.system}: its time budget of {self.seconds:g} s is exhausted (--peer-time-budget-s)"

    def exhausted(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    def check(self) -> None:
        if self.exhausted():
            raise PeerTimeout(self.reason())

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        self.check()
        left = self.remaining()
        if left is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        other_delay, other_interval = signal.getitimer(signal.ITIMER_REAL)
        if (
            other_delay and other_delay <= left
        ):  # someone's earlier alarm (e.g. pytest-timeout) stays in charge
            yield
            return

        fired = False

        def on_alarm(signum: int, frame: Any) -> None:
            nonlocal fired
            fired = True
            raise PeerTimeout(self.reason() + " (interrupted mid-call)")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
        t0 = time.monotonic()
        try:
            yield
        except PeerTimeout:
            raise
        except Exception as e:  # e.g. dynamo wraps the alarm's exception raised inside tracing
            if fired:
                raise PeerTimeout(self.reason() + " (interrupted mid-call)") from e
            raise
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if other_delay:  # re-arm the later alarm we displaced, for the time it had left
                left_other = max(other_delay - (time.monotonic() - t0), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left_other, other_interval)


@dataclass
class BatchResult:
    wall_s: float
    output_tokens: int
    token_ids: list[list[int]]


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (``torch._dynamo`` counters): the delta over a run shows how
    often a compiled peer (re)compiled."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - private counters; absent means unknown
        return -1


class HFPeer:
    """One transformers model (+ optional assistant) on the benchmark's device and dtype."""

    def __init__(self, model_dir: str, device: str, dtype: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = torch.device(device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else list(eos or []))
        pad = gc.pad_token_id if gc.pad_token_id is not None else self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self._assistants: dict[str, Any] = {}
        # transformers >= 5.20 names the cache argument ``cache`` (``past_key_values`` before, still accepted)
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._static_caches: dict[tuple[int, int], Any] = {}  # (batch, max_cache_len) -> StaticCache
        self._compiled: dict[str, Callable[..., Any]] = {}  # compile mode -> compiled model.forward

    def assistant(self, model_dir: str) -> Any:
        if model_dir not in self._assistants:
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
            self._assistants[model_dir] = m
        return self._assistants[model_dir]

    # ---- one generate call -----------------------------------------------------------------------------------
    def _pad(self, batch: list[list[int]], pad_to: int) -> tuple[Any, Any]:
        torch = self.torch
        ids = torch.full((len(batch), pad_to), self.pad_id, dtype=torch.long)  # [b, P]
        mask = torch.zeros((len(batch), pad_to), dtype=torch.long)  # [b, P]
        for i, p in enumerate(batch):
            if len(p) > pad_to:
                raise ValueError(f"prompt of {len(p)} tokens exceeds pad length {pad_to}")
            ids[i, pad_to - len(p) :] = torch.tensor(p)
            mask[i, pad_to - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _static_cache(self, batch_size: int, max_cache_len: int) -> Any:
        """One ``StaticCache`` per (batch, length), zeroed and reused: the compiled decode step sees the same
        tensors every call (transformers' own path allocates a fresh cache per ``generate``)."""
        key = (batch_size, max_cache_len)
        cache = self._static_caches.get(key)
        if cache is None:
            from transformers import StaticCache

            cache = self._static_caches[key] = StaticCache(
                config=self.model.config, max_cache_len=max_cache_len
            )
        else:
            cache.reset()
        return cache

    @contextlib.contextmanager
    def _compiled_decode(self, mode: str) -> Iterator[None]:
        """Route decode steps (not the prefill) of the next ``generate`` through the compiled forward."""
        torch, model = self.torch, self.model
        eager = model.forward
        compiled = self._compiled.get(mode)
        if compiled is None:
            compiled = torch.compile(eager, mode=mode, fullgraph=True, dynamic=False)
            self._compiled[mode] = compiled
        cuda = self.device.type == "cuda"
        calls = 0

        def forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:  # the prefill: eager (any prompt length; initializes the cache outside the graph)
                return eager(*args, **kwargs)
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(*args, **kwargs)
            if cuda:
                out.logits = out.logits.clone()  # [b, 1, V] outlives the next graph replay
            return out

        model.forward = forward
        try:
            yield
        finally:
            del model.forward

    @contextlib.contextmanager
    def _system(self, system: str, batch_size: int, max_cache_len: int) -> Iterator[dict[str, Any]]:
        """Generate kwargs for ``system`` (and temporary model patches, undone on exit)."""
        if system == "hf_dynamic" or system in BATCH1_ONLY:
            yield {}
            return
        if system in COMPILE_MODES:
            cache = self._static_cache(batch_size, max_cache_len)
            with self._compiled_decode(COMPILE_MODES[system]):
                yield {self._cache_kwarg: cache, "disable_compile": True}
            return
        if system == AUTO_COMPILE:
            if self.device.type != "cuda":
                raise Unsupported("transformers auto-compiles static-cache decoding only on CUDA")
            from transformers import CompileConfig

            yield {"cache_implementation": "static", "compile_config": CompileConfig()}
            return
        raise ValueError(f"unknown transformers system {system!r}; known: {HF_SYSTEMS}")

    def generate(
        self,
        system: str,
        batch: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        pad_to: int | None = None,
        num_speculative_tokens: int | None = None,
        max_matching_ngram_size: int | None = None,
        assistant_dir: str | None = None,
    ) -> BatchResult:
        """One ``generate`` call over ``batch`` (token id lists); wall time includes prefill."""
        torch = self.torch
        if system in BATCH1_ONLY and len(batch) != 1:
            raise Unsupported(
                f"{system}: transformers supports assisted / prompt-lookup decoding at batch 1 only"
            )
        if pad_to is None or system == "hf_dynamic" or system in BATCH1_ONLY:
            pad_to = max(len(p) for p in batch)  # fixed pad length only where compiled shapes need it
        ids, mask = self._pad(batch, pad_to)
        kwargs: dict[str, Any] = {
            "attention_mask": mask,
            "max_new_tokens": max_new_tokens,
            "pad_token_id": self.pad_id,
            "do_sample": temperature > 0,
        }
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
        if system == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = num_speculative_tokens or 5
            if max_matching_ngram_size:
                kwargs["max_matching_ngram_size"] = max_matching_ngram_size
        if system == "hf_assisted":
            if not assistant_dir:
                raise Unsupported("hf_assisted needs a draft model (a draft_model speculative config)")
            kwargs["assistant_model"] = self.assistant(assistant_dir)
            if num_speculative_tokens:
                kwargs["assistant_model"].generation_config.num_assistant_tokens = num_speculative_tokens
                kwargs["assistant_model"].generation_config.num_assistant_tokens_schedule = "constant"
        gc = self.model.generation_config
        saved_eos = gc.eos_token_id
        if ignore_eos:
            gc.eos_token_id = None  # generate() fills unset values from here; None = never stop early
        try:
            with torch.inference_mode(), self._system(system, len(batch), pad_to + max_new_tokens) as extra:
                kwargs.update(extra)
                self._sync()
                t0 = time.perf_counter()
                out = self.model.generate(ids, **kwargs)
                self._sync()
                wall = time.perf_counter() - t0
        finally:
            gc.eos_token_id = saved_eos
        gen = out[:, pad_to:].tolist()
        token_ids = []
        for row in gen:
            if not ignore_eos:
                stop = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
                row = row if stop is None else row[: stop + 1]
            token_ids.append(row)
        return BatchResult(wall, sum(len(r) for r in token_ids), token_ids)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def reset_compile(self) -> None:
        """Forget compiled graphs and static caches (after a failed or finished compiled system)."""
        self._compiled.clear()
        self._static_caches.clear()
        with contextlib.suppress(Exception):
            self.torch._dynamo.reset()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


def run_requests(
    peer: HFPeer,
    system: str,
    prompts: list[list[int]],
    batch_size: int,
    max_new_tokens: int,
    temperature: float,
    ignore_eos: bool,
    pad_to: int,
    warmup: bool = True,
    budget: SystemBudget | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """All ``prompts`` in static batches of ``batch_size`` (the last may be smaller); returns the run record.

    The warm-up call (outside the timed region) uses the first batch at full length, so compiled variants
    compile before timing. Every call runs under ``budget`` (``PeerTimeout`` when it runs out).
    """
    if system in BATCH1_ONLY and batch_size != 1:
        raise Unsupported(
            f"{system}: transformers supports assisted / prompt-lookup decoding at batch 1 only"
        )
    guard = budget.guard if budget is not None else contextlib.nullcontext
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    graphs0 = compiled_graph_count()
    warm_s = None
    if warmup:
        t0 = time.perf_counter()
        compiled = system in COMPILED
        with guard():
            peer.generate(
                system,
                batches[0],
                max_new_tokens if compiled else min(8, max_new_tokens),
                temperature,
                ignore_eos,
                pad_to,
                **kw,
            )
        warm_s = time.perf_counter() - t0
    graphs1 = compiled_graph_count()
    wall = 0.0
    tokens = 0
    outs: list[list[int]] = []
    for b in batches:
        with guard():
            r = peer.generate(system, b, max_new_tokens, temperature, ignore_eos, pad_to, **kw)
        wall += r.wall_s
        tokens += r.output_tokens
        outs.extend(r.token_ids)
    rec = {
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "output_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "warmup_s": round(warm_s, 3) if warm_s is not None else None,
        "batching": "static batches (transformers generate)",
        "token_ids": outs,
    }
    if system in COMPILED and graphs0 >= 0:
        rec["compiled_graphs"] = {"warmup": graphs1 - graphs0, "timed": compiled_graph_count() - graphs1}
    return rec


def matching_fraction(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Share of sequences identical to ``reference`` (e.g. a compiled peer vs ``hf_dynamic`` at T=0)."""
    pairs = list(zip(outputs, reference))
    return round(sum(x == y for x, y in pairs) / len(pairs), 4) if pairs else 0.0
