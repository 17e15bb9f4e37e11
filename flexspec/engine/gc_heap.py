"""Keep CPython's cyclic garbage collector off the engine's long-lived heap (as vLLM's ``freeze_gc_heap``).

A built engine holds ~0.3-1M objects the collector tracks (modules, tokenizer, graph and cache bookkeeping) that
live as long as it does. Every full (generation-2) collection walks all of them: on an H100 host, one
``spec_bench`` process over MT-Bench ran 28 such collections of up to 323 ms each (6.5 s in all), which land in
the middle of decode steps (a 0.3 s stall in a 0.6 s benchmark point; a latency spike for every request in
flight). ``gc.freeze`` after start-up moves them to the permanent generation, which collections skip; objects
created while serving (requests, outputs) are collected as before.

A dropped engine sits in reference cycles that only the collector frees, so a frozen one would never be freed:
the next engine built in the same process unfreezes first (``release_frozen``), which restores the behaviour
without freezing for whatever is garbage by then.
"""

from __future__ import annotations

import atexit
import gc
import time

_unfreeze_at_exit: list[bool] = []


def release_frozen() -> None:
    """Give frozen objects back to the collector (they join the oldest generation; nothing is collected now)."""
    if gc.get_freeze_count():
        gc.unfreeze()


def freeze_long_lived() -> float:
    """Collect garbage, then freeze every surviving object (``gc.collect(); gc.freeze()``). Returns the seconds
    it took (a full collection: ~0.1-0.3 s after building an engine)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:  # the interpreter's last collections must see them (nanobind reports leaks)
        atexit.register(release_frozen)
        _unfreeze_at_exit.append(True)
    return time.perf_counter() - t0
