"""transformers peers on the same prompts, dtype and sampling as our engine.

Systems (``HF_SYSTEMS``):

- ``hf_dynamic``: ``generate`` with the default dynamic cache, eager.
- ``hf_static_compile``: ``cache_implementation="static"``; transformers then compiles the decode forward itself
  (``CompileConfig`` default: ``mode="reduce-overhead"``, CUDA graphs through cudagraph trees). This is the path
  transformers documents; it auto-compiles only on CUDA.
- ``hf_static_compile_default`` / ``hf_static_compile_mnc``: the same with ``mode="default"`` /
  ``"max-autotune-no-cudagraphs"`` (no CUDA graphs; the latter autotunes GEMMs, long compile).
- ``hf_static_compile_markstep``: static cache with the forward wrapped by us in
  ``torch.compile(model.forward, mode="reduce-overhead")``, calling ``torch.compiler.cudagraph_mark_step_begin()``
  before every call and cloning the logits: the fix for "accessing tensor output of CUDAGraphs that has been
  overwritten by a subsequent run" seen with a plain manual compile (DEVICE.md).
- ``hf_prompt_lookup``: prompt lookup decoding (``prompt_lookup_num_tokens=K``); transformers supports it at batch 1.
- ``hf_assisted``: assisted generation with a draft model (``assistant_model``); batch 1.

Batches are left-padded to one common prompt length so compiled variants see a fixed shape per batch size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HF_SYSTEMS = (
    "hf_dynamic",
    "hf_static_compile",
    "hf_static_compile_default",
    "hf_static_compile_mnc",
    "hf_static_compile_markstep",
    "hf_prompt_lookup",
    "hf_assisted",
)
COMPILE_MODES = {
    "hf_static_compile": None,  # transformers' default CompileConfig (reduce-overhead)
    "hf_static_compile_default": "default",
    "hf_static_compile_mnc": "max-autotune-no-cudagraphs",
}
BATCH1_ONLY = ("hf_prompt_lookup", "hf_assisted")


class Unsupported(Exception):
    """This peer cannot run this configuration (recorded as skipped, with the reason)."""


@dataclass
class BatchResult:
    wall_s: float
    output_tokens: int
    token_ids: list[list[int]]


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

    @contextlib.contextmanager
    def _system(self, system: str) -> Iterator[dict[str, Any]]:
        """Generate kwargs for ``system`` (and temporary model patches, undone on exit)."""
        torch = self.torch
        if system == "hf_dynamic" or system in BATCH1_ONLY:
            yield {}
            return
        if self.device.type != "cuda":
            raise Unsupported("transformers compiles static-cache decoding only on CUDA")
        if system in COMPILE_MODES:
            from transformers import CompileConfig

            mode = COMPILE_MODES[system]
            yield {
                "cache_implementation": "static",
                "compile_config": CompileConfig() if mode is None else CompileConfig(mode=mode),
            }
            return
        if system == "hf_static_compile_markstep":
            model = self.model
            compiled = getattr(self, "_markstep_forward", None)
            if compiled is None:
                compiled = self._markstep_forward = torch.compile(model.forward, mode="reduce-overhead")

            def forward(*args: Any, **kwargs: Any) -> Any:
                torch.compiler.cudagraph_mark_step_begin()
                out = compiled(*args, **kwargs)
                out.logits = out.logits.clone()  # [b, t, V] outlives the next graph replay
                return out

            model.forward = forward
            try:
                yield {"cache_implementation": "static", "disable_compile": True}
            finally:
                del model.forward
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
            with self._system(system) as extra, torch.inference_mode():
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
        """Forget compiled graphs (after a failed or finished compiled system)."""
        self.__dict__.pop("_markstep_forward", None)
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
    **kw: Any,
) -> dict[str, Any]:
    """All ``prompts`` in static batches of ``batch_size`` (the last may be smaller); returns the run record.

    The warm-up call uses the first batch at full length, so compiled variants compile before timing.
    """
    if system in BATCH1_ONLY and batch_size != 1:
        raise Unsupported(
            f"{system}: transformers supports assisted / prompt-lookup decoding at batch 1 only"
        )
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    warm_s = None
    if warmup:
        t0 = time.perf_counter()
        compiled = system not in ("hf_dynamic", *BATCH1_ONLY)
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
    wall = 0.0
    tokens = 0
    outs: list[list[int]] = []
    for b in batches:
        r = peer.generate(system, b, max_new_tokens, temperature, ignore_eos, pad_to, **kw)
        wall += r.wall_s
        tokens += r.output_tokens
        outs.extend(r.token_ids)
    return {
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "output_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "warmup_s": round(warm_s, 3) if warm_s is not None else None,
        "batching": "static batches (transformers generate)",
        "token_ids": outs,
    }
